"""One real vLLM fused-MoE layer on CPU, one forward, with expert observation installed (for
tests/unit/engine/test_expert_observation.py; its own process because vLLM's distributed state is
global).

    python tests/moe_layer_routes.py

Prints JSON: the routed-token counts our hook recorded and the router's own top-k choice
(softmax top-k of the logits, which is what the layer's router computes for this config).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from deployments.engine import expert_observation

    experts, top_k, tokens = 8, 2, 5
    config = VllmConfig()
    generator = torch.Generator().manual_seed(0)
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        layer = FusedMoEFactory(num_experts=experts, top_k=top_k, hidden_size=64, intermediate_size=32,
                                params_dtype=torch.float32, prefix="model.layers.0.mlp.experts")
        for parameter in layer.parameters():
            parameter.data.normal_(generator=generator)
        layer.routed_experts.quant_method.process_weights_after_loading(layer.routed_experts)
        hidden = torch.randn(tokens, 64, generator=generator)
        logits = torch.randn(tokens, experts, generator=generator)
        with set_forward_context(None, config):
            layer._forward_impl(hidden, logits, None)
    chosen = torch.topk(logits, top_k).indices.flatten().bincount(minlength=experts).tolist()
    print(json.dumps({"counted": expert_observation.ROUTE_COUNTERS.snapshot(),
                      "router": {e: n for e, n in enumerate(chosen) if n}}))


if __name__ == "__main__":
    main()
