"""Routing policies side by side on one multi-turn trace, plus admission under a 3x burst.

    .venv/bin/python -m benchmarks.bench_routing --rounds 2

Three applications of one colocated layout (two vLLM engine replicas, prefix cache on) run
on one local cluster, differing only in `routing.policy`: serve_default (Ray Serve's power of
two choices), round_robin and prefix (ours, cache- and load-aware). Rounds alternate between
them with a fresh trace each round. Trace: conversations, each with its own context document
after a shared system prompt, asked several questions in turn; every turn sends the whole
history (as token ids) with think time between turns. Reported per policy: the share of
reusable prompt tokens the engine found cached (OpenAI usage.prompt_tokens_details), TTFT
p50/p90/p99 of turns 2+, goodput (turns within the TTFT SLO per second), and the pure policy's
own decision latency (p50/p99 over synthetic 8-replica states). Then a burst of three times
the admission bound at the prefix application: how fast the excess gets its 429.
Writes benchmarks/results/routing.json.

    .venv/bin/python -m benchmarks.bench_routing --model wide --rounds 2

The same with a wider, deeper variant of the tiny model (`checkpoint_variants.wide_qwen3_moe`, built locally),
whose prefill is costly enough that a cache miss shows in TTFT as it does on GPUs.
Writes benchmarks/results/routing-wide.json.

`--replicas N` gives each application N engine replicas (default 2; a blind router misses a
conversation's replica more often the more there are), `--policies` picks the applications
(default all three; every application's engines run at once, so fewer policies leave memory
for more replicas).

    .venv/bin/python -m benchmarks.bench_routing --burst-only --rounds 5

Only the burst, for each HTTP front in turn (`--fronts`, default HAProxy then Serve's Python
proxy): its own cluster with the prefix application, a warm-up, then --rounds bursts; 429
latency percentiles over all rounds. Writes benchmarks/results/routing-burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

from benchmarks.checkpoint_variants import wide_qwen3_moe

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
HTTP_PORT = 8000
VOCAB = (3, 600)
POLICIES = ("serve_default", "round_robin", "prefix")
BLOCK = 128  # vLLM's CPU block size: only full blocks are cached


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def app_manifest(policy: str, args) -> dict:
    data = yaml.safe_load((REPO / "manifests" / "local.yaml").read_text())
    data["name"] = f"route-{policy.replace('_', '-')}"
    data["model"]["max_model_len"] = 4096
    if args.model == "wide":
        data["model"]["path"] = str(args.model_path)
    data["http"].update(route_prefix=f"/{data['name']}", port=HTTP_PORT, front=args.front)
    data["kv_pool"] = {"enabled": False}
    data["admission"] = {"max_queued_per_replica": args.queued_per_replica}
    decode = data["pools"][1]
    decode.pop("expert_parallel")
    engine = {**decode["engine"], "enable_prefix_caching": True, "max_num_seqs": args.max_num_seqs,
              "extra_args": {"num_gpu_blocks_override": args.engine_blocks}}
    data["pools"] = [{**decode, "name": "engine", "role": "colocated", "replicas": getattr(args, "replicas", 2),
                      "engine": engine,
                      "placement": {"num_cpus": getattr(args, "engine_cpus", 1.0)}, "routing": {"policy": policy}}]
    return data


# What run_round reports, as table rows: (label, key, format).
TABLE_ROWS = [("reusable prompt tokens found cached (turns 2+)", "hit_share", "{:.0%}"),
              ("TTFT p50 ms (turns 2+)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms (turns 2+)", "ttft_p90_ms", "{:.0f}"),
              ("TTFT p99 ms (turns 2+)", "ttft_p99_ms", "{:.0f}"),
              ("goodput (turns in TTFT SLO)/s", "goodput_per_s", "{:.2f}")]


def add_trace_arguments(parser, conversations: int) -> None:
    """The trace's and the engines' options (make_trace, run_round, app manifests)."""
    parser.add_argument("--conversations", type=int, default=conversations)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--document-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--stagger-s", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=256, help="each engine's KV cache, 128-token blocks")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000)


def make_trace(args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(*VOCAB) for _ in range(args.system_tokens)]
    return [{"prefix": system + [rng.randrange(*VOCAB) for _ in range(args.document_tokens)],
             "questions": [[rng.randrange(*VOCAB) for _ in range(args.question_tokens)] for _ in range(args.turns)]}
            for _ in range(args.conversations)]


async def conversation(client, url: str, model: str, conv: dict, args, delay_s: float) -> list[dict]:
    await asyncio.sleep(delay_s)
    history, turns = list(conv["prefix"]), []
    for index, question in enumerate(conv["questions"]):
        prompt = history + question
        started = time.perf_counter()
        first_s, answer, cached = None, [], None
        async with client.stream("POST", f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        first_s = first_s if first_s is not None else time.perf_counter() - started
                        answer += choice["token_ids"]
        reusable = ((len(history) - 1) // BLOCK) * BLOCK if index else 0  # the answer's last token is never fed back
        turns.append({"turn": index, "ttft_s": first_s, "cached": cached or 0, "reusable": reusable})
        history = prompt + answer
        await asyncio.sleep(args.think_s)
    return turns


async def run_round(url: str, model: str, trace: list[dict], args) -> dict:
    import httpx

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        per = await asyncio.gather(*(conversation(client, url, model, c, args, i * args.stagger_s)
                                     for i, c in enumerate(trace)))
    seconds = time.perf_counter() - started
    later = [t for turns in per for t in turns if t["turn"] > 0]
    ttft = sorted(t["ttft_s"] * 1e3 for t in later)
    reusable = sum(t["reusable"] for t in later)
    return {"hit_share": sum(min(t["cached"], t["reusable"]) for t in later) / reusable,
            "ttft_p50_ms": ttft[len(ttft) // 2], "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
            "ttft_p99_ms": ttft[int(0.99 * (len(ttft) - 1))],
            "goodput_per_s": sum(1 for t in per for t in t if t["ttft_s"] * 1e3 <= args.ttft_slo_ms) / seconds}


def decision_latency(samples: int = 5000) -> dict:
    """The pure prefix policy's own cost: 8 replicas with full indices, 256-block prompts."""
    from deployments.routing.policies import PrefixAware
    from deployments.routing.state import ReplicaState, RoutingRequest

    rng = random.Random(0)
    policy = PrefixAware(capacity_blocks=4096)
    prompts = [tuple(rng.getrandbits(63) for _ in range(256)) for _ in range(64)]
    replicas = [ReplicaState(f"r{i}", ongoing=rng.randrange(8), reported_at_s=0.0) for i in range(8)]
    times = []
    for index in range(samples):
        request = RoutingRequest(prompts[index % len(prompts)][:rng.randrange(16, 256)])
        started = time.perf_counter()
        policy.choose(request, replicas, 1.0)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(0.99 * (len(times) - 1))] * 1e6}


async def burst(url: str, model: str, count: int, keep_times: bool = False) -> dict:
    import httpx

    async def one(client, index):
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": [3 + index % 500] * 64, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        return response.status_code, time.perf_counter() - started

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count)) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(count)))
    rejected = sorted(s for code, s in results if code == 429)
    admitted = sorted(s for code, s in results if code == 200)
    out = {"requests": count, "admitted": len(admitted), "rejected": len(rejected),
           "other": count - len(admitted) - len(rejected),
           "reject_p50_ms": rejected[len(rejected) // 2] * 1e3 if rejected else None,
           "reject_p99_ms": rejected[int(0.99 * (len(rejected) - 1))] * 1e3 if rejected else None,
           "admitted_p50_s": admitted[len(admitted) // 2] if admitted else None}
    if keep_times:
        out.update(reject_times_s=rejected, admit_times_s=admitted)
    return out


def burst_by_front(args) -> int:
    """The admission burst alone, once per HTTP front, each on a cluster of its own."""
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    bound = args.replicas * (args.max_num_seqs + args.queued_per_replica)
    rows = {}
    for front in args.fronts.split(","):
        args.front = front
        manifest = parse_manifest(app_manifest("prefix", args), f"prefix ({front})")
        cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
        try:
            connect(cluster.address)
            url = deploy(manifest, progress=_log).url
            model = manifest.model.name
            asyncio.run(burst(url, model, 4))  # warm-up: connections, first compiled paths
            bursts = []
            for index in range(args.rounds):
                time.sleep(3)  # the previous burst's admitted requests drain
                bursts.append(asyncio.run(burst(url, model, 3 * bound, keep_times=True)))
                _log(f"{front} burst {index + 1}: {bursts[-1]['admitted']} admitted, {bursts[-1]['rejected']} 429 "
                     f"(p99 {bursts[-1]['reject_p99_ms']:.0f} ms)")
        finally:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
        rejected = sorted(t for b in bursts for t in b.pop("reject_times_s"))
        admitted = sorted(t for b in bursts for t in b.pop("admit_times_s"))
        rows[front] = {"bursts": bursts, "rejected": len(rejected), "admitted": len(admitted),
                       "reject_p50_ms": _pct(rejected, 0.5) * 1e3, "reject_p99_ms": _pct(rejected, 0.99) * 1e3,
                       "admitted_p50_s": _pct(admitted, 0.5)}
    print(f"\nbursts of {3 * bound} requests at once (3x the admission bound of {bound}), {args.rounds} per front\n")
    print("| front | admitted | 429 | 429 p50 ms | 429 p99 ms | admitted p50 s |\n|---|---:|---:|---:|---:|---:|")
    for front, row in rows.items():
        print(f"| {front} | {row['admitted']} | {row['rejected']} | {row['reject_p50_ms']:.0f} | "
              f"{row['reject_p99_ms']:.0f} | {row['admitted_p50_s']:.2f} |")
    out = Path(args.out).with_name("routing-burst.json") if args.out == str(RESULTS / "routing.json") else Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "args": vars(args), "fronts": rows}, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


def _pct(values: list[float], q: float) -> float:
    return values[int(q * (len(values) - 1))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    add_trace_arguments(parser, conversations=12)
    parser.add_argument("--queued-per-replica", type=int, default=8)
    parser.add_argument("--front", default="haproxy", choices=["haproxy", "serve_proxy"],
                        help="the applications' http.front")
    parser.add_argument("--model", default="tiny", choices=["tiny", "wide"],
                        help="the builtin tiny Qwen3-MoE, or a variant ~10x as costly to prefill (checkpoint_variants)")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas per application")
    parser.add_argument("--policies", default=",".join(POLICIES), help="the applications, one per policy")
    parser.add_argument("--engine-cpus", type=float, default=1.0,
                        help="Ray CPUs per engine replica; the local cluster has 8 (lower it for more replicas)")
    parser.add_argument("--burst-only", action="store_true", help="only the admission burst, once per --fronts")
    parser.add_argument("--fronts", default="haproxy,serve_proxy")
    parser.add_argument("--out", default=None, help="default benchmarks/results/routing[-wide].json")
    args = parser.parse_args()
    args.model_path = wide_qwen3_moe() if args.model == "wide" else None
    args.out = args.out or str(RESULTS / ("routing-wide.json" if args.model == "wide" else "routing.json"))
    if args.burst_only:
        return burst_by_front(args)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    policies = args.policies.split(",")
    apps = {policy: parse_manifest(app_manifest(policy, args), policy) for policy in policies}
    cluster = LocalCluster.for_manifest(apps[policies[-1]]).start(progress=_log)
    results: dict[str, list[dict]] = {policy: [] for policy in policies}
    try:
        connect(cluster.address)
        urls = {policy: deploy(manifest, progress=_log).url for policy, manifest in apps.items()}
        model = apps[policies[-1]].model.name
        for index in range(args.rounds):
            for policy in policies:
                summary = asyncio.run(run_round(urls[policy], model, make_trace(args, seed=100 + index), args))
                results[policy].append(summary)
                _log(f"round {index + 1} {policy}: hit {summary['hit_share']:.0%}, TTFT p50 {summary['ttft_p50_ms']:.0f} ms")
        bound = args.replicas * (args.max_num_seqs + args.queued_per_replica)
        overload = asyncio.run(burst(urls["prefix"], model, 3 * bound)) if "prefix" in urls else None
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    decisions = decision_latency()
    print(f"\nmodel {args.model}; trace: {args.conversations} conversations x {args.turns} turns, {args.system_tokens}-token shared system "
          f"prompt + {args.document_tokens}-token document each, {args.question_tokens}-token questions, "
          f"{args.output_tokens} output tokens; {args.replicas} engine replicas of {args.engine_blocks * BLOCK:,} KV tokens each; "
          f"median of {args.rounds} rounds per policy, alternating\n")
    baseline = "round_robin" if "round_robin" in policies else next((p for p in policies if p != "prefix"), None)
    print("| metric | " + " | ".join(policies) + f" | prefix / {baseline} |\n|---|" + "---:|" * (len(policies) + 1))
    table = {}
    for label, key, fmt in TABLE_ROWS:
        values = {p: statistics.median(r[key] for r in results[p]) for p in policies}
        table[label] = values
        ratio = values["prefix"] / values[baseline] if baseline and values[baseline] and "prefix" in values \
            else float("nan")
        print(f"| {label} | " + " | ".join(fmt.format(values[p]) for p in policies) + f" | {ratio:.2f} |")
    print(f"\nprefix policy decision: p50 {decisions['p50_us']:.0f} us, p99 {decisions['p99_us']:.0f} us "
          "(8 replicas, 4096-block indices, prompts up to 256 blocks)")
    if overload:
        print(f"burst of {overload['requests']} at once (3x the admission bound of {bound}): "
              f"{overload['admitted']} admitted, {overload['rejected']} got 429 (p50 {overload['reject_p50_ms']:.0f} ms, "
              f"p99 {overload['reject_p99_ms']:.0f} ms), {overload['other']} other")
    out = Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "args": vars(args), "table": table, "decision": decisions,
                               "burst": overload, "raw": results}, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
