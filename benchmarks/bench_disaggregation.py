"""Disaggregated (prefill and decode on separate nodes, KV over our transport) vs colocated
(one engine does both), on the same machine, checkpoint and trace; plus the share of TTFT
spent pulling KV for prompts of 128, 512 and 2048 tokens.

    .venv/bin/python -m benchmarks.bench_disaggregation --rounds 3
    .venv/bin/python -m benchmarks.bench_disaggregation --model deepseek   # MLA (local-deepseek.yaml)
    .venv/bin/python -m benchmarks.bench_disaggregation --model glm        # GLM-4.5 layout (GQA)

For the DeepSeek and GLM layouts the colocated side is one plain engine (the manifest's decode
pool as a colocated pool without expert parallelism); the table also gives the KV bytes
moved per prompt token (MLA: one latent per layer; GQA: K and V per KV head).

Each layout runs in its own subprocess with its own local cluster (started, measured, torn
down), so one cannot leave load behind for the other. Writes benchmarks/results/disaggregation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.rounds import median_at, write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
LAYOUTS = {"colocated": REPO / "manifests" / "local-colocated.yaml",
           "disaggregated": REPO / "manifests" / "local.yaml"}
MODEL_MANIFESTS = {"qwen3": None, "deepseek": REPO / "manifests" / "local-deepseek.yaml",
                   "glm": REPO / "manifests" / "local-glm.yaml"}


def layout_manifest(model: str, layout: str) -> dict:
    """The manifest data of one layout for one model."""
    source = MODEL_MANIFESTS[model]
    if source is None:
        return yaml.safe_load(LAYOUTS[layout].read_text())
    data = yaml.safe_load(source.read_text())
    if layout == "colocated":
        decode = next(p for p in data["pools"] if p["role"] == "decode")
        pool = {k: v for k, v in decode.items() if k != "expert_parallel"}
        data["pools"] = [{**pool, "name": "engine", "role": "colocated",
                          "engine": {**decode["engine"], "enable_prefix_caching": True}}]
    return data
TTFT_PROMPT_TOKENS = (128, 512, 2048)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def measure_layout(data: dict, args) -> dict:
    """Runs inside the subprocess: cluster up, deploy, trace rounds, TTFT split, tear down."""
    from benchmarks.loadgen.client import run_trace
    from benchmarks.loadgen.stats import summarize
    from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    data["model"]["max_model_len"] = 4096  # room for the 2048-token TTFT prompts (checkpoint: 4096)
    manifest = parse_manifest(data, f"{args.model} {args.one}")
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
            _log(f"round {index + 1}: {summary.output_throughput_tps:.0f} tok/s, goodput {summary.goodput_rps:.2f} rps")
            rounds.append(summary.to_dict())
        ttft_split = _ttft_split(url, manifest) if manifest.disaggregated else {}
        return {"rounds": rounds, "ttft_split": ttft_split}
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _ttft_split(url: str, manifest, repeats: int = 5) -> dict:
    """Per prompt size: client TTFT vs decode's pull time (its connector's counters)."""
    import httpx
    from ray import serve

    decode = serve.get_deployment_handle(manifest.pool_with_role(_role("decode")).name, app_name=manifest.name)
    rng = random.Random(0)
    out = {}
    for tokens in TTFT_PROMPT_TOKENS:
        ttfts, pulls, moved = [], [], []
        for _ in range(repeats):
            before = decode.stats.remote().result().kv_transfer
            prompt = [rng.randrange(3, 600) for _ in range(tokens)]
            started = time.perf_counter()
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": manifest.model.name, "prompt": prompt, "max_tokens": 4, "stream": True}) as response:
                first_s = None
                for line in response.iter_lines():  # read to the end; time the first token
                    if first_s is None and line.startswith("data: {"):
                        first_s = time.perf_counter() - started
                ttfts.append(first_s)
            time.sleep(0.2)
            after = decode.stats.remote().result().kv_transfer
            pulls.append(after["pull_seconds_total"] - before["pull_seconds_total"])
            moved.append(after["bytes_loaded_total"] - before["bytes_loaded_total"])
        ttft_ms, pull_ms = statistics.median(ttfts) * 1e3, statistics.median(pulls) * 1e3
        out[str(tokens)] = {"ttft_ms": ttft_ms, "kv_pull_ms": pull_ms, "share": pull_ms / ttft_ms,
                            "kv_bytes_per_prompt_token": statistics.median(moved) / tokens}
        _log(f"prompt {tokens} tokens: TTFT {ttft_ms:.1f} ms, KV pull {pull_ms:.2f} ms")
    return out


def _role(name: str):
    from cluster.manifest import PoolRole

    return PoolRole(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--model", choices=sorted(MODEL_MANIFESTS), default="qwen3",
                        help="qwen3 (the default manifests), deepseek (MLA) or glm")
    parser.add_argument("--one", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/disaggregation[-MODEL].json")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(RESULTS / ("disaggregation.json" if args.model == "qwen3" else f"disaggregation-{args.model}.json"))

    if args.one:
        Path(args.out).write_text(json.dumps(measure_layout(layout_manifest(args.model, args.one), args)))
        return 0

    results = {}
    for layout in LAYOUTS:
        _log(f"=== {layout} ===")
        part = RESULTS / f".disagg-{layout}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.bench_disaggregation", "--one", layout, "--out", str(part),
                        "--model", args.model,
                        "--rounds", str(args.rounds), "--num-requests", str(args.num_requests), "--rate",
                        str(args.rate), "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                        str(args.output_tokens)], check=True, cwd=REPO)
        results[layout] = json.loads(part.read_text())
        part.unlink()

    metrics = [("output tok/s", ("output_throughput_tps",)), ("goodput req/s", ("goodput_rps",)),
               ("TTFT p50 ms", ("ttft", "p50_ms")), ("TTFT p99 ms", ("ttft", "p99_ms")),
               ("ITL p50 ms", ("itl", "p50_ms")), ("ITL p99 ms", ("itl", "p99_ms")),
               ("TPOT p50 ms", ("tpot", "p50_ms")), ("E2E p50 ms", ("e2e", "p50_ms"))]
    print(f"\nmodel layout: {args.model}; trace: {args.num_requests} requests, Poisson {args.rate} req/s, prompts ~{args.prompt_tokens} words "
          f"(+-50%), {args.output_tokens} output tokens; median of {args.rounds} rounds\n")
    print("| metric | colocated | disaggregated | disagg / coloc |\n|---|---:|---:|---:|")
    table = {}
    for name, path in metrics:
        c, d = median_at(results["colocated"]["rounds"], path), median_at(results["disaggregated"]["rounds"], path)
        table[name] = {"colocated": c, "disaggregated": d}
        print(f"| {name} | {c:.1f} | {d:.1f} | {d / c if c else float('nan'):.2f} |")
    print("\n| prompt tokens | TTFT ms | KV pull ms | share of TTFT | KV bytes / prompt token |\n|---:|---:|---:|---:|---:|")
    for tokens, row in results["disaggregated"]["ttft_split"].items():
        print(f"| {tokens} | {row['ttft_ms']:.1f} | {row['kv_pull_ms']:.2f} | {row['share']:.1%} | "
              f"{row.get('kv_bytes_per_prompt_token', float('nan')):,.0f} |")
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
