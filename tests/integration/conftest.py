"""One real stack for the whole session: a multi-node local Ray cluster (real raylets on
loopback), the default manifest deployed through `ray job submit -- moe-serve deploy`, and
the greedy outputs of one plain vLLM engine on the same checkpoint to compare against."""

from __future__ import annotations

import contextlib

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MANIFEST = REPO / "manifests" / "local.yaml"

# Ports of the test cluster, away from the defaults so a developer's `moe-serve up` can coexist.
TEST_GCS_PORT = 6391
TEST_DASHBOARD_PORT = 8276
TEST_HTTP_PORT = 8012
TEST_METRICS_BASE = 8190
TEST_PROMETHEUS_PORT = 9391
# The test Prometheus's TTFT target is impossibly low, so that its SLO alert must fire.
IMPOSSIBLE_TTFT_SLO_S = 0.0001
# A tiny application is up in one to three minutes even on a loaded 2-core machine; past this
# a deploy is waiting for something that will not come (a node's CPUs or memory), and the
# test says so instead of sitting out pytest's timeout in every later module.
TEST_DEPLOY_TIMEOUT_S = 420


@dataclass(frozen=True)
class Stack:
    base_url: str
    model: str
    app_name: str
    dashboard_url: str
    manifest_path: Path
    max_model_len: int
    prometheus_url: str = ""
    prometheus: object = None  # the session's LocalPrometheus (the autoscaler module stops it)
    cluster: object = None  # the session's LocalCluster (the last module removes a node)


# The order of the integration modules. They share one cluster and one application (the
# `stack` fixture); the modules named here change it (kill replicas, restart the pool's master,
# stop Prometheus, tear clusters down) or read what all the others left, so they run after every
# other module, in this order. The others run first, in file-name order, and need the cluster whole.
RUN_LAST = (
    "test_expert_group_failure.py",      # kills an expert-parallel rank; its group is replaced
    "test_prefill_failure.py",           # kills a prefill replica mid-prefill
    "test_mooncake_and_fail_policy.py",  # Mooncake transport, and the fail policy on a broken pull
    "test_observability.py",             # every dashboard query has data: needs the series all the above made
    "test_autoscaler_stack.py",          # stops and restarts the session's Prometheus
    "test_long_context_stack.py",        # long: checks the budget left before it starts (tests/conftest.py)
    "test_cli_lifecycle.py",             # tears clusters down: last
)


def pytest_collection_modifyitems(session, config, items):
    here = Path(__file__).parent
    missing = [name for name in RUN_LAST if not (here / name).exists()]
    if missing:
        raise pytest.UsageError(f"tests/integration/conftest.py RUN_LAST names modules that do not exist: {missing}")
    rank = {name: index + 1 for index, name in enumerate(RUN_LAST)}
    # Stable: within a module, and among the modules that run first, collection order stays.
    items.sort(key=lambda item: rank.get(item.path.name, 0) if item.path.parent == here else 0)


def _log(message: str) -> None:
    print(f"[stack] {message}", file=sys.stderr, flush=True)


def submit_deploy(dashboard_url: str, manifest_path: Path) -> None:
    """`ray job submit -- moe-serve deploy MANIFEST`, as users run it; waits for the job."""
    for attempt in range(6):
        job = subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", dashboard_url,
             "--working-dir", str(REPO), "--", "moe-serve", "deploy", str(manifest_path),
             "--timeout", str(TEST_DEPLOY_TIMEOUT_S)],
            cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_AUTH_MODE": "token"},
        )
        output = job.stdout + job.stderr
        # A loaded machine can take a while to bring up the job agents after the nodes.
        if job.returncode != 0 and "No available agent" in output:
            _log(f"job agents not up yet (attempt {attempt + 1}); retrying in 5 s")
        # The job imported our code from its working_dir while it was still being unpacked
        # (local run 2026-12-07: `cannot import name 'responses' from 'deployments.frontend'`,
        # the file present a minute later; every node of a local cluster shares one session
        # folder, and Ray's runtime-env set-up races under load: ray-project/ray#49254).
        elif job.returncode != 0 and "working_dir_files" in output and "ImportError" in output \
                and attempt < 2:
            _log(f"the job's working_dir was not fully unpacked when it ran (attempt {attempt + 1}); "
                 "retrying in 5 s")
        else:
            break
        time.sleep(5)
    if job.returncode != 0:
        raise RuntimeError(f"ray job submit failed ({job.returncode}):\n{job.stdout[-4000:]}\n{job.stderr[-4000:]}")


def deploy_config_file(dashboard_url: str, manifest_path: Path, workdir: Path, timeout_s: float = TEST_DEPLOY_TIMEOUT_S) -> Path:
    """`moe-serve build MANIFEST` then Ray's own `serve deploy` of the written config, as Ray
    users deploy; returns once Serve runs the config-deployed application (not a previous
    version of the same name). Returns the config file's path."""
    import yaml as _yaml

    config_path = workdir / f"{manifest_path.stem}.serve.yaml"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([str(bin_dir / "moe-serve"), "build", str(manifest_path), "-o", str(config_path)],
                   check=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    app_name = _yaml.safe_load(config_path.read_text())["applications"][0]["name"]
    result = subprocess.run([str(bin_dir / "serve"), "deploy", str(config_path), "--address", dashboard_url],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"serve deploy failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    from ray import serve

    from cluster.serve_config import APP_BUILDER_IMPORT_PATH
    from cluster.serve_control import status_text

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        config = deployed_app_config(app_name)
        if app is not None and config and config.get("import_path") == APP_BUILDER_IMPORT_PATH:
            if str(getattr(app.status, "value", app.status)) == "RUNNING":
                return config_path
            if str(getattr(app.status, "value", app.status)) == "DEPLOY_FAILED":
                raise RuntimeError(f"config deploy of {app_name} failed:\n{status_text()}")
        time.sleep(2)
    raise RuntimeError(f"config deploy of {app_name} not RUNNING within {timeout_s:.0f}s:\n{status_text()}")


def deployed_app_config(app_name: str) -> dict | None:
    """The Serve config an application was deployed from; None when it was deployed from code
    (`serve.run`). From the controller's instance details (what `serve status` and the dashboard show)."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details().get("applications", {}).get(app_name) or {}
    return app.get("deployed_app_config")


def deploy_test_app(data: dict, label: str, progress=lambda message: None, fallback: Path | None = None):
    """Deploy `data` (a manifest dict) on the session's cluster, bounded in time. A deploy that
    fails is removed again, so that one broken module does not starve the next ones of the
    CPUs and memory its half-started replicas hold; with `fallback` (a manifest file of the same
    application, e.g. the session's), that one is deployed in its place, so that the modules after
    a broken one still find the application they share."""
    from cluster.manifest import load_manifest, parse_manifest
    from cluster.serve_control import deploy

    manifest = parse_manifest(data, label)
    try:
        deploy(manifest, progress=progress, timeout_s=TEST_DEPLOY_TIMEOUT_S)
    except BaseException:
        remove_test_app(manifest.name)
        if fallback is not None:
            _log(f"{label} did not deploy; restoring {fallback.name} for the modules after this one")
            try:
                deploy(load_manifest(fallback), progress=progress, timeout_s=TEST_DEPLOY_TIMEOUT_S)
            except Exception as exc:  # the original failure is the one to report
                _log(f"restoring {fallback.name} failed too: {exc}")
        raise
    return manifest


def remove_test_app(name: str) -> None:
    from ray import serve

    from cluster.kv_pool_service import stop_pool

    try:
        serve.delete(name)
    finally:
        stop_pool(name)


def settled(read, timeout_s: float = 20.0, interval_s: float = 0.5):
    """`read()` once two reads in a row agree (no store, load or pull still moving counters),
    or the last read at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        current = read()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current
        time.sleep(interval_s)


class ReferenceRun:
    """Greedy outputs of one plain vLLM engine (tests/reference_engine.py), computed in a
    subprocess; `outputs()` waits for it, and a failure shows the tail of its log.
    Started beside a deploy it saved nothing (CI, 2026-12-06: the DeepSeek P/D deploy took as
    long as reference plus deploy had, both fighting for two cores), so callers wait for it
    before they start a cluster or a deploy."""

    def __init__(self, args: list[str], out: Path, what: str, timeout_s: float = 600):
        self.out, self.what = out, what
        self._log_path = out.with_suffix(".log")
        self._started = time.monotonic()
        self._deadline = self._started + timeout_s
        self._outputs: dict | None = None
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "reference_engine.py"), *args],
                                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)

    def outputs(self) -> dict:
        if self._outputs is None:
            try:
                code = self._proc.wait(timeout=max(1.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"{self.what}: the reference engine ran past its timeout; "
                                     f"log: {self._log_tail()}") from None
            if code != 0:
                raise AssertionError(f"{self.what}: the reference engine exited with {code}; log: {self._log_tail()}")
            self._outputs = json.loads(self.out.read_text())
            _log(f"{self.what}: reference outputs ready {time.monotonic() - self._started:.0f}s after its start")
        return self._outputs

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _log_tail(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(none)"


@pytest.fixture(scope="session")
def reference_outputs(tmp_path_factory) -> dict:
    """Greedy outputs of one plain vLLM engine, computed once per session in a subprocess."""
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(DEFAULT_MANIFEST)
    out = tmp_path_factory.mktemp("reference") / "outputs.json"
    _log("computing reference outputs with a plain vLLM engine")
    run = ReferenceRun([str(resolve_model_path(manifest.model.path)), str(out), "--max-model-len",
                        str(manifest.model.max_model_len), "--dtype", manifest.model.dtype], out, "default model")
    try:
        return run.outputs()
    finally:
        run.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, reference_outputs) -> Stack:
    """The default manifest on a local multi-node cluster, deployed through `ray job submit`."""
    from cluster.local_cluster import ClusterPorts, LocalCluster
    from cluster.manifest import load_manifest, parse_manifest
    from cluster.serve_control import connect

    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    data["http"]["port"] = TEST_HTTP_PORT
    # Without the KV pool: the modules on this application count every prompt block over the
    # wire, and prompts repeat across them. The pool on the default layout is proven in
    # test_kv_pool_stack.py (its own application beside this one).
    data["kv_pool"] = {"enabled": False}
    # Tests opt in to fault injection (a request header forcing a KV transfer failure); every
    # shipped manifest keeps it off, since any client could send that header.
    data["kv_transfer"]["allow_fault_injection"] = True
    manifest = parse_manifest(data, "test manifest")
    manifest_path = tmp_path_factory.mktemp("manifest") / "local-test.yaml"
    manifest_path.write_text(yaml.safe_dump(data))
    load_manifest(manifest_path)

    from monitoring.alerts import alert_rules
    from monitoring.local_prometheus import LocalPrometheus

    cluster = LocalCluster.for_manifest(manifest, ClusterPorts(TEST_GCS_PORT, TEST_DASHBOARD_PORT, TEST_METRICS_BASE))
    cluster.start(progress=_log)
    # Started with the cluster so it sees every test's traffic (and the failures some provoke).
    prometheus = LocalPrometheus(port=TEST_PROMETHEUS_PORT, scrape_interval_s=2.0, workdir=tmp_path_factory.mktemp("prom"),
                                 rules=alert_rules(IMPOSSIBLE_TTFT_SLO_S, manifest.slo.itl_ms / 1e3, for_="0m"))
    try:
        prometheus.start(progress=_log)
        connect(cluster.address)
        started = time.monotonic()
        _log("deploying through `ray job submit -- moe-serve deploy`")
        submit_deploy(cluster.dashboard_url, manifest_path)
        _log(f"deployed in {time.monotonic() - started:.0f}s")
        yield Stack(
            base_url=f"http://127.0.0.1:{TEST_HTTP_PORT}", model=manifest.model.name, app_name=manifest.name,
            dashboard_url=cluster.dashboard_url, manifest_path=manifest_path,
            max_model_len=manifest.model.max_model_len, prometheus_url=prometheus.url, prometheus=prometheus,
            cluster=cluster,
        )
    finally:
        prometheus.stop()
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def engine_stats(stack):
    """Fetch ServerStats of every replica of the engine pool (through a Serve handle)."""
    from ray import serve

    def fetch(pool: str = "decode"):
        handle = serve.get_deployment_handle(pool, app_name=stack.app_name)
        return handle.stats.remote().result(timeout_s=30)

    return fetch


VLLM_SERVER_PORT = 8019


@contextlib.contextmanager
def plain_vllm_server(manifest, model_name: str, port: int, log: Path, what: str = "vLLM's OpenAI server"):
    """vLLM's own OpenAI server on the manifest's checkpoint, as users run it (its engine
    settings and tool parser), for the comparisons with ours: yields its URL; stopped after."""
    import httpx

    from cluster.checkpoints import resolve_model_path

    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(resolve_model_path(manifest.model.path)), "--served-model-name", model_name,
               "--max-model-len", str(manifest.model.max_model_len), "--dtype", manifest.model.dtype,
               "--enforce-eager", "--gpu-memory-utilization", "0.1", "--max-num-seqs", "8",
               "--tool-call-parser", manifest.model.tool_parser, "--enable-auto-tool-choice",
               "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    started = time.monotonic()
    _log(f"starting {what}")
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        _log(f"{what} up in {time.monotonic() - started:.0f}s")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# The differential fuzz's bodies (benchmarks/fuzz_bodies.py): seeded, so vLLM's answers can be
# recorded while its server is up for the feature comparisons and ours asked later.
FUZZ_BODIES = 250
FUZZ_SEED = 20261207


@dataclass
class PlainVLLMAnswers:
    features: dict[str, dict]  # openai_features.FEATURES name -> vLLM's answer
    fuzz_bodies: list  # benchmarks.fuzz_bodies.FuzzBody
    fuzz_answers: list  # benchmarks.fuzz_vs_vllm.Answer, one per body
    checkpoint: object  # benchmarks.fuzz_vs_vllm.Checkpoint


@pytest.fixture(scope="session")
def plain_vllm_answers(stack, tmp_path_factory) -> PlainVLLMAnswers:
    """vLLM's own OpenAI server's answers to every request of openai_features.FEATURES and to the
    differential fuzz's bodies: the server is started on the stack's checkpoint as users run it,
    asked once, and stopped, so the modules comparing our paths with it share one start (about
    a minute and a half here) and no server idles beside the stack."""
    import asyncio

    from benchmarks.fuzz_bodies import generate
    from benchmarks.fuzz_vs_vllm import ask_all, checkpoint_of
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest
    from tests.integration.openai_features import FEATURES, ask

    manifest = load_manifest(stack.manifest_path)
    checkpoint = checkpoint_of(str(resolve_model_path(manifest.model.path)))
    bodies = generate(FUZZ_BODIES, FUZZ_SEED, stack.model, checkpoint.vocab_size, checkpoint.tokenizer_size)
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    started = time.monotonic()
    with plain_vllm_server(manifest, stack.model, VLLM_SERVER_PORT, log,
                           "vLLM's OpenAI server for the comparisons with ours") as url:
        features = {name: ask(url, stack.model, name) for name in FEATURES}
        fuzz_answers = asyncio.run(ask_all(bodies, url, concurrency=4))
    _log(f"vLLM's answers to {len(features)} feature requests and {len(bodies)} fuzz bodies in "
         f"{time.monotonic() - started:.0f}s")
    return PlainVLLMAnswers(features, bodies, fuzz_answers, checkpoint)


@pytest.fixture(scope="session")
def vllm_feature_answers(plain_vllm_answers) -> dict[str, dict]:
    return plain_vllm_answers.features
