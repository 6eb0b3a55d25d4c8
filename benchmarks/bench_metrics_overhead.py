"""Throughput and latency with moe-serve's metrics on vs off, same machine, manifest and trace.

    .venv/bin/python -m benchmarks.bench_metrics_overhead --rounds 3

"on" is the default (our ingress/engine/group metrics plus vLLM's Ray stat logger, recorded
through Ray's metrics pipeline, with a local Prometheus scraping every 5 s); "off" sets
observability.metrics: false and runs no Prometheus. Each variant runs in its own subprocess
with its own local cluster. Writes benchmarks/results/metrics_overhead.json. Target: < 3%.
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
VARIANTS = ("off", "on")
# Diagnostic variant: metrics recorded and exported by Ray, but no Prometheus process on the box.
EXTRA_VARIANTS = ("on-no-prometheus",)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def measure(variant: str, args) -> dict:
    from benchmarks.loadgen.client import run_trace
    from benchmarks.loadgen.stats import summarize
    from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy
    from monitoring.local_prometheus import LocalPrometheus

    data = yaml.safe_load(Path(args.manifest).read_text())
    data.setdefault("observability", {})["metrics"] = variant.startswith("on")
    manifest = parse_manifest(data, f"{args.manifest} (metrics {variant})")
    trace = make_trace(TraceSpec(num_requests=args.num_requests, rate_rps=args.rate,
                                 prompt_tokens=LengthSpec(args.prompt_tokens, 0.5),
                                 output_tokens=LengthSpec(args.output_tokens), seed=0))
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    prometheus = None
    try:
        if variant == "on":
            prometheus = LocalPrometheus(port=9392, scrape_interval_s=5.0).start(progress=_log)
        connect(cluster.address)
        url = deploy(manifest, progress=_log).url
        asyncio.run(run_trace(url, manifest.model.name, trace[:8], show_progress=False))  # warm-up
        rounds = []
        for index in range(args.rounds):
            records, duration = asyncio.run(run_trace(url, manifest.model.name, trace, show_progress=True))
            summary = summarize(records, duration, manifest.slo.ttft_ms, manifest.slo.itl_ms)
            _log(f"metrics {variant} round {index + 1}: {summary.output_throughput_tps:.0f} tok/s")
            rounds.append(summary.to_dict())
        return {"rounds": rounds}
    finally:
        import ray
        from ray import serve

        if prometheus is not None:
            prometheus.stop()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(REPO / "manifests" / "local-colocated.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--one", choices=VARIANTS + EXTRA_VARIANTS,
                        help="measure one variant only and write its raw rounds to --out")
    parser.add_argument("--out", default=str(RESULTS / "metrics_overhead.json"))
    parser.add_argument("--on-variant", default="on", choices=("on",) + EXTRA_VARIANTS,
                        help="what 'on' means: with a local Prometheus (default) or without one")
    args = parser.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(measure(args.one, args)))
        return 0

    results = {}
    for variant in VARIANTS:
        variant_run = args.on_variant if variant == "on" else variant
        _log(f"=== metrics {variant_run} ===")
        part = RESULTS / f".metrics-{variant}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.bench_metrics_overhead", "--one", variant_run, "--out", str(part),
                        "--manifest", args.manifest, "--rounds", str(args.rounds), "--num-requests",
                        str(args.num_requests), "--rate", str(args.rate), "--prompt-tokens", str(args.prompt_tokens),
                        "--output-tokens", str(args.output_tokens)], check=True, cwd=REPO)
        results[variant] = json.loads(part.read_text())
        part.unlink()
    metrics = [("output tok/s", ("output_throughput_tps",)), ("TTFT p50 ms", ("ttft", "p50_ms")),
               ("ITL p50 ms", ("itl", "p50_ms")), ("E2E p50 ms", ("e2e", "p50_ms"))]
    print(f"\n{Path(args.manifest).name}: {args.num_requests} requests, Poisson {args.rate} req/s, "
          f"~{args.prompt_tokens} prompt / {args.output_tokens} output tokens; median of {args.rounds} rounds\n")
    print("| metric | metrics off | metrics on | on / off |\n|---|---:|---:|---:|")
    table = {}
    for name, path in metrics:
        off, on = median_at(results["off"]["rounds"], path), median_at(results["on"]["rounds"], path)
        table[name] = {"off": off, "on": on}
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off if off else float('nan'):.3f} |")
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
