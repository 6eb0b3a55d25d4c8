"""Soak and fault benchmark: the default manifest's stack under moderate load for a long time,
then one fault at a time under the same load. Backs RELIABILITY.md.

    .venv/bin/python -m benchmarks.bench_soak                       # 20 min soak, then the faults
    .venv/bin/python -m benchmarks.bench_soak --minutes 5 --no-faults

Soak: closed-loop clients (chat turns that grow a conversation, completions, streams and not)
for --minutes; the resident memory of every process of the stack (Ray workers and replicas,
vLLM engine processes, raylets, GCS, the Mooncake master) is sampled every --sample-s. Reported:
growth per process from the end of warm-up to the end (median of three samples at each edge;
target: under 50 MiB), failed requests (target: none), and the prefill's leases still
outstanding once the load stops (target: none).

Faults (each under the same load, one at a time, the stack back at full capacity before the
next): the prefill replica's process killed; one decode expert-parallel rank killed; KV pulls
failed on purpose (the test-only injection header, which this benchmark's copy of the manifest
allows). Per fault: requests affected, requests lost (no answer, or an error the client is not
told to retry), time to the first success and to full capacity.

Writes benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.soak_analysis import MIB, Outcome, fault_report, growth_by_kind, memory_growth
from benchmarks.soak_sampling import Sampler

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MANIFEST = REPO / "manifests" / "local.yaml"
GROWTH_TARGET_MIB = 50.0
KV_FAULT_S = 30.0  # how long every request carries the KV failure header
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls count silver stars".split()
INJECT_KV_FAILURE_HEADER = "x-moe-serve-inject-kv-failure"


def _log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- load ------------------------------------------------------------------------------------------
class Load:
    """Closed-loop clients in a thread of their own; every request's Outcome is kept."""

    def __init__(self, url: str, model: str, clients: int, pause_s: float, seed: int = 0):
        self.url, self.model, self.clients, self.pause_s = url, model, clients, pause_s
        self.outcomes: list[Outcome] = []
        self.inject_kv_failure = False
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*(self._client(client, index) for index in range(self.clients)))

    def _words(self, n: int) -> str:
        return " ".join(self._rng.choice(WORDS) for _ in range(n))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        conversation: list[dict] = []
        history_tokens = 0  # the conversation's prompt tokens at its last turn, as the server counted them
        sent = 0
        while not self._stop.is_set():
            kind = sent % 4
            stream = sent % 2 == 1
            max_tokens = self._rng.choice((16, 32, 64))
            if kind < 2:  # a chat turn: the conversation grows (prefix reuse), restarting before the context is full
                if history_tokens > 1200:
                    conversation, history_tokens = [], 0
                conversation.append({"role": "user", "content": f"client {index}: {self._words(self._rng.randint(50, 300))}"})
                path, body = "/v1/chat/completions", {"messages": list(conversation)}
            else:
                path, body = "/v1/completions", {"prompt": f"{index} {sent} {self._words(self._rng.randint(20, 600))}"}
            body.update(model=self.model, max_tokens=max_tokens, temperature=0, stream=stream)
            if stream:
                body["stream_options"] = {"include_usage": True}
            headers = {INJECT_KV_FAILURE_HEADER: "1"} if self.inject_kv_failure else {}
            outcome, reply, prompt_tokens = await _send(client, self.url + path, body, headers)
            self.outcomes.append(outcome)
            if kind < 2:
                if outcome.ok and reply is not None:
                    conversation.append({"role": "assistant", "content": reply})
                    history_tokens = prompt_tokens + max_tokens
                else:
                    conversation.pop()
            sent += 1
            await asyncio.sleep(self.pause_s)


async def _send(client: httpx.AsyncClient, url: str, body: dict,
                headers: dict) -> tuple[Outcome, str | None, int]:
    """The outcome, the reply's text (None unless it succeeded) and its prompt tokens (usage)."""
    started = time.monotonic()
    try:
        if not body["stream"]:
            response = await client.post(url, json=body, headers=headers)
            data = response.json()
            if response.status_code != 200:
                return Outcome(started, time.monotonic(), response.status_code, _code(data)), None, 0
            choice = data["choices"][0]
            text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
            return Outcome(started, time.monotonic(), 200), text, data["usage"]["prompt_tokens"]
        parts, error, done, prompt_tokens = [], None, False, 0
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                data = json.loads(await response.aread())
                return Outcome(started, time.monotonic(), response.status_code, _code(data)), None, 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        error = chunk
                        continue
                    if chunk.get("usage"):
                        prompt_tokens = chunk["usage"]["prompt_tokens"]
                    if chunk.get("choices"):
                        choice = chunk["choices"][0]
                        parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        if error is not None:
            return Outcome(started, time.monotonic(), "error-event", _code(error)), None, 0
        if not done:
            return Outcome(started, time.monotonic(), "no-answer"), None, 0
        return Outcome(started, time.monotonic(), 200), "".join(parts), prompt_tokens
    except (httpx.HTTPError, ValueError, KeyError):
        return Outcome(started, time.monotonic(), "no-answer"), None, 0


def _failures(outcomes: list[Outcome]) -> dict[str, int]:
    """How many requests failed, by status and error code (e.g. "503 retry")."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            key = f"{o.status} {o.error_code or ''}".strip()
            counts[key] = counts.get(key, 0) + 1
    return counts


def _code(body: dict) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


# -- Serve's view ----------------------------------------------------------------------------------
def at_full_capacity(app: str, replicas: dict[str, int]) -> bool:
    from ray import serve

    application = serve.status().applications.get(app)
    if application is None:
        return False
    return all(dep.status == "HEALTHY" and dep.replica_states.get("RUNNING", 0) >= replicas.get(name, 1)
               for name, dep in application.deployments.items())


def wait_until(predicate, timeout_s: float = 600) -> float | None:
    """When `predicate` first held (polled each second), or None if it did not within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(1)
    return None


def pool_stats(app: str, pool: str):
    from ray import serve

    return serve.get_deployment_handle(pool, app_name=app).stats.remote().result(timeout_s=30)


def _alive_actor_pid(predicate, missing_ok: bool = False) -> int | None:
    from ray.util.state import list_actors

    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if predicate(a)]
    if not actors and not missing_ok:
        raise RuntimeError("no such actor alive")
    return actors[0].pid if actors else None


# -- phases ----------------------------------------------------------------------------------------
def soak(url: str, manifest, args) -> dict:
    warm_s = min(args.warmup_minutes * 60, args.minutes * 60 / 3)
    _log(f"soak: {args.clients} clients for {args.minutes:g} min (warm-up {warm_s:.0f} s), "
         f"memory sampled every {args.sample_s:g} s")
    started = time.monotonic()
    with Sampler(args.sample_s) as sampler, Load(url, manifest.model.name, args.clients, args.pause_s) as load:
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(30)
            done = len(load.outcomes)
            _log(f"  {(time.monotonic() - started) / 60:.1f} min: {done} requests, failed: "
                 f"{_failures(load.outcomes) or 'none'}")
    growth = memory_growth(sampler.samples, started + warm_s)
    outside = {g.pid: g for g in memory_growth(sampler.samples_outside_arenas, started + warm_s)}
    # The same over the second half only: a process still warming up (heap reaching its
    # high-water mark, KV pages first touched) grows early and then plateaus; a leak does not.
    late = {g.pid: g for g in memory_growth(sampler.samples, started + args.minutes * 60 / 2)}
    where = growth_by_kind(sampler.samples_by_kind, started + warm_s,
                           [pid for pid, g in outside.items() if g.growth_mib >= GROWTH_TARGET_MIB])
    prefill = manifest.pool_with_role(_role("prefill")).name
    deadline = time.monotonic() + 60
    while (leases := pool_stats(manifest.name, prefill).kv_transfer["leases_outstanding"]) and time.monotonic() < deadline:
        time.sleep(1)
    outcomes = load.outcomes
    return {"minutes": args.minutes, "warmup_s": warm_s, "clients": args.clients, "requests": len(outcomes),
            "failed": sum(not o.ok for o in outcomes), "failures": _failures(outcomes),
            "leases_outstanding_after": leases, "growth_target_mib": GROWTH_TARGET_MIB,
            "max_growth_mib": max((g.growth_mib for g in growth), default=0.0),
            "max_growth_outside_arenas_mib": max((g.growth_mib for g in outside.values()), default=0.0),
            "processes": [{"pid": g.pid, "label": g.label, "start_mib": round(g.start_mib, 1),
                           "end_mib": round(g.end_mib, 1), "growth_mib": round(g.growth_mib, 1),
                           "growth_outside_arenas_mib": round(outside[g.pid].growth_mib, 1) if g.pid in outside else None,
                           "growth_second_half_mib": round(late[g.pid].growth_mib, 1) if g.pid in late else None,
                           **({"growth_by_kind_mib": where[g.pid]} if g.pid in where else {})}
                          for g in growth],
            # Every process's resident MiB at each sample (seconds from the start), to see a plateau.
            "timeline": [{"at_s": round(sample.at_s - started, 1),
                          "rss_mib": {str(pid): round(rss / MIB, 1) for pid, (_label, rss) in sample.rss.items()}}
                         for sample in sampler.samples]}


def faults(url: str, manifest, args) -> list[dict]:
    replicas = {pool.name: pool.replicas for pool in manifest.pools}
    reports = []

    def is_prefill_replica(actor) -> bool:
        return actor.class_name.startswith("ServeReplica:") and actor.class_name.endswith(":prefill")

    def is_decode_rank(actor) -> bool:
        return actor.class_name == "LLMServer"  # an expert-parallel group's remote rank

    plan = [("prefill replica killed", "SIGKILL to the prefill ServeReplica's process", is_prefill_replica),
            ("decode EP rank killed", "SIGKILL to decode's rank-1 engine actor (LLMServer)", is_decode_rank),
            ("KV pulls failed", f"header {INJECT_KV_FAILURE_HEADER} on every request for {KV_FAULT_S:g} s "
                                "(failure_policy: recompute)", None)]
    with Load(url, manifest.model.name, args.clients, args.pause_s, seed=1) as load:
        time.sleep(20)  # steady state first
        for name, how, victim_of in plan:
            _log(f"fault: {name}")
            if victim_of is not None:
                victim = _alive_actor_pid(victim_of)
                fault_at = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                # Recovered: Serve reports every deployment serving again, with a new process.
                recovered_at = wait_until(lambda: at_full_capacity(manifest.name, replicas)
                                          and _alive_actor_pid(victim_of, missing_ok=True) not in (None, victim))
            else:
                fault_at = time.monotonic()
                load.inject_kv_failure = True
                time.sleep(KV_FAULT_S)
                load.inject_kv_failure = False
                recovered_at = time.monotonic()
            time.sleep(15)  # requests that straddle recovery finish
            report = fault_report(name, how, list(load.outcomes), fault_at, recovered_at)
            _log(f"  affected {report.affected}, lost {report.lost}, slowest {report.slowest_s:.1f} s, first success after "
                 f"{report.first_success_s}, full capacity after {report.full_capacity_s}")
            reports.append(report.to_dict())
    return reports


def _role(name: str):
    from cluster.manifest import PoolRole

    return PoolRole(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--warmup-minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--pause-s", type=float, default=0.5, help="each client's pause between requests")
    parser.add_argument("--sample-s", type=float, default=20.0)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = parser.parse_args()

    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    data = yaml.safe_load(MANIFEST.read_text())
    data["kv_transfer"]["allow_fault_injection"] = True  # this benchmark's copy only: the KV fault
    manifest = parse_manifest(data, "soak")
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        url = deploy(manifest, progress=_log).url
        results = {"soak": soak(url, manifest, args)}
        results["faults"] = [] if args.no_faults else faults(url, manifest, args)
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    s = results["soak"]
    print(f"\nsoak: {s['minutes']:g} min, {s['clients']} closed-loop clients, {s['requests']} requests, "
          f"{s['failed']} failed, prefill leases outstanding after: {s['leases_outstanding_after']}")
    print(f"resident memory growth after {s['warmup_s']:.0f} s warm-up (target < {GROWTH_TARGET_MIB:g} MiB); "
          f"'outside arenas' leaves out the KV cache and pool segments, whose pages become resident as "
          f"blocks are first used:\n")
    print("| process | start MiB | end MiB | growth MiB | growth outside arenas MiB | growth in the second half MiB |\n"
          "|---|---:|---:|---:|---:|---:|")
    for row in s["processes"]:
        rest, late = row["growth_outside_arenas_mib"], row.get("growth_second_half_mib")
        print(f"| {row['label']} ({row['pid']}) | {row['start_mib']:.0f} | {row['end_mib']:.0f} | "
              f"{row['growth_mib']:+.1f} | {'-' if rest is None else f'{rest:+.1f}'} | "
              f"{'-' if late is None else f'{late:+.1f}'} |")
    for row in s["processes"]:
        if row.get("growth_by_kind_mib"):
            kinds = ", ".join(f"{kind} {mib:+.1f}" for kind, mib in row["growth_by_kind_mib"].items())
            print(f"\n{row['label']} ({row['pid']}) grew by kind of mapping (MiB): {kinds}")
    if results["faults"]:
        print("\n| fault | how | affected | lost | slowest request s | first success s | full capacity s |\n"
              "|---|---|---:|---:|---:|---:|---:|")
        for f in results["faults"]:
            first = "-" if f["first_success_s"] is None else f"{f['first_success_s']:.1f}"
            full = "never" if f["full_capacity_s"] is None else f"{f['full_capacity_s']:.1f}"
            print(f"| {f['fault']} | {f['how']} | {f['affected']} | {f['lost']} | {f['slowest_s']:.1f} | {first} | {full} |")
    out = Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "args": vars(args), **results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
