"""One rank of a data-parallel + expert-parallel vLLM engine group on CPU (for the tests).

    python tests/ep_rank.py RANK SIZE RPC_PORT MODEL_PATH DTYPE OUT.json PROMPT [PROMPT ...]

Each rank is its own AsyncLLM (vLLM's external load-balancing mode: rank 0 runs the DP
coordinator) with our CPU compatibility shim as worker extension. Writes the experts this rank
holds and the greedy token ids of its prompts (it may get none: idle ranks still take part in
every MoE collective through vLLM's dummy batches).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def run(rank: int, size: int, port: int, model: str, dtype: str, out: Path, prompts: list[str]) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.prompt_set import MAX_TOKENS

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype=dtype, enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.15,
        data_parallel_size=size, data_parallel_rank=rank, data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=port, enable_expert_parallel=True, data_parallel_backend="mp",
        distributed_executor_backend="mp",
        worker_extension_cls="deployments.engine.vllm_cpu_ep_compat.CpuExpertParallelCompat"))
    experts = (await llm.collective_rpc("local_experts"))[0]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(index: int, prompt: str) -> list[int]:
        final = None
        async for output in llm.generate(prompt, greedy, f"rank{rank}-{index}"):
            final = output
        return list(final.outputs[0].token_ids)

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    out.write_text(json.dumps({"experts": experts, "outputs": outputs}))
    await asyncio.sleep(3)  # let the other rank finish its wave before this rank leaves the group
    llm.shutdown()


if __name__ == "__main__":
    rank, size, port = (int(a) for a in sys.argv[1:4])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(rank % (os.cpu_count() or 1))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    asyncio.run(run(rank, size, port, sys.argv[4], sys.argv[5], Path(sys.argv[6]), sys.argv[7:]))
