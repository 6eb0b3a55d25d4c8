"""Which rank of an expert-parallel group takes a request: least loaded vs prefix-aware.

    .venv/bin/python -m benchmarks.bench_ep_rank_routing --rounds 3

Each rank of an expert-parallel group runs the whole attention of its own requests with its
own KV cache; only the experts are spread over the group. So which rank a follow-up turn
lands on decides whether its history is a cache hit, exactly as for replicas. Two
applications on one local cluster, identical but for the colocated pool's `routing.policy`:
- least_loaded: the group sends each request to the rank with the fewest in flight;
- prefix: every rank follows its engine's KV events and the group sends a request to the rank
  holding most of its prompt's leading blocks, within 4 requests of the least loaded
  (`deployments/expert_parallel/expert_ranks.pick_rank`).
One group of 2 ranks each (decode-0 and decode-1 of the default cluster), prefix cache on.
Rounds alternate between the applications with a fresh trace each round, the trace of
`bench_routing` (a shared system prompt, a document per conversation, several questions in
turn, the whole history sent each turn). Reported: the share of reusable prompt tokens the
engines found cached (usage.prompt_tokens_details), TTFT p50/p90/p99 of turns 2+, goodput.
Writes benchmarks/results/ep_rank_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import yaml

from benchmarks.bench_routing import BLOCK, HTTP_PORT, TABLE_ROWS, add_trace_arguments, make_trace, run_round
from benchmarks.rounds import write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
POLICIES = ("least_loaded", "prefix")


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def app_manifest(policy: str, args) -> dict:
    """The default manifest's decode group (2 ranks over decode-0/decode-1) serving alone."""
    data = yaml.safe_load((REPO / "manifests" / "local.yaml").read_text())
    data["name"] = f"ep-{policy.replace('_', '-')}"
    data["model"]["max_model_len"] = 4096
    data["http"].update(route_prefix=f"/{data['name']}", port=HTTP_PORT)
    data["kv_pool"] = {"enabled": False}  # only the ranks' own caches hold prefixes
    decode = next(p for p in data["pools"] if p["role"] == "decode")
    engine = {**decode["engine"], "enable_prefix_caching": True, "max_num_seqs": args.max_num_seqs,
              "extra_args": {"num_gpu_blocks_override": args.engine_blocks}}
    data["pools"] = [{**decode, "name": "engine", "role": "colocated", "engine": engine,
                      "routing": {"policy": policy}}]
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    add_trace_arguments(parser, conversations=8)
    parser.add_argument("--out", default=str(RESULTS / "ep_rank_routing.json"))
    args = parser.parse_args()

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    apps = {policy: parse_manifest(app_manifest(policy, args), policy) for policy in POLICIES}
    cluster = LocalCluster.for_manifest(apps["prefix"]).start(progress=_log)
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    try:
        connect(cluster.address)
        urls = {policy: deploy(manifest, progress=_log).url for policy, manifest in apps.items()}
        model = apps["prefix"].model.name
        for index in range(args.rounds):
            for policy in POLICIES:
                summary = asyncio.run(run_round(urls[policy], model, make_trace(args, seed=200 + index), args))
                results[policy].append(summary)
                _log(f"round {index + 1} {policy}: hit {summary['hit_share']:.0%}, "
                     f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms")
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    print(f"\ntrace: {args.conversations} conversations x {args.turns} turns, {args.system_tokens}-token shared system "
          f"prompt + {args.document_tokens}-token document each, {args.question_tokens}-token questions, "
          f"{args.output_tokens} output tokens; one expert-parallel group of 2 ranks, {args.engine_blocks * BLOCK:,} "
          f"KV tokens each; median of {args.rounds} rounds per policy, alternating\n")
    print("| metric | least_loaded | prefix | prefix / least_loaded |\n|---|---:|---:|---:|")
    table = {}
    for label, key, fmt in TABLE_ROWS:
        values = {p: statistics.median(r[key] for r in results[p]) for p in POLICIES}
        table[label] = values
        ratio = values["prefix"] / values["least_loaded"] if values["least_loaded"] else float("nan")
        print(f"| {label} | {fmt.format(values['least_loaded'])} | {fmt.format(values['prefix'])} | {ratio:.2f} |")
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
