"""Conditional disaggregation on a multi-turn trace: decode chosen first vs always a remote prefill.

    .venv/bin/python -m benchmarks.bench_decode_first --rounds 3

Two applications of one P/D layout (one prefill engine, one decode engine, vLLM's prefix cache
on in both, prefix-aware routing from the engines' KV events, no KV pool) on one local cluster:
`remote-prefill` sends every prompt to the prefill engine and pulls its KV over TCP, as P/D
does by default; `decode-first` (manifest `kv_transfer.local_prefill_hit_fraction`) picks the
decode replica first and, when its prefix cache holds at least that share of the prompt,
computes the rest there: no prefill hop, no lease, no transfer. Rounds alternate between them
on the same trace shape (benchmarks/bench_kv_pool.py's conversations: a shared system prompt,
each turn sending the whole history as token ids).

Reported: TTFT p50/p90 of turns 2+, throughput, and how many turns each engine started
(the engines' own counters), so the share of turns prefilled where they decode is measured,
not assumed. Writes benchmarks/results/decode_first.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import yaml

from benchmarks.bench_kv_pool import make_conversations, run_round
from benchmarks.rounds import write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
HTTP_PORT = 8000
APPS = ("remote-prefill", "decode-first")


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def app_manifest(name: str, local_hit_fraction: float | None) -> dict:
    data = yaml.safe_load((REPO / "manifests" / "local.yaml").read_text())
    data["name"] = name
    data["model"]["max_model_len"] = 4096
    data["http"].update(route_prefix=f"/{name}", port=HTTP_PORT)
    data["kv_pool"] = {"enabled": False}  # isolate the routing choice: only engine caches hold prefixes
    prefill, decode = data["pools"]
    decode.pop("expert_parallel")  # one decode engine per application: the two apps share 2 cores
    for pool in (prefill, decode):
        pool["engine"]["enable_prefix_caching"] = True
        pool["routing"] = {"policy": "prefix"}
    if local_hit_fraction is not None:
        data["kv_transfer"]["local_prefill_hit_fraction"] = local_hit_fraction
    return data


def started_counts(app: str) -> dict[str, int]:
    from ray import serve

    return {pool: serve.get_deployment_handle(pool, app_name=app).stats.remote().result(timeout_s=30).started_total
            for pool in ("prefill", "decode")}


def summarize(turns: list[dict], seconds: float, before: dict, after: dict) -> dict:
    ttft = sorted(t["ttft_s"] * 1e3 for t in turns if t["turn"] > 0 and t["ttft_s"] is not None)
    started = {pool: after[pool] - before[pool] for pool in after}
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
            "requests_per_s": len(turns) / seconds, "turns": len(turns),
            "prefill_started": started["prefill"], "decode_started": started["decode"],
            # every turn starts on decode; those the prefill engine never saw were computed there
            "share_prefilled_on_decode": 1 - started["prefill"] / started["decode"] if started["decode"] else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per application (alternating)")
    parser.add_argument("--local-hit-fraction", type=float, default=0.8)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--message-tokens", type=int, default=128, help="mean; each message is 0.5x-1.5x")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--stagger-s", type=float, default=0.5, help="between conversation starts")
    parser.add_argument("--out", default=str(RESULTS / "decode_first.json"))
    args = parser.parse_args()

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    apps = {name: parse_manifest(app_manifest(name, args.local_hit_fraction if name == "decode-first" else None), name)
            for name in APPS}
    cluster = LocalCluster.for_manifest(apps["remote-prefill"]).start(progress=_log)
    results: dict[str, list[dict]] = {name: [] for name in apps}
    try:
        connect(cluster.address)
        urls = {name: deploy(manifest, progress=_log).url for name, manifest in apps.items()}  # waits until ready
        for index in range(args.rounds):
            for name, manifest in apps.items():
                conversations = make_conversations(args, seed=index)  # fresh ids: nothing of a past round is reusable
                before = started_counts(name)
                turns, seconds = asyncio.run(run_round(urls[name], manifest.model.name, conversations, args))
                summary = summarize(turns, seconds, before, started_counts(name))
                results[name].append(summary)
                _log(f"round {index + 1} {name}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p90 "
                     f"{summary['ttft_p90_ms']:.0f} ms, {summary['share_prefilled_on_decode']:.0%} prefilled on decode")
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    rows = [("TTFT p50 ms (turns 2+)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms (turns 2+)", "ttft_p90_ms", "{:.0f}"),
            ("requests/s", "requests_per_s", "{:.2f}"), ("turns per round", "turns", "{:.0f}"),
            ("turns the prefill engine ran", "prefill_started", "{:.0f}"),
            ("share of turns prefilled on decode", "share_prefilled_on_decode", "{:.0%}")]
    print(f"\ntrace: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} "
          f"tokens, {args.message_tokens}-token messages, {args.output_tokens} output tokens, think {args.think_s:g} s; "
          f"local_prefill_hit_fraction {args.local_hit_fraction:g}; median of {args.rounds} rounds per side, alternating\n")
    print("| metric | remote prefill | decode first | first / remote |\n|---|---:|---:|---:|")
    table = {}
    for label, key, fmt in rows:
        remote, first = med("remote-prefill", key), med("decode-first", key)
        table[label] = {"remote_prefill": remote, "decode_first": first}
        ratio = f"{first / remote:.2f}" if remote else "-"
        print(f"| {label} | {fmt.format(remote)} | {fmt.format(first)} | {ratio} |")
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
