"""Side by side with vLLM's own benchmark client (`vllm bench serve`), the way users compare
servers: a plain vLLM OpenAI server vs moe-serve on the same machine and checkpoint.

    .venv/bin/python -m benchmarks.bench_serving --rounds 3
    .venv/bin/python -m benchmarks.bench_serving --rounds 3 --with-default   # + manifests/local.yaml

Client: `vllm bench serve --dataset-name random --random-input-len 256 --random-output-len 64
--num-prompts 64 --ignore-eos`, the tiny checkpoint's local path as --model/--tokenizer (served
as the manifest's model name), results read from its --save-result JSON (with the CPU wheel,
whose `vllm` script dies on its own version lookup, the same CLI entry point runs through
benchmarks/vllm_cli.py). Two measurements:
request throughput at saturation (--request-rate inf) and TTFT / TPOT p50 at --request-rate 8.
Per system: one warm-up run, then --rounds rounds of both measurements; the table gives
medians and each system's ratio to the plain vLLM server. Every run uses its own --seed
(the same seeds for every system), so prefix caching never sees a prompt twice.

Systems, each in its own subprocess, started, measured and stopped before the next starts:
  vllm                  `python -m vllm.entrypoints.openai.api_server`, the engine settings of
                        manifests/local-colocated.yaml (same dtype, lengths, batch, KV space)
  moe-serve             manifests/local-colocated.yaml on a LocalCluster with `http.front:
                        serve_proxy`: Serve's Python HTTP proxy actor in front (:8000)
  moe-serve-throughput  the same with `throughput_optimized: true` (RAY_SERVE_THROUGHPUT_OPTIMIZED=1
                        before Ray starts: gRPC between replicas, direct ingress, user code on
                        the replica's main loop), measured through the proxy (:8000)
  moe-serve-throughput-direct
                        the same mode, measured on the ingress replica's own HTTP port (direct
                        ingress: 30000 and up, listed by Serve's controller as target groups)
  moe-serve-haproxy     `http.front: haproxy`, the manifests' default: Serve's HAProxy mode,
                        HAProxy on :8000 forwarding to the ingress replica's own port
  ray-serve-llm         Ray Serve LLM (`ray.serve.llm.build_openai_app`) serving the same checkpoint
                        with the same engine settings (one replica, one CPU bundle) on the same
                        cluster layout, behind Serve's Python proxy (its default)
  ray-serve-llm-haproxy the same behind Serve's HAProxy mode
  moe-serve-default     manifests/local.yaml (P/D + EP decode), only with --with-default

Writes benchmarks/results/serving.json (command, date, cpus, args, probes, raw rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.serving_baselines import measure_plain_vllm, measure_ray_serve_llm
from benchmarks.serving_client import (MEASUREMENTS, OFFLINE_ENV, WARMUP_SEED, _log, _manifest, client_command,
                                       measure, probe, stop_local_cluster)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
COLOCATED = REPO / "manifests" / "local-colocated.yaml"
DEFAULT = REPO / "manifests" / "local.yaml"
BASELINE = "vllm"
SERVE_PROXY = {"front": "serve_proxy"}
SERVE_PROXY_THROUGHPUT = {"front": "serve_proxy", "throughput_optimized": True}
HAPROXY = {"front": "haproxy"}
SYSTEMS = {
    # name: (label in the table, manifest or None for the plain server, overrides of the
    #        manifest's http section, which URL to measure: "proxy" = the manifest's http
    #        host:port, "direct" = an ingress replica's own port as Serve's controller lists it)
    "vllm": ("plain vLLM server (`vllm.entrypoints.openai.api_server`)", None, {}, None),
    "moe-serve": ("moe-serve colocated, `http.front: serve_proxy` (Serve's Python proxy, :8000)",
                  COLOCATED, SERVE_PROXY, "proxy"),
    "moe-serve-throughput": ("moe-serve colocated, `serve_proxy` + `throughput_optimized` (:8000)",
                             COLOCATED, SERVE_PROXY_THROUGHPUT, "proxy"),
    "moe-serve-throughput-direct": ("moe-serve colocated, throughput mode, direct to the ingress replica's "
                                    "port", COLOCATED, SERVE_PROXY_THROUGHPUT, "direct"),
    "moe-serve-haproxy": ("moe-serve colocated, `http.front: haproxy` (the default, :8000)", COLOCATED,
                          HAPROXY, "proxy"),
    "ray-serve-llm": ("Ray Serve LLM (`ray.serve.llm.build_openai_app`, colocated, Serve's proxy)", COLOCATED,
                      SERVE_PROXY, "proxy"),
    "ray-serve-llm-haproxy": ("Ray Serve LLM, Serve's HAProxy mode (:8000)", COLOCATED, HAPROXY, "proxy"),
    "moe-serve-default": ("moe-serve, `manifests/local.yaml` (P/D + 2-rank EP decode, haproxy)", DEFAULT,
                          HAPROXY, "proxy"),
}
DEFAULT_SYSTEMS = ["vllm", "moe-serve", "moe-serve-throughput", "moe-serve-throughput-direct", "moe-serve-haproxy",
                   "ray-serve-llm", "ray-serve-llm-haproxy"]


# ---------------------------------------------------------------- pure parts (unit-tested)

def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_by_key(dicts) -> dict[str, float]:
    """Per key, the median over the dicts that have it."""
    dicts = [d for d in dicts if d]
    return {key: statistics.median(d[key] for d in dicts if key in d) for key in sorted({k for d in dicts for k in d})}


def format_cpu_table(rows: dict[str, dict], labels: dict[str, str]) -> str:
    """CPU milliseconds per request at saturation, by part of the serving path, per system."""
    parts = sorted({p for row in rows.values() for p in (row.get("cpu_ms_per_request") or {}) if p != "total"})
    lines = ["| system | " + " | ".join(parts) + " | total |", "|---|" + "---:|" * (len(parts) + 1)]
    for name, row in rows.items():
        cpu = row.get("cpu_ms_per_request") or {}
        if cpu:
            lines.append(f"| {labels.get(name, name)} | " + " | ".join(_fmt(cpu.get(p), ".1f") for p in parts)
                         + f" | {_fmt(cpu.get('total'), '.1f')} |")
    return "\n".join(lines)


def summarize_rounds(rounds: list[dict]) -> dict:
    """Medians over rounds: each round is {"saturation": parsed, "rate8": parsed} (a part may be
    missing or None when that run failed)."""
    def pick(measurement: str, key: str):
        return median_or_none((r.get(measurement) or {}).get(key) for r in rounds)

    return {
        "sat_rps": pick("saturation", "request_throughput"),
        "ttft_p50_ms": pick("rate8", "median_ttft_ms"),
        "tpot_p50_ms": pick("rate8", "median_tpot_ms"),
        "rate8_rps": pick("rate8", "request_throughput"),
        "cpu_ms_per_request": median_by_key((r.get("saturation") or {}).get("cpu_ms_per_request") for r in rounds),
        "rounds": len(rounds),
        "incomplete_runs": sum(1 for r in rounds for m in MEASUREMENTS
                               if r.get(m) is not None and not r[m]["complete"]),
    }


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def with_ratios(summaries: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    base = summaries.get(baseline) or {}
    out = {}
    for name, summary in summaries.items():
        out[name] = {**summary,
                     "rps_vs_vllm": ratio(summary.get("sat_rps"), base.get("sat_rps")),
                     "ttft_vs_vllm": ratio(summary.get("ttft_p50_ms"), base.get("ttft_p50_ms")),
                     "tpot_vs_vllm": ratio(summary.get("tpot_p50_ms"), base.get("tpot_p50_ms"))}
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: dict[str, dict], labels: dict[str, str]) -> str:
    lines = ["| system | req/s sat. | TTFT p50 ms @8 | TPOT p50 ms @8 | req/s vs vLLM | TTFT vs vLLM |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        label = labels.get(name, name)
        if row.get("error"):
            lines.append(f"| {label} | failed | - | - | - | - |")
            continue
        lines.append(f"| {label} | {_fmt(row.get('sat_rps'), '.1f')} | {_fmt(row.get('ttft_p50_ms'), '.0f')} | "
                     f"{_fmt(row.get('tpot_p50_ms'), '.1f')} | {_fmt(row.get('rps_vs_vllm'), '.2f')} | "
                     f"{_fmt(row.get('ttft_vs_vllm'), '.2f')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- running (subprocesses)

def _direct_ingress_urls(app_name: str) -> list[str]:
    """HTTP targets Serve's controller lists for the app (with direct ingress: the ingress
    replicas' own ports; otherwise the proxies)."""
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    groups = ray.get(client._controller.get_target_groups.remote(app_name))
    urls = []
    for group in groups:
        if str(getattr(group.protocol, "value", group.protocol)).upper() != "HTTP":
            continue
        prefix = group.route_prefix.rstrip("/")
        urls += [f"http://{t.ip}:{t.port}{prefix}" for t in group.targets]
    return urls


def pick_url(probes: list[dict], proxy_url: str, prefer: str) -> str | None:
    """The URL to measure: the first that served both probes, the proxy's or (prefer="direct")
    one of the others; None when none did (or, for "direct", no other URL did)."""
    working = [p["url"] for p in probes if p.get("ok")]
    if prefer == "direct":
        return next((u for u in working if u != proxy_url), None)
    return proxy_url if proxy_url in working else None


def measure_moe_serve(system: str, manifest_path: Path, args) -> dict:
    from cluster.checkpoints import resolve_model_path
    from cluster.local_cluster import LocalCluster
    from cluster.serve_control import connect, deploy

    manifest = _manifest(manifest_path, SYSTEMS[system][2])
    model_path = str(resolve_model_path(manifest.model.path))
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    flags = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    _log(f"{system}: Ray Serve environment {flags or '{}'}")
    try:
        connect(cluster.address)
        from ray.serve._private import constants

        mode = {k: getattr(constants, k, None) for k in (
            "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_USE_GRPC_BY_DEFAULT",
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")}
        _log(f"{system}: Serve constants in the driver: {mode}")
        result = deploy(manifest, progress=_log)
        candidates = [result.url]
        try:
            candidates += [u for u in _direct_ingress_urls(manifest.name) if u not in candidates]
        except Exception as exc:
            _log(f"{system}: could not list target groups: {type(exc).__name__}: {exc}")
        probes = []
        for candidate in candidates:
            checks = probe(candidate, manifest.model.name)
            _log(f"{system}: probe {checks}")
            probes.append(checks)
        url = pick_url(probes, result.url, SYSTEMS[system][3])
        out = {"serve_constants": mode, "candidates": candidates, "probes": probes, "url": url,
               "model_path": model_path}
        if url is None:
            out["error"] = f"no {SYSTEMS[system][3]} URL served both a plain and a streamed /v1/completions: " + "; ".join(
                f"{p['url']}: plain {p.get('plain_status')} {p.get('plain_error', '')} / stream "
                f"{p.get('stream_status')} {p.get('stream_error', '')} chunks {p.get('stream_chunks')}"
                for p in probes)
            _log(f"{system}: {out['error']}")
            return out
        _log(f"{system}: measuring on {url}")
        out["rounds"] = measure(url, model_path, manifest.model.name, args, system)
        return out
    finally:
        stop_local_cluster(cluster, system)


def measure_one(system: str, args) -> dict:
    manifest = SYSTEMS[system][1]
    if manifest is None:
        return measure_plain_vllm(args)
    if system.startswith("ray-serve-llm"):
        return measure_ray_serve_llm(system, SYSTEMS[system][2], args)
    return measure_moe_serve(system, manifest, args)


def _leftovers() -> str:
    proc = subprocess.run(["pgrep", "-fa", "raylet|gcs_server|vllm.entrypoints.openai.api_server|VLLM::|mooncake|haproxy"],
                          capture_output=True, text=True)
    mine = [line for line in proc.stdout.splitlines() if "pgrep" not in line]
    return "\n".join(mine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--with-default", action="store_true", help="also manifests/local.yaml (P/D + EP decode)")
    parser.add_argument("--systems", default=None,
                        help="comma-separated subset (rerun only these; others are kept from --out if there)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--client-timeout", type=float, default=600.0)
    parser.add_argument("--one", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "serving.json"))
    args = parser.parse_args()

    if args.one:
        os.environ.update(OFFLINE_ENV)
        try:
            data = measure_one(args.one, args)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            data = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        Path(args.out).write_text(json.dumps(data, default=str))
        return 0

    started = time.monotonic()
    systems = DEFAULT_SYSTEMS + (["moe-serve-default"] if args.with_default else [])
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    out = Path(args.out)
    previous = json.loads(out.read_text()) if args.systems and out.exists() else {}
    raw: dict[str, dict] = dict(previous.get("raw", {}))
    for system in systems:
        label, _, http, _ = SYSTEMS[system]
        _log(f"=== {system}: {label} ===")
        part = RESULTS / f".serving-{system}.json"
        child_args = [sys.executable, "-m", "benchmarks.bench_serving", "--one", system, "--out", str(part),
                      "--rounds", str(args.rounds), "--num-prompts", str(args.num_prompts),
                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--start-timeout", str(args.start_timeout), "--client-timeout", str(args.client_timeout)]
        system_started = time.monotonic()
        # The child's cluster takes its Serve variables from the manifest's http section
        # (LocalCluster.for_manifest); none may leak in from this shell.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        proc = subprocess.run(child_args, cwd=REPO, env={**env, **OFFLINE_ENV})
        data = json.loads(part.read_text()) if part.exists() else {"error": f"subprocess exited {proc.returncode}"}
        part.unlink(missing_ok=True)
        data["seconds"] = round(time.monotonic() - system_started, 1)
        data["http"] = http
        raw[system] = data
        left = _leftovers()
        if left:
            _log(f"WARNING: processes still running after {system}:\n{left}")
        _log(f"{system} done in {data['seconds']:.0f}s" + (f" (error: {data['error'][:300]})" if data.get("error") else ""))

    summaries = {}
    for system, data in raw.items():
        summary = summarize_rounds(data["rounds"]) if data.get("rounds") else {}
        if data.get("error"):
            summary["error"] = data["error"]
        summaries[system] = summary
    order = [s for s in SYSTEMS if s in summaries]
    table = with_ratios({s: summaries[s] for s in order})
    labels = {name: spec[0] for name, spec in SYSTEMS.items()}
    print(f"\n`vllm bench serve`: random dataset, {args.input_len} input / {args.output_len} output tokens, "
          f"{args.num_prompts} prompts, --ignore-eos; saturation = --request-rate inf, latencies at "
          f"--request-rate 8; median of {args.rounds} rounds after one warm-up; {os.cpu_count()} CPUs\n")
    print(format_table(table, labels))
    print("\nCPU milliseconds per request at saturation, by part of the serving path (all processes of "
          "the machine, client excluded; benchmarks/cpu_accounting.py):\n")
    print(format_cpu_table(table, labels))
    for system in order:
        probes = raw[system].get("probes") or []
        for p in probes:
            print(f"\nprobe {system} {p['url']}: plain {p.get('plain_status')}, stream {p.get('stream_status')} "
                  f"({p.get('stream_chunks')} chunks, first {p.get('stream_first_s')} s, last {p.get('stream_last_s')} s)"
                  + (f" plain error: {p['plain_error'][:300]}" if p.get("plain_error") else "")
                  + (f" stream error: {p['stream_error'][:300]}" if p.get("stream_error") else ""))
    elapsed = time.monotonic() - started
    out.write_text(json.dumps({
        "command": " ".join([os.path.relpath(sys.executable, REPO), "-m", "benchmarks.bench_serving", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(), "args": vars(args),
        "client": " ".join(client_command()), "seconds": round(elapsed, 1),
        "seeds": {"warmup": WARMUP_SEED, "round_i": "100*i + (0 saturation, 1 rate 8)"},
        "table": table, "raw": raw}, indent=1, default=str))
    print(f"\nwrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
