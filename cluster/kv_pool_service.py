"""The KV pool's master: a supervised `mooncake_master` process, owned by a detached Ray actor.

One master per application (actor "moe-serve-kv-pool-{app}", namespace "moe-serve"), on the
node that asked for it, with 0 CPUs (it is a process beside the engines, not a compute task).
The actor starts the master and a supervisor thread restarts it on the same ports when it
exits (backoff 0.5 s doubling to 5 s while it keeps dying within 10 s of its start). Clients
reconnect to a restarted master by themselves (`kv_transfer.pool.mooncake_store`); its objects
are lost, which is correct for a cache.

Flags (mooncake_master 0.3.13, `--help`):
- `--rpc_port`, `--enable_http_metadata_server --http_metadata_server_port`: the master also
  serves Mooncake's metadata over HTTP, so the pool needs no etcd.
- `--rpc_address`, `--http_metadata_server_host`: bind the host clients are told about.
- `--metrics_port`: a free port of its own (the default 9003 would collide between apps).
- `--eviction_high_watermark_ratio=0.9 --eviction_ratio=0.1`: the pool is a cache; above 90%
  full the master evicts 10% of objects, so puts rarely meet a full pool (-200, "refused").
- `--default_kv_lease_ttl=10000` (ms): a read takes a lease that keeps its objects from being
  evicted until it ends; it must outlast the clients' transfer deadline (5 s).
- `--client_ttl=10 --enable_metadata_cleanup_on_timeout=true`: a client gone without closing
  (a killed engine) loses its segment and its metadata entries 10 s after its last heartbeat.
- `--logtostderr`: glog lines go to our log file, not to glog's own files in /tmp.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import ClusterError

logger = logging.getLogger(__name__)

NAMESPACE = "moe-serve"
READY_TIMEOUT_S = 20.0
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 5.0
_STABLE_AFTER_S = 10.0  # a master that lived this long restarts with the first backoff again


def actor_name(app_name: str) -> str:
    return f"moe-serve-kv-pool-{app_name}"


def master_binary() -> Path:
    """The mooncake_master executable shipped inside the Mooncake wheel."""
    try:
        import mooncake
    except ImportError:
        raise ClusterError("the KV pool needs Mooncake: pip install mooncake-transfer-engine-cuda13 "
                           "(mooncake-transfer-engine-non-cuda on CPU machines)") from None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(path, os.X_OK):
        raise ClusterError(f"{path} is missing or not executable; reinstall the Mooncake wheel")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        socket.create_connection((host, port), timeout_s).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MasterConfig:
    """Where one master listens and how it evicts."""

    host: str
    rpc_port: int
    http_port: int
    metrics_port: int
    eviction_high_watermark_ratio: float = 0.9
    eviction_ratio: float = 0.1
    kv_lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    # A disk tier under the engines' DRAM segments (manifest kv_pool.disk): objects the master
    # evicts are written to their client's disk first (offload on evict), evicted anyway when the
    # offload queue is full (never a pool that refuses every put), and promoted back to memory
    # on their second read. The clients own the files (kv_transfer/pool/mooncake_store.py).
    offload: bool = False
    # Session retention (manifest kv_pool.sessions): objects put with a soft pin stay in DRAM
    # until their pin expires, while unpinned ones are evicted (demoted) first. Mooncake's
    # default lets eviction take pinned objects too when it finds too little else, which
    # measured here left none of 24 pinned objects in memory (docs/long-context.md).
    keep_pinned: bool = False

    def command(self, binary: Path) -> list[str]:
        return [str(binary), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                f"--http_metadata_server_host={self.host}", f"--metrics_port={self.metrics_port}",
                # Its metrics/admin server (it lists and can drop every key) listens on every
                # interface unless told otherwise: only where the master itself is reached.
                f"--metrics_host={self.host}",
                f"--eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}",
                f"--eviction_ratio={self.eviction_ratio}", f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}",
                f"--client_ttl={self.client_ttl_s}", "--enable_metadata_cleanup_on_timeout=true",
                "--logtostderr", *self._offload_flags(),
                *(["--allow_evict_soft_pinned_objects=false"] if self.keep_pinned else [])]

    def _offload_flags(self) -> list[str]:
        if not self.offload:
            return []
        return ["--enable_offload=true", "--offload_on_evict=true", "--offload_force_evict=true",
                "--promotion_on_hit=true", "--promotion_admission_threshold=2",
                "--promotion_max_per_heartbeat=16"]


def _parent_death_signal():
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies (no orphaned
    master). libc is loaded here, in the parent: importing in a forked child can deadlock."""
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class KVPoolMaster:
    """Runs and supervises one mooncake_master. A plain class: the Ray actor, and tests, use it.

    Every master process is started by the supervisor thread, which lives as long as the
    service: the child's parent-death signal fires when the thread that forked it exits.
    """

    def __init__(self, app_name: str, host: str = "127.0.0.1", rpc_port: int | None = None,
                 http_port: int | None = None, log_dir: str | None = None, offload: bool = False,
                 keep_pinned: bool = False):
        self.config = MasterConfig(host, rpc_port or free_port(host), http_port or free_port(host),
                                   free_port(host), offload=offload, keep_pinned=keep_pinned)
        self._binary = master_binary()
        log_name = f"moe-serve-kv-pool-{app_name}-{self.config.rpc_port}.log"
        self.log_path = Path(log_dir or tempfile.gettempdir()) / log_name
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._thread = threading.Thread(target=self._supervise, daemon=True, name="kv-pool-master")
        self._thread.start()
        self._started.wait(10)
        if self._start_error is not None:
            raise ClusterError(f"could not start {self._binary}: {self._start_error}")

    def address(self) -> dict:
        c = self.config
        with self._lock:
            pid = self._proc.pid if self._proc else None
        return {"master_address": f"{c.host}:{c.rpc_port}", "metadata_url": f"http://{c.host}:{c.http_port}/metadata",
                "metrics_port": c.metrics_port, "restarts": self.restarts, "pid": pid, "log_path": str(self.log_path),
                "offload": c.offload, "keep_pinned": c.keep_pinned}

    def ready(self) -> bool:
        """The master accepts connections on its RPC and metadata ports."""
        c = self.config
        return port_open(c.host, c.rpc_port) and port_open(c.host, c.http_port)

    def kill_master(self) -> int | None:
        """SIGKILL the current master (fault tests); the supervisor restarts it. Its pid."""
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        proc.kill()
        return proc.pid

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._thread.join(10)

    def _supervise(self) -> None:
        backoff_s = _BACKOFF_FIRST_S
        preexec = _parent_death_signal()
        while not self._stopping.is_set():
            started_s = time.monotonic()
            try:
                with open(self.log_path, "ab") as log, self._lock:
                    if self._stopping.is_set():
                        break
                    self._proc = subprocess.Popen(self.config.command(self._binary), stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  preexec_fn=preexec)
            except OSError as exc:
                self._start_error = exc
                self._started.set()
                return
            self._started.set()
            code = self._proc.wait()
            if self._stopping.is_set():
                break
            backoff_s = _BACKOFF_FIRST_S if time.monotonic() - started_s >= _STABLE_AFTER_S else backoff_s
            logger.warning("mooncake_master exited with %s; restarting in %.1f s (log %s)",
                           code, backoff_s, self.log_path)
            self.restarts += 1
            if self._stopping.wait(backoff_s):
                break
            backoff_s = min(backoff_s * 2, _BACKOFF_MAX_S)


def ensure_pool(app_name: str, host: str = "127.0.0.1", rpc_port: int | None = None,
                http_port: int | None = None, node_id: str | None = None, offload: bool = False,
                keep_pinned: bool = False) -> dict:
    """The app's pool master (started on `node_id`, default this node, if not running); its
    `address()` once it accepts connections. Needs a connected Ray driver. A running master
    keeps its ports (the clients know them): `rpc_port`/`http_port` only apply when it starts."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = _live_actor(app_name)
    if actor is None:
        node_id = node_id or ray.get_runtime_context().get_node_id()
        actor = ray.remote(KVPoolMaster).options(
            name=actor_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(app_name, host, rpc_port, http_port, None, offload, keep_pinned)
    try:
        address = ray.get(actor.address.remote(), timeout=READY_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - actor creation errors come back as Ray errors
        raise ClusterError(f"the KV pool master of {app_name!r} did not start: {exc}") from None
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    while not ray.get(actor.ready.remote(), timeout=READY_TIMEOUT_S):
        if time.monotonic() > deadline_s:
            raise ClusterError(f"the KV pool master of {app_name!r} does not accept connections at "
                               f"{address['master_address']} after {READY_TIMEOUT_S:g} s; see {address['log_path']}")
        time.sleep(0.2)
    return ray.get(actor.address.remote(), timeout=READY_TIMEOUT_S)


def _actor(app_name: str):
    """The app's pool actor, or None when there is none."""
    import ray

    try:
        return ray.get_actor(actor_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None


def stop_pool(app_name: str) -> bool:
    """Stop the app's pool master and its actor; False when there was none."""
    import ray

    actor = _actor(app_name)
    if actor is None:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below all the same
        logger.warning("stopping the KV pool master of %r failed; killing its actor", app_name, exc_info=True)
    ray.kill(actor)
    return True


def kill_master(app_name: str) -> int | None:
    """SIGKILL the app's master process (fault tests); its supervisor restarts it. The pid
    killed, or None when no master was running."""
    import ray

    actor = _actor(app_name)
    return None if actor is None else ray.get(actor.kill_master.remote(), timeout=30)


def _live_actor(app_name: str):
    """The app's actor if it exists and answers, else None (a dead one is killed)."""
    import ray

    actor = _actor(app_name)
    if actor is None:
        return None
    try:
        ray.get(actor.address.remote(), timeout=5)
        return actor
    except Exception:  # noqa: BLE001 - dead, restarting, or stuck: replace it
        ray.kill(actor)
        return None
