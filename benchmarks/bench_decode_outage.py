"""Decode outage under retrying clients: what it leaves behind. Backs RELIABILITY.md.

    .venv/bin/python -m benchmarks.bench_decode_outage            # default manifest, 8 clients

The default manifest's stack (prefill pool, decode pool of one 2-rank expert-parallel group)
under closed-loop clients that send their next request as soon as an answer arrives, a retry
of sorts after every 503. One decode rank is killed; every request the broken group takes
fails before its first token while its prompt has already been prefilled. Before issue 27 each
of those prefills left its lease pinned until the deadline (30 s) and the failure was a
retriable 503, so retries pinned more: prefill's KV filled with leases nobody would pull.

Measured, once the group is back and the load has stopped:
- prefill leases still outstanding (target 0), and leases that ended by their deadline over the
  whole outage instead of a release (target 0: every lease was released);
- admission places the ingress still holds (target 0);
- the answers during the outage by status and code.

Writes benchmarks/results/decode_outage.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from benchmarks.bench_soak import Load, _alive_actor_pid, at_full_capacity, pool_stats, wait_until

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MANIFEST = REPO / "manifests" / "local.yaml"


def _log(message: str) -> None:
    print(f"[decode outage {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _leases(app: str) -> tuple[int, int]:
    """(outstanding, ended by their deadline) on the prefill replica."""
    kv = pool_stats(app, "prefill").kv_transfer
    return kv.get("leases_outstanding", 0), kv.get("leases_expired_total", 0)


def _admitted(app: str) -> int | None:
    from ray import serve

    from deployments.builder import INGRESS_DEPLOYMENT

    return serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=app).admitted.remote().result(timeout_s=30)


def _is_decode_rank(actor) -> bool:
    return actor.class_name == "LLMServer"  # an expert-parallel group's remote rank


def outage(app: str, url: str, manifest, args) -> dict:
    replicas = {pool.name: pool.replicas for pool in manifest.pools}
    with Load(url, manifest.model.name, args.clients, args.pause_s, seed=2) as load:
        time.sleep(args.steady_s)
        outstanding_before, expired_before = _leases(app)
        victim = _alive_actor_pid(_is_decode_rank)
        _log(f"killing decode rank pid {victim}; {len(load.outcomes)} requests so far")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        recovered_at = wait_until(lambda: at_full_capacity(app, replicas)
                                  and _alive_actor_pid(_is_decode_rank, missing_ok=True) not in (None, victim))
        _log(f"group back after {recovered_at - killed_at:.0f} s" if recovered_at else "group never came back")
        time.sleep(args.after_s)
        during = [o for o in load.outcomes if killed_at <= o.started_s <= (recovered_at or time.monotonic())]
    stopped_at = time.monotonic()
    # What the outage left: read right after the load stopped (the last requests have ended).
    settle_deadline = stopped_at + args.settle_s
    while _leases(app)[0] and time.monotonic() < settle_deadline:
        time.sleep(0.5)
    outstanding_after, expired_after = _leases(app)
    answers = collections.Counter(f"{o.status} {o.error_code}" if o.error_code else str(o.status) for o in during)
    return {"killed_rank_pid": victim, "recovered_s": None if recovered_at is None else recovered_at - killed_at,
            "requests_during_outage": len(during), "answers_during_outage": dict(answers),
            "leases_outstanding_before": outstanding_before,
            "leases_outstanding_after": outstanding_after,
            "leases_expired_during": expired_after - expired_before,
            "settled_within_s": time.monotonic() - stopped_at,
            "admitted_after": _admitted(app)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pause-s", type=float, default=0.0, help="each client's pause between requests")
    parser.add_argument("--steady-s", type=float, default=30.0, help="load before the kill")
    parser.add_argument("--after-s", type=float, default=15.0, help="load after the group is back")
    parser.add_argument("--settle-s", type=float, default=5.0, help="how long leases may take to be released")
    parser.add_argument("--out", default=str(RESULTS / "decode_outage.json"))
    args = parser.parse_args()

    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    manifest = parse_manifest(yaml.safe_load(MANIFEST.read_text()), "decode-outage")
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        url = deploy(manifest, progress=_log).url
        result = outage(manifest.name, url, manifest, args)
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()

    print("\n| measure | value | target |\n|---|---:|---:|")
    rows = [("requests sent while the group was down", result["requests_during_outage"], ""),
            ("their answers", ", ".join(f"{k}: {v}" for k, v in sorted(result["answers_during_outage"].items())), ""),
            ("group back after (s)", f"{result['recovered_s']:.0f}" if result["recovered_s"] else "never", ""),
            ("prefill leases outstanding after", result["leases_outstanding_after"], "0"),
            ("prefill leases ended by their deadline during the outage", result["leases_expired_during"], "0"),
            ("admission places held after", result["admitted_after"], "0")]
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    out = Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "args": vars(args), **result}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
