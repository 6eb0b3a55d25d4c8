"""Expert parallelism N=2 vs N=1 on the same machine, checkpoint and decode-heavy trace:
decode throughput, inter-token latency, and the weight memory each rank holds.

    .venv/bin/python -m benchmarks.bench_expert_parallel --rounds 3

Both layouts are colocated (one pool, no prefill/decode split) so that the only difference is
the expert sharding: N=1 is one vLLM engine holding all experts on one node; N=2 is one
engine group of two ranks on two nodes (data-parallel attention, expert-parallel MoE), each
holding half of the routed experts. Each layout runs in its own subprocess with its own local
cluster. Writes benchmarks/results/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.rounds import median_at, write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BASE_MANIFEST = REPO / "manifests" / "local-colocated.yaml"
LAYOUTS = ("N=1", "N=2")


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def layout_manifest(layout: str) -> dict:
    """local-colocated.yaml with one engine (N=1) or one 2-rank expert-parallel group (N=2)."""
    from deployments.expert_parallel.expert_ranks import CPU_COMPAT_EXTENSION

    data = yaml.safe_load(BASE_MANIFEST.read_text())
    nodes = data["local_cluster"]["nodes"]
    engine_node = next(n for n in nodes if n["name"] == "engine-0")
    nodes.append({**engine_node, "name": "engine-1"})  # same node set for both layouts
    pool = data["pools"][0]
    if layout == "N=2":
        pool["expert_parallel"] = {"size": 2}
    else:
        # The same worker extension as the ranks, only to read parameter sizes back.
        pool["engine"].setdefault("extra_args", {})["worker_extension_cls"] = CPU_COMPAT_EXTENSION
    return data


def measure_layout(layout: str, args) -> dict:
    from benchmarks.loadgen.client import run_trace
    from benchmarks.loadgen.stats import summarize
    from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    manifest = parse_manifest(layout_manifest(layout), f"bench {layout}")
    trace = make_trace(TraceSpec(num_requests=args.num_requests, rate_rps=args.rate,
                                 prompt_tokens=LengthSpec(args.prompt_tokens, 0.5),
                                 output_tokens=LengthSpec(args.output_tokens), seed=0))
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        url = deploy(manifest, progress=_log).url
        asyncio.run(run_trace(url, manifest.model.name, trace[:8], show_progress=False))  # warm-up
        rounds = []
        for index in range(args.rounds):
            records, duration = asyncio.run(run_trace(url, manifest.model.name, trace, show_progress=True))
            summary = summarize(records, duration, manifest.slo.ttft_ms, manifest.slo.itl_ms)
            _log(f"{layout} round {index + 1}: {summary.output_throughput_tps:.0f} tok/s, "
                 f"ITL p50 {summary.itl.p50_ms:.1f} ms")
            rounds.append(summary.to_dict())
        return {"rounds": rounds, "ranks": _rank_weights(manifest)}
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _rank_weights(manifest) -> list[dict]:
    """Per rank: bytes of all weights and of routed experts, read from the engines' parameters."""
    from ray import serve

    handle = serve.get_deployment_handle(manifest.pools[0].name, app_name=manifest.name)
    placement = handle.placement.remote().result(timeout_s=60)
    ranks = placement if isinstance(placement, list) else [placement]
    return [{"rank": index, **rank["parameter_bytes"],
             "experts": sorted({e for layer in rank["layers"] for e in layer["local_expert_ids"]})}
            for index, rank in enumerate(ranks)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--one", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "expert_parallel.json"))
    args = parser.parse_args()

    if args.one:
        Path(args.out).write_text(json.dumps(measure_layout(args.one, args)))
        return 0

    results = {}
    for layout in LAYOUTS:
        _log(f"=== {layout} ===")
        part = RESULTS / f".ep-{layout.replace('=', '')}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.bench_expert_parallel", "--one", layout, "--out", str(part),
                        "--rounds", str(args.rounds), "--num-requests", str(args.num_requests), "--rate",
                        str(args.rate), "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                        str(args.output_tokens)], check=True, cwd=REPO)
        results[layout] = json.loads(part.read_text())
        part.unlink()

    metrics = [("output tok/s", ("output_throughput_tps",)), ("ITL p50 ms", ("itl", "p50_ms")),
               ("ITL p99 ms", ("itl", "p99_ms")), ("TPOT p50 ms", ("tpot", "p50_ms")),
               ("TTFT p50 ms", ("ttft", "p50_ms")), ("E2E p50 ms", ("e2e", "p50_ms"))]
    print(f"\ntrace: {args.num_requests} requests, Poisson {args.rate} req/s, prompts ~{args.prompt_tokens} "
          f"tokens (+-50%), {args.output_tokens} output tokens; median of {args.rounds} rounds\n")
    print("| metric | N=1 | N=2 | N=2 / N=1 |\n|---|---:|---:|---:|")
    table = {}
    for name, path in metrics:
        one, two = median_at(results["N=1"]["rounds"], path), median_at(results["N=2"]["rounds"], path)
        table[name] = {"N=1": one, "N=2": two}
        print(f"| {name} | {one:.1f} | {two:.1f} | {two / one if one else float('nan'):.2f} |")
    print("\n| layout | rank | experts | routed-expert weights | all weights |\n|---|---:|---|---:|---:|")
    for layout in LAYOUTS:
        for rank in results[layout]["ranks"]:
            experts = f"{rank['experts'][0]}-{rank['experts'][-1]}" if rank["experts"] else "-"
            print(f"| {layout} | {rank['rank']} | {experts} | {rank['routed_experts'] / 2**20:.2f} MiB "
                  f"| {rank['total'] / 2**20:.2f} MiB |")
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
