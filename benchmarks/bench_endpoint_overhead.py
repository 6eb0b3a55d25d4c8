"""Our OpenAI endpoint (Serve proxy -> ingress -> engine replica) vs the same vLLM engine
called directly in-process, on the same checkpoint and the same trace, side by side.

    .venv/bin/python -m benchmarks.bench_endpoint_overhead --rounds 3

Both engines stay up for the whole run and the rounds alternate which goes first, so slow
drift of this shared machine hits both alike. Reports the median over rounds of each
metric and the endpoint/direct ratio. Writes benchmarks/results/endpoint_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.loadgen.client import run_trace, run_trace_with_backend
from benchmarks.loadgen.stats import Summary, format_table, summarize
from benchmarks.loadgen.trace import LengthSpec, TraceRequest, TraceSpec, make_trace

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


class DirectEngineBackend:
    """The baseline: vLLM's AsyncLLM in this process, no HTTP, no Ray."""

    def __init__(self, model_path: str, manifest):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from deployments.engine.vllm_engine import engine_args_dict

        pool = manifest.pools[0]
        args = engine_args_dict(manifest.model.model_dump(), pool.engine.model_dump(), model_path)
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self._counter = 0

    async def stream(self, request: TraceRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._counter += 1
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async for output in self._llm.generate(request.prompt, params, f"direct-{self._counter}"):
            if output.outputs[0].token_ids:
                yield len(output.outputs[0].token_ids)

    def shutdown(self):
        self._llm.shutdown()


def _median_summary(summaries: list[Summary]) -> dict:
    keys = {
        "request_throughput_rps": lambda s: s.request_throughput_rps,
        "output_throughput_tps": lambda s: s.output_throughput_tps,
        "goodput_rps": lambda s: s.goodput_rps,
        "ttft_p50_ms": lambda s: s.ttft.p50_ms, "ttft_p99_ms": lambda s: s.ttft.p99_ms,
        "itl_p50_ms": lambda s: s.itl.p50_ms, "itl_p99_ms": lambda s: s.itl.p99_ms,
        "tpot_p50_ms": lambda s: s.tpot.p50_ms, "tpot_p99_ms": lambda s: s.tpot.p99_ms,
        "e2e_p50_ms": lambda s: s.e2e.p50_ms, "e2e_p99_ms": lambda s: s.e2e.p99_ms,
        "failed": lambda s: s.num_failed,
    }
    return {k: statistics.median(f(s) for s in summaries) for k, f in keys.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(REPO / "manifests" / "local-colocated.yaml"))
    parser.add_argument("--base-url", default=None, help="use an already running endpoint instead of starting one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "endpoint_overhead.json"))
    args = parser.parse_args()

    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(args.manifest)
    model_path = str(resolve_model_path(manifest.model.path))
    trace = make_trace(TraceSpec(num_requests=args.num_requests, rate_rps=args.rate,
                                 prompt_tokens=LengthSpec(args.prompt_tokens, 0.25),
                                 output_tokens=LengthSpec(args.output_tokens), seed=0))
    slo = (manifest.slo.ttft_ms, manifest.slo.itl_ms)

    cluster = None
    base_url = args.base_url
    if base_url is None:
        from cluster.local_cluster import LocalCluster
        from cluster.serve_control import connect, deploy

        cluster = LocalCluster.for_manifest(manifest).start(progress=lambda m: print(f"[bench] {m}", file=sys.stderr))
        connect(cluster.address)
        base_url = deploy(manifest, progress=lambda m: print(f"[bench] {m}", file=sys.stderr)).url

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{manifest.pools[0].engine.cpu_kvcache_space_gib:g}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    direct = DirectEngineBackend(model_path, manifest)
    per_round: dict[str, list[Summary]] = {"direct vLLM": [], "moe-serve endpoint": []}

    async def run_round(index: int) -> None:
        order = ["direct vLLM", "moe-serve endpoint"]
        if index % 2:
            order.reverse()
        for label in order:
            if label == "direct vLLM":
                records, duration = await run_trace_with_backend(direct, trace, show_progress=True)
            else:
                records, duration = await run_trace(base_url, manifest.model.name, trace, show_progress=True)
            summary = summarize(records, duration, *slo)
            per_round[label].append(summary)
            print(f"[bench] round {index + 1} {label}: {summary.output_throughput_tps:.0f} tok/s, "
                  f"ttft p50 {summary.ttft.p50_ms:.0f} ms", file=sys.stderr)

    async def run_all():
        # Warm both paths (first requests pay one-off costs) before measuring.
        await run_trace_with_backend(direct, trace[:8], show_progress=False)
        await run_trace(base_url, manifest.model.name, trace[:8], show_progress=False)
        for index in range(args.rounds):
            await run_round(index)

    try:
        asyncio.run(run_all())
    finally:
        direct.shutdown()
        if cluster is not None:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()

    medians = {label: _median_summary(s) for label, s in per_round.items()}
    ours, base = medians["moe-serve endpoint"], medians["direct vLLM"]
    ratios = {k: (ours[k] / base[k] if base[k] else float("nan")) for k in base if k != "failed"}
    print(f"\ntrace: {args.num_requests} requests, Poisson {args.rate} req/s, prompt ~{args.prompt_tokens} words, "
          f"{args.output_tokens} output tokens; {args.rounds} rounds, median shown\n")
    header = "| metric | direct vLLM | moe-serve endpoint | endpoint / direct |\n|---|---:|---:|---:|"
    rows = [f"| {k} | {base[k]:.1f} | {ours[k]:.1f} | {ratios.get(k, float('nan')):.3f} |" for k in base]
    print(header + "\n" + "\n".join(rows))
    print("\nlast round, full summaries:\n" + format_table([(k, v[-1]) for k, v in per_round.items()]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": os.uname().nodename,
        "cpus": os.cpu_count(), "trace": vars(args), "median": medians, "ratio_endpoint_over_direct": ratios,
        "rounds": {k: [s.to_dict() for s in v] for k, v in per_round.items()},
    }, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
