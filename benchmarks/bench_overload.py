"""Admission control at three times the sustainable rate: how fast the excess gets its 429.

    .venv/bin/python -m benchmarks.bench_overload --rounds 3

The issue's overload case, measured as an open-loop arrival rate rather than one burst
(bench_routing's `--burst-only` sends 3x the admission bound in the same instant). One
colocated application (bench_routing's prefix application: two engine replicas, admission
bound = 2 x (max_num_seqs + max_queued_per_replica)) on a local cluster, then per round:

1. Capacity: a closed loop of `replicas x max_num_seqs` clients (enough to keep every engine
   slot busy and never to be refused) sends requests back to back for --capacity-s seconds.
   Its completions per second are the sustainable rate R; its TTFT is the unloaded reference.
2. Overload: Poisson arrivals at --factor x R (3x by default) for --overload-s seconds,
   open loop (a request is sent on schedule whether or not earlier ones were answered).
   Every answer is recorded: 429 with its latency and Retry-After, admitted with its TTFT,
   anything else as a failure; a request unanswered --drain-s after the last arrival hangs.
   The admitted requests' SLO is a TTFT of --ttft-slo-ms (2 s, bench_routing's default):
   with the bound at 8 running + 8 queued per engine, an admitted request waits for at most
   one batch ahead of it.

`--engine-nice 15,19` alternates rounds between the engines at each niceness (every thread of
the application's engine replicas and of the vLLM processes under them is set before the
round; 15 is Ray's worker niceness, 19 the CPU default of deployments/engine/cpu_priority.py)
and reports the medians per niceness side by side.

Reported per round and as medians over rounds: R, the offered rate, admitted/s, the 429s'
latency p50/p90/p99, the admitted requests' TTFT p50/p99 and the share within the SLO,
failures and hangs. Every request streams (TTFT); prompts are token ids, distinct per
request, so no prefix cache hit makes one cheaper. Writes benchmarks/results/overload.json.
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

from benchmarks.bench_routing import RESULTS, app_manifest

REPLICAS = 2  # bench_routing's colocated application


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else None


async def one_request(client, url: str, model: str, index: int, args) -> dict:
    """One streamed completion: status, latency, TTFT (admitted) or Retry-After (429)."""
    import httpx

    body = {"model": model, "prompt": [3 + (index * 7 + k) % 597 for k in range(args.prompt_tokens)],
            "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {"status": response.status_code, "latency_s": time.perf_counter() - started,
                        "retry_after": response.headers.get("retry-after")}
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"text"' in line:
                    ttft = time.perf_counter() - started
            return {"status": 200, "latency_s": time.perf_counter() - started, "ttft_s": ttft}
    except httpx.HTTPError as exc:
        return {"status": None, "latency_s": time.perf_counter() - started, "error": type(exc).__name__}


async def capacity(url: str, model: str, args) -> dict:
    """Completions per second with every engine slot kept busy, and their TTFT p99."""
    import httpx

    clients = REPLICAS * args.max_num_seqs
    deadline = time.perf_counter() + args.capacity_s
    done: list[dict] = []

    async def loop(worker: int, client) -> None:
        index = worker
        while time.perf_counter() < deadline:
            done.append(await one_request(client, url, model, 100_000 + index, args))
            index += clients

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(loop(w, client) for w in range(clients)))
    seconds = time.perf_counter() - started
    ok = [r for r in done if r["status"] == 200]
    if len(ok) != len(done):
        raise RuntimeError(f"the capacity phase ({clients} clients, below the admission bound) got "
                           f"{sorted({str(r['status']) for r in done})}: {[r for r in done if r['status'] != 200][:3]}")
    return {"clients": clients, "requests": len(ok), "rate_per_s": len(ok) / seconds,
            "capacity_ttft_p50_ms": _ms(_pct([r["ttft_s"] for r in ok], 0.5)),
            "capacity_ttft_p99_ms": _ms(_pct([r["ttft_s"] for r in ok], 0.99))}


async def overload(url: str, model: str, rate: float, slo_s: float, args, seed: int) -> dict:
    """Poisson arrivals at `rate` for --overload-s seconds; every answer recorded."""
    import httpx

    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        started = time.perf_counter()
        next_at = 0.0
        while next_at < args.overload_s:
            delay = started + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_sent_at(time.perf_counter() - started,
                                                      one_request(client, url, model, len(tasks), args))))
            next_at += rng.expovariate(rate)
        sent_s = time.perf_counter() - started
        finished, pending = await asyncio.wait(tasks, timeout=args.drain_s)
        for task in pending:
            task.cancel()
    results = [t.result() for t in finished]
    rejected = [r for r in results if r["status"] == 429]
    admitted = [r for r in results if r["status"] == 200]
    failed = [r for r in results if r["status"] not in (200, 429)]
    ttft = [r["ttft_s"] for r in admitted if r["ttft_s"] is not None]
    return {"offered_per_s": len(tasks) / sent_s, "requests": len(tasks), "admitted": len(admitted),
            "rejected": len(rejected), "failed": len(failed), "hung": len(pending),
            "failures": sorted({f"{r['status']} {r.get('error', '')}".strip() for r in failed}),
            "admitted_per_s": len(admitted) / sent_s,
            "reject_p50_ms": _ms(_pct([r["latency_s"] for r in rejected], 0.5)),
            "reject_p90_ms": _ms(_pct([r["latency_s"] for r in rejected], 0.9)),
            "reject_p99_ms": _ms(_pct([r["latency_s"] for r in rejected], 0.99)),
            "reject_max_ms": _ms(max((r["latency_s"] for r in rejected), default=None)),
            "retry_after_missing": sum(1 for r in rejected if not r["retry_after"]),
            "admitted_ttft_p50_ms": _ms(_pct(ttft, 0.5)), "admitted_ttft_p99_ms": _ms(_pct(ttft, 0.99)),
            "admitted_within_slo": sum(1 for t in ttft if t <= slo_s) / len(admitted) if admitted else None,
            # when the slow rejections were sent: one stall, or spread over the round?
            "slow_rejections": [(round(r["sent_at_s"], 2), round(r["latency_s"] * 1e3)) for r in rejected
                                if r["latency_s"] > 0.1]}


async def _sent_at(offset_s: float, request) -> dict:
    return {**await request, "sent_at_s": offset_s}


def set_engine_niceness(app: str, nice: int) -> int:
    """Every thread of the application's engine replicas and of the processes under them (vLLM's
    engine core and workers) at `nice`; how many threads changed. Raising priority needs root."""
    import psutil

    from deployments.engine.cpu_priority import set_process_niceness

    changed = 0
    for process in psutil.process_iter(["cmdline"]):
        if (process.info["cmdline"] or [""])[0].startswith(f"ray::ServeReplica:{app}:engine"):
            for member in [process, *process.children(recursive=True)]:
                changed += set_process_niceness(nice, tasks_dir=f"/proc/{member.pid}/task")
    return changed


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


ROWS = [("sustainable rate R, completions/s", "rate_per_s", "{:.1f}"),
        ("TTFT p50 / p99 ms at R (closed loop)", ("capacity_ttft_p50_ms", "capacity_ttft_p99_ms"), "{:.0f}"),
        ("offered rate, requests/s", "offered_per_s", "{:.1f}"),
        ("admitted, requests/s", "admitted_per_s", "{:.1f}"),
        ("requests / admitted / 429 / failed / hung", None, None),
        ("429 latency p50 ms", "reject_p50_ms", "{:.0f}"), ("429 latency p90 ms", "reject_p90_ms", "{:.0f}"),
        ("429 latency p99 ms", "reject_p99_ms", "{:.0f}"), ("429 latency max ms", "reject_max_ms", "{:.0f}"),
        ("admitted TTFT p50 ms", "admitted_ttft_p50_ms", "{:.0f}"),
        ("admitted TTFT p99 ms", "admitted_ttft_p99_ms", "{:.0f}"),
        ("admitted within the TTFT SLO", "admitted_within_slo", "{:.0%}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=256, help="each engine's KV cache, 128-token blocks")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--queued-per-replica", type=int, default=8)
    parser.add_argument("--front", default="haproxy", choices=["haproxy", "serve_proxy"])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--overload-s", type=float, default=20.0)
    parser.add_argument("--factor", type=float, default=3.0, help="offered rate / sustainable rate")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="the admitted requests' TTFT SLO")
    parser.add_argument("--drain-s", type=float, default=120.0, help="after the last arrival; later = hung")
    parser.add_argument("--engine-nice", default="", help="e.g. 15,19: alternate rounds between these niceness values")
    parser.add_argument("--out", default=str(RESULTS / "overload.json"))
    args = parser.parse_args()
    args.model = "tiny"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")

    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    manifest = parse_manifest(app_manifest("prefix", args), "overload")
    bound = REPLICAS * (args.max_num_seqs + args.queued_per_replica)
    rounds = []
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        url = deploy(manifest, progress=_log).url
        model = manifest.model.name
        asyncio.run(capacity(url, model, argparse.Namespace(**{**vars(args), "capacity_s": 3.0})))  # warm-up
        nice_values = [int(v) for v in args.engine_nice.split(",") if v]
        for index in range(args.rounds):
            nice = nice_values[index % len(nice_values)] if nice_values else None
            if nice is not None:
                changed = set_engine_niceness(manifest.name, nice)
                _log(f"round {index + 1}: engines at niceness {nice} ({changed} threads set)")
            cap = asyncio.run(capacity(url, model, args))
            over = asyncio.run(overload(url, model, args.factor * cap["rate_per_s"], args.ttft_slo_ms / 1e3, args,
                                        seed=index))
            rounds.append({"engine_nice": nice, **cap, **over})
            _log(f"round {index + 1}: R {cap['rate_per_s']:.1f}/s, offered {over['offered_per_s']:.1f}/s, "
                 f"{over['admitted']} admitted, {over['rejected']} 429 (p99 {over['reject_p99_ms'] or 0:.0f} ms), "
                 f"{over['failed']} failed, {over['hung']} hung")
            time.sleep(3)  # the last admitted requests drain before the next capacity phase
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    print(f"\n{args.front} front; 2 engine replicas x {args.max_num_seqs} running + {args.queued_per_replica} "
          f"queued (admission bound {bound}); {args.prompt_tokens}-token prompts, {args.output_tokens} output "
          f"tokens; {args.factor:g}x R for {args.overload_s:g} s per round; TTFT SLO {args.ttft_slo_ms:g} ms; "
          f"median of {args.rounds} rounds\n")
    groups = sorted({r["engine_nice"] for r in rounds}, key=lambda n: -1 if n is None else n)
    medians = [f"median (nice {n})" if n is not None else "median" for n in groups]
    print("| metric | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | " + " | ".join(medians)
          + " |\n|---|" + "---:|" * (len(rounds) + len(groups)))
    if groups != [None]:
        print("| engines' niceness | " + " | ".join(str(r["engine_nice"]) for r in rounds) + " |" * (len(groups) + 1))
    for label, key, fmt in ROWS:
        if isinstance(key, tuple) or key is None:
            cells = [" / ".join(fmt.format(r[k]) for k in key) if key else
                     f"{r['requests']} / {r['admitted']} / {r['rejected']} / {r['failed']} / {r['hung']}" for r in rounds]
            print(f"| {label} | " + " | ".join(cells) + " |" * (len(groups) + 1))
            continue
        values = [r[key] for r in rounds]
        cells = ["-" if v is None else fmt.format(v) for v in values]
        for group in groups:
            known = [r[key] for r in rounds if r["engine_nice"] == group and r[key] is not None]
            cells.append(fmt.format(statistics.median(known)) if known else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "args": vars(args), "admission_bound": bound,
                               "rounds": rounds}, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
