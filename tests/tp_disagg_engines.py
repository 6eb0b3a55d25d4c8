"""Prefill/decode between two tensor-parallel vLLM engines through our connector, no Ray.

Run as a script (vLLM spawns engine and worker processes, so it needs the __main__ guard):
    python tests/tp_disagg_engines.py MODEL_PATH OUT.json --tp 2 [--max-model-len N] [--dtype D]
Starts a prefill and a decode engine server (deployments.engine.llm_server.LLMServer, as Serve
runs them), each with `--tp` workers serving their shard of the KV on their own port. For each
prompt of the prompt set it prefills on one engine, decodes on the other from the pulled KV,
and writes {"outputs": {name: token_ids}, "decode_kv": ..., "prefill_kv": ..., "rank_ports": ...}
for tests/integration/test_kv_tensor_parallel_stack.py (CPU) and scripts/gpu_selfcheck.sh (CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.prompt_set import COMPLETION_PROMPTS, MAX_TOKENS  # noqa: E402

PROMPTS = ("long", "short")


async def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from cluster.manifest import EngineSpec
    from deployments.engine.llm_server import LLMServer
    from deployments.records import EngineFailure, EngineRequest, PrefillResult, TokenDelta

    model = {"name": "tp-check", "max_model_len": args.max_model_len, "dtype": args.dtype, "quantization": None}
    extra = {"distributed_executor_backend": "mp"} if args.tp > 1 else {}
    engine = EngineSpec(tensor_parallel_size=args.tp, max_num_seqs=4, extra_args=extra,
                        gpu_memory_utilization=args.gpu_memory_utilization).model_dump()
    secret = secrets.token_hex(32)
    kv = {"backend": "tcp", "host": "127.0.0.1", "lease_s": 60.0, "transfer_timeout_s": 30.0,
          "failure_policy": "fail", "grant_secret": secret}
    started = time.monotonic()
    prefill = LLMServer(model, engine, args.model_path, {**kv, "lends_kv": True}, metrics=False, pool="prefill")
    decode = LLMServer(model, engine, args.model_path, {**kv, "lends_kv": False}, metrics=False, pool="decode")
    print(f"engines up in {time.monotonic() - started:.0f}s", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    outputs, cached = {}, {}
    for name in PROMPTS:
        ids = tokenizer.encode(COMPLETION_PROMPTS[name])
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        lease = await prefill.prefill(EngineRequest(f"p-{name}", ids, sampling))
        if not isinstance(lease, PrefillResult):
            raise RuntimeError(f"prefill of {name!r} failed: {lease}")
        tokens: list[int] = []
        async for item in decode.generate(EngineRequest(f"d-{name}", ids, sampling, pull=lease.transfer_params)):
            if isinstance(item, EngineFailure):  # failure_policy fail: a failed pull fails here
                raise RuntimeError(f"decode of {name!r} failed: {item}")
            assert isinstance(item, TokenDelta)
            tokens += item.token_ids
            if item.cached_tokens is not None:
                cached[name] = item.cached_tokens
        outputs[name] = tokens
    await asyncio.sleep(1.0)  # the releases decode's workers sent
    prefill_kv, decode_kv = (await prefill.stats()).kv_transfer, (await decode.stats()).kv_transfer
    ports = {"prefill": list(range(prefill._kv["port"], prefill._kv["port"] + args.tp)),
             "decode": list(range(decode._kv["port"], decode._kv["port"] + args.tp))}
    per_rank = {role: [server._kv_client.stats("127.0.0.1", port, 5.0) for port in ports[role]]
                for role, server in (("prefill", prefill), ("decode", decode))}
    prefill.shutdown_engine()
    decode.shutdown_engine()
    return {"outputs": outputs, "cached_tokens": cached, "prefill_kv": prefill_kv, "decode_kv": decode_kv,
            "rank_ports": ports, "per_rank": per_rank, "tp": args.tp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_path")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, an integer
    # One core per TP worker on CPU (VLLM_CPU_FACTS.md: without a binding TP 2 refuses to start).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(args.tp)))
    result = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)  # vLLM's engine processes are gone; do not wait on their atexit hooks


if __name__ == "__main__":
    main()
