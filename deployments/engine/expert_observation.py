"""What an expert-parallel vLLM worker reports about its experts, on every platform.

vLLM takes one ``worker_extension_cls`` per engine: expert-parallel ranks name
``ExpertObservation`` on GPU, and on CPU the CPU shim's class, which inherits it
(``expert_ranks.rank_engine_spec``). Its methods answer ``collective_rpc``: which experts each
MoE layer holds, how many (token, expert) assignments this worker's experts computed, and the
bytes of its weights.

Where routes are counted: ``FusedMoEKernelModularImpl._fused_experts``, the one place every
modular fused-MoE kernel passes on every platform after its dispatcher ran (all-gather,
all-to-all) and before the platform's expert kernel, so what is counted is what this worker's
experts compute. A dispatcher that reports ``expert_num_tokens`` per local expert (DeepEP's
high-throughput and low-latency kernels; the low-latency batched layout carries no per-token
ids) is counted from that; otherwise from the ids, which after the all-gather dispatcher
(vLLM's default, and the CPU path) are every rank's tokens, filtered by ``expert_map``. The
counting is tensor code on the ids' device (``expert_route_counts``), safe inside CUDA graphs.

Why not EPLB's ``expert_load_pass`` / ``expert_load_window`` on GPU: vLLM records them only in
the steps before a rearrangement (``should_record_tensor``), zeroes the pass every step, and
records at the router, before dispatch, so with the all-gather dispatcher every rank counts all
ranks' tokens. That is a sampled window, not a counter of one rank's work. With EPLB on, the
ids reaching the experts are physical slots (redundant replicas have their own ids), so the
counts are by physical slot, and ``local_experts`` reads from EPLB's current
``logical_to_physical_map`` which logical expert each held slot serves.

Not counted: monolithic kernels (routing inside the kernel, no ids in Python). Counted besides
real tokens: vLLM's warm-up and keep-alive dummy batches and, under CUDA graphs, padding rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from deployments.engine.expert_route_counts import RouteCounters
from deployments.engine.vllm_interface import require_params, vllm_symbol

logger = logging.getLogger(__name__)

_OWNER = "deployments/engine/expert_observation.py"
_KERNEL_MODULE = "vllm.model_executor.layers.fused_moe.modular_kernel"
_ROUTED_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.routed_experts"
_RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
# Parameters of FusedMoEKernelModularImpl._fused_experts the counting reads; a rename in vLLM
# must fail install_route_counting().
FUSED_EXPERTS_PARAMS = ("self", "topk_ids", "global_num_experts", "local_num_experts", "expert_map",
                        "expert_tokens_meta")
_PATCH_MARK = "__moe_serve_route_counting__"

# This worker process's counts (each vLLM worker is its own process, with one device).
ROUTE_COUNTERS = RouteCounters()
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def count_dispatched_routes(arguments: dict[str, Any], counters: RouteCounters | None = None) -> None:
    """Count one `_fused_experts` call's work (its bound arguments) into `counters` (this
    process's by default). Never raises: observing must not fail a forward pass."""
    counters = ROUTE_COUNTERS if counters is None else counters
    try:
        per_expert = getattr(arguments.get("expert_tokens_meta"), "expert_num_tokens", None)
        num_experts, expert_map = int(arguments["global_num_experts"]), arguments["expert_map"]
        if per_expert is not None and per_expert.numel() == int(arguments["local_num_experts"]):
            counted = counters.add_expert_tokens(per_expert, expert_map, num_experts)
        else:
            counted = counters.add_routes(arguments["topk_ids"], expert_map, num_experts)
        if not counted:
            _warn_once("capture", "expert route counter first reached inside a CUDA graph capture; "
                                  "routes of the captured graphs are not counted")
    except Exception as exc:  # a vLLM change in what the kernel passes: report it, keep serving
        _warn_once("error", "expert routes not counted: %s: %s", type(exc).__name__, exc)


def install_route_counting() -> None:
    """Wrap `_fused_experts` to count routes first; idempotent. RuntimeError if vLLM moved it."""
    kernel = vllm_symbol(_KERNEL_MODULE, "FusedMoEKernelModularImpl", _OWNER)
    original = kernel.__dict__.get("_fused_experts")
    if original is None:
        raise RuntimeError(f"moe-serve needs FusedMoEKernelModularImpl._fused_experts; update {_OWNER}")
    if getattr(original, _PATCH_MARK, False):
        return
    signature = require_params(original, "FusedMoEKernelModularImpl._fused_experts", FUSED_EXPERTS_PARAMS, _OWNER)

    @functools.wraps(original)
    def _fused_experts(self, *args, **kwargs):
        count_dispatched_routes(signature.bind(self, *args, **kwargs).arguments)
        return original(self, *args, **kwargs)

    setattr(_fused_experts, _PATCH_MARK, True)
    kernel._fused_experts = _fused_experts
    logger.info("Counting routed tokens per expert at FusedMoEKernelModularImpl._fused_experts")


def logical_experts_of(logical_to_physical: Sequence[Sequence[int]], physical_ids: Sequence[int]) -> list[int]:
    """The logical expert each physical slot serves, from EPLB's `[logical, replica]` map of
    physical ids (-1 for unused replicas); -1 for a slot the map does not name."""
    owner = {physical: logical for logical, replicas in enumerate(logical_to_physical)
             for physical in replicas if physical >= 0}
    return [owner.get(physical, -1) for physical in physical_ids]


def expert_layer_record(experts: Any, eplb_state: Any = None) -> dict:
    """One fused-MoE layer (vLLM's RoutedExperts): the global experts this worker holds; with
    EPLB (its layer state), the logical expert each held physical slot serves now."""
    manager = experts.expert_map_manager
    record = dict(layer_name=experts.layer_name, ep_rank=manager.ep_rank, ep_size=manager.ep_size,
                  global_num_experts=experts.global_num_experts, local_num_experts=experts.local_num_experts,
                  local_expert_ids=list(manager.get_local_expert_ids()))
    logical_to_physical = getattr(eplb_state, "logical_to_physical_map", None)  # [logical, replica]
    if logical_to_physical is not None:
        record["logical_expert_ids"] = logical_experts_of(logical_to_physical.tolist(), record["local_expert_ids"])
    return record


def _routed_experts_layers(model: Any) -> list[tuple[Any, Any]]:
    """(RoutedExperts, its EPLB layer state or None) per fused-MoE layer, in module order."""
    routed_experts_cls = vllm_symbol(_ROUTED_EXPERTS_MODULE, "RoutedExperts", _OWNER)
    runner_cls = vllm_symbol(_RUNNER_MODULE, "MoERunner", _OWNER)
    modules = list(model.modules())
    eplb_by_experts = {id(m.routed_experts): getattr(m.router, "eplb_state", None)
                       for m in modules if isinstance(m, runner_cls)}
    return [(m, eplb_by_experts.get(id(m))) for m in modules if isinstance(m, routed_experts_cls)]


# Import-time side effect on purpose: vLLM imports worker_extension_cls in every worker
# before its model is built (v1/worker/worker_base.py, init_worker), so no forward runs uncounted.
install_route_counting()


class ExpertObservation:
    """``worker_extension_cls="deployments.engine.expert_observation.ExpertObservation"``.

    Every attribute name here must be absent from vLLM's workers (vLLM asserts it when
    injecting the class), so helpers stay module functions.
    """

    def local_experts(self) -> list[dict]:
        """One record per fused-MoE layer (`expert_layer_record`)."""
        return [expert_layer_record(experts, eplb) for experts, eplb in _routed_experts_layers(self.get_model())]

    def routed_tokens_per_expert(self) -> dict[int, int]:
        """Cumulative (token, expert) assignments this worker's experts computed, by global
        expert id (physical slot with EPLB); only the experts it holds appear."""
        return ROUTE_COUNTERS.snapshot()

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of this worker's weights: all of them, and the routed experts' share."""
        model = self.get_model()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        experts = sum(p.numel() * p.element_size()
                      for module, _ in _routed_experts_layers(model) for p in module.parameters())
        return {"total": total, "routed_experts": experts}
