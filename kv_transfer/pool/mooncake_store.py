"""Mooncake Store adapter of the KV pool (`PoolStore`): one `MooncakeDistributedStore` client.

Measured with mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP on loopback, 2-core box:
(a) setup() with global_segment_size=0 makes a lookup-only client (0.3-0.6 s) that reads and
    writes objects in other clients' segments; allocate_and_mount_segment() adds a segment
    later (0.05 s for 32 MiB). (b) Two clients live side by side in one process (`mooncake_shared`).
(c) Master killed: calls return RPC_FAIL (-900), at once or after 4.3-4.9 s (reconnecting);
    health_check() turns 2 within seconds and costs 0.2 us (a flag kept by a ping thread). Master hung (SIGSTOP): health_check() stays 0 and
    every call blocks 30 s, then returns -901. setup() with no master blocks 92 s, returns -1.
    close() takes 2 s, 15 s with the master gone. Any call on a closed client segfaults.
(d) Master restarted on the same ports: the existing client reconnects by itself (after 5
    failed pings) and re-mounts its segment; puts return -200 for about a second, then all
    works. Objects are gone (the master keeps them in memory). No re-creation is needed.
(e) batch_put_from of an existing key returns 0 and keeps the first object; a full pool returns
    -200 (NO_AVAILABLE_HANDLE); eviction above the high watermark makes room within a second.
(f) batch_get_into: -704 (OBJECT_NOT_FOUND) for a missing key, -600 for a too-small buffer.
    batch_is_exist of 64 keys takes 68 us. setup() refuses a segment of 0 < size < 16 MiB (-600).
(g) Placement: without a preference the master puts an object in any client's segment. A read
    from the reader's own segment is a local copy: 32 objects of 256 KiB read in 1.6 ms from
    its own segment vs 4.6 ms from another client's, 5.5 vs 16.5 ms with three busy processes
    beside (benchmarks/bench_pool_load.py). `ReplicateConfig.preferred_segment` is a soft
    preference: a full preferred segment sends the put to another one, it is not refused.

Hence puts prefer the writer's own segment (when it has one): whoever computed a block is
where the next turn of its conversation is routed (prefix affinity), and decode reads back the
blocks it stored. Engines that contribute no segment (a P/D prefill with
`kv_pool.prefill_segment_mib: 0`) write into the readers' segments instead.

Hence every client call runs on a small thread pool with a deadline (exists 1 s, put/get 5 s,
close 5 s); past it the call raises `PoolUnavailable` and its thread is left to finish (within
the client's own 30 s RPC timeout). While a call is overdue or health_check() says the master
is unreachable, calls fail at once. setup() runs in the background after a TCP probe of the
master, retried no sooner than `retry_after_s`; a client whose master has looked unreachable
that long while its port accepts connections is replaced (`reconnect`), buffers replayed.
A client is closed only once no call is running on it (that would segfault).

A disk tier (`PoolSettings.disk_dir`; measured the same way, docs/long-context.md): a client set
up with `enable_ssd_offload` and a folder of its own keeps the objects the master evicts from
its segment in files there (the master's `--enable_offload --offload_on_evict`), serves them
from disk on a read (over the same transfer engine) and gets them promoted back to memory on
the second read. Its settings are environment variables read at setup (`disk_tier.disk_env`): small
buckets and a 1 s heartbeat, since offload and promotion happen on the heartbeat. Puts into a
full segment return -200 until the next heartbeat has written evicted objects out. Objects on
disk survive a master restart: the client re-announces its files within a heartbeat or two.
Each client owns one folder (pid and a counter) and deletes it when closed.
Measured: with a nearly full tier Mooncake 0.3.13 demotes nothing ("[Evict] triggered", no
bucket freed), so DRAM stays full and every put is refused; and demotion is slow (one bucket per
heartbeat: puts into a full segment were refused for up to ~20 s while 24 MiB moved to disk). A
store with a disk tier therefore drops the oldest quarter of the objects it stored itself once
its puts have been refused for `stuck_s` (30 s, longer than a slow demotion's refusals;
`disk_tier.RoomMaker`): the tiers then take new objects again, oldest first out.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kv_transfer.pool.disk_tier import STUCK_S, RoomMaker, new_client_folder
from kv_transfer.pool.store import PoolSettings, PoolUnavailable

logger = logging.getLogger(__name__)

NO_AVAILABLE_HANDLE = -200  # put: the pool is full
OBJECT_ALREADY_EXISTS = -705  # put: the key is held (this client version answers 0 instead)
MIN_SEGMENT_BYTES = 16 << 20  # setup() refuses a smaller non-zero segment (-600)
_MASTER_UNREACHABLE = 2  # health_check(): 0 healthy, 1 closed, 2 master unreachable
def _own_segment_first(raw: Any) -> Any:
    """Put options that place objects in this client's own segment while it has room (g)."""
    return _put_options(raw.get_hostname(), 0.0)


def _put_options(segment: str | None, pin_s: float) -> Any:
    """A put's ReplicateConfig: this client's segment first (when it has one), and a soft pin of
    `pin_s` seconds (0: none). A pin keeps the object in DRAM while unpinned objects are evicted
    first, on a master started with allow_evict_soft_pinned_objects=false; it lasts `pin_s` from
    this put, renewed only by another upsert (reads do not renew it)."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    if segment:
        config.preferred_segment = segment
    if pin_s > 0:
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = max(1, int(pin_s * 1000))
    return config


def _rpc_failure(code: int) -> bool:
    return -999 <= code <= -900  # RPC_FAIL (-900), RPC timeout (-901), ...


@dataclass
class _Client:
    """One set-up client and the calls running on it (it may be closed only when none are)."""

    raw: Any
    segment_bytes: int
    registered: set[tuple[int, int]] = field(default_factory=set)
    put_config: Any = None  # ReplicateConfig preferring this client's own segment, once it has one
    inflight: int = 0
    retired: bool = False
    mount_tried: bool = False
    unreachable_since_s: float | None = None
    disk_dir: str = ""  # this client's own disk-tier folder, deleted when it is closed


class MooncakePoolStore:
    """A `PoolStore` on Mooncake Store. Thread-safe; never blocks a caller past its deadline."""

    def __init__(self, settings: PoolSettings, *, lookup_only: bool = False, exists_timeout_s: float = 1.0,
                 transfer_timeout_s: float = 5.0, close_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, stuck_s: float = STUCK_S):
        if 0 < settings.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"kv pool segment_bytes={settings.segment_bytes}: Mooncake needs 0 (contribute "
                             f"nothing) or at least {MIN_SEGMENT_BYTES} (16 MiB)")
        self.settings = settings
        self._segment_bytes = 0 if lookup_only else settings.segment_bytes
        self._exists_timeout_s = exists_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._close_timeout_s = close_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-pool")
        self._client: _Client | None = None
        self._connecting: cf.Future | None = None
        self._last_attempt_s: float | None = None
        self._buffers: list[tuple[int, int]] = []  # registered again on a replacement client
        self._overdue = 0  # calls past their deadline that are still running
        self._closed = False
        self._counts = {"timeouts_total": 0.0, "unavailable_total": 0.0, "reconnects_total": 0.0,
                        "dropped_for_room_total": 0.0}
        self._room = RoomMaker(stuck_s)  # disk tier: what this store put, and when to drop the oldest

    @property
    def has_disk_tier(self) -> bool:
        return bool(self.settings.disk_dir)

    # -- PoolStore ------------------------------------------------------------------------------

    def register_buffer(self, address: int, nbytes: int) -> None:
        """Recorded at once; registered with the client now if there is one, else at setup."""
        with self._lock:
            if (address, nbytes) not in self._buffers:
                self._buffers.append((address, nbytes))
            if self._client is None:
                return
        rc = self._call("register_buffer", self._transfer_timeout_s, lambda c: self._register(c, address, nbytes))
        if rc != 0:
            raise PoolUnavailable(f"Mooncake register_buffer({address:#x}, {nbytes}) returned {rc}")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._call("batch_is_exist", self._exists_timeout_s, lambda c: c.raw.batch_is_exist(list(keys)))
        self._check(codes, len(keys), "batch_is_exist", all_negative_is_failure=True)
        return [code == 1 for code in codes]

    def put_from(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
                 pin_s: float = 0.0, replace: bool = False) -> list[bool]:
        if not keys:
            return []
        what = "batch_upsert_from" if replace else "batch_put_from"

        def put(c: _Client) -> list[int]:
            if pin_s > 0:
                options = [_put_options(self._segment_name(c), pin_s)]
            else:
                options = [c.put_config] if c.put_config is not None else []
            return getattr(c.raw, what)(list(keys), list(addresses), list(sizes), *options)

        codes = self._call(what, self._transfer_timeout_s, put)
        self._check(codes, len(keys), what)
        ok = [code in (0, OBJECT_ALREADY_EXISTS) for code in codes]  # -200 (full) and others: refused
        if self.has_disk_tier:
            self._after_put(keys, ok, refused=NO_AVAILABLE_HANDLE in codes)
        return ok

    def _after_put(self, keys: Sequence[str], ok: Sequence[bool], refused: bool) -> None:
        """Drop the oldest objects this store put when the tiers have stopped making room."""
        now_s = self._clock()
        with self._lock:
            oldest = self._room.after_put(keys, ok, refused, now_s)
            self._counts["dropped_for_room_total"] += len(oldest)
        if oldest:
            logger.warning("kv pool: puts refused for %.0f s with a disk tier; dropping the %d oldest objects "
                           "this engine stored", self._room.stuck_s, len(oldest))
            self.remove(oldest)

    def get_into(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> list[int]:
        if not keys:
            return []
        codes = self._call("batch_get_into", self._transfer_timeout_s,
                           lambda c: c.raw.batch_get_into(list(keys), list(addresses), list(sizes)))
        self._check(codes, len(keys), "batch_get_into")
        return [int(code) for code in codes]

    def tiers_of(self, keys: Sequence[str]) -> list[str]:
        """Where each object is read from: "memory" (a copy in some DRAM segment), "disk" (only
        in a client's disk tier) or "missing". One master call; for the per-tier counters."""
        if not keys:
            return []

        def where(c: _Client) -> list[str]:
            replicas = c.raw.batch_get_replica_desc(list(keys))
            out = []
            for key in keys:
                found = replicas.get(key) or []
                if any(r.is_memory_replica() for r in found):
                    out.append("memory")
                elif any(r.is_local_disk_replica() or r.is_disk_replica() for r in found):
                    out.append("disk")
                else:
                    out.append("missing")
            return out

        return self._call("batch_get_replica_desc", self._exists_timeout_s, where)

    def remove(self, keys: Sequence[str]) -> None:  # force: a corrupt object goes even while leased
        if keys:
            self._call("batch_remove", self._transfer_timeout_s, lambda c: c.raw.batch_remove(list(keys), True))

    @staticmethod
    def _segment_name(client: _Client) -> str | None:
        return client.put_config.preferred_segment if client.put_config is not None else None

    def own_segment(self) -> str | None:
        """The name of this client's segment, or None while it contributes none."""
        with self._lock:
            client = self._client
        return client.put_config.preferred_segment if client is not None and client.put_config else None

    def segments_of(self, keys: Sequence[str]) -> list[str | None]:
        """The segment holding each object (None: missing), for diagnostics and tests."""
        def where(c: _Client) -> list[str | None]:
            out = []
            for key in keys:
                replicas = [r for r in c.raw.get_replica_desc(key) if r.is_memory_replica()]
                out.append(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                           if replicas else None)
            return out

        return self._call("get_replica_desc", self._transfer_timeout_s, where)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._counts)
            client = self._client
            out["segment_bytes"] = float(client.segment_bytes if client else 0)
            out["connected"] = float(client is not None and client.raw.health_check() == 0)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            done = self._retire(client)
            if done is not None:
                done.wait(self._close_timeout_s)  # past it, the close finishes in the background
        self._pool.shutdown(wait=False)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def connect(self, wait_s: float) -> bool:
        """Start setting up (unless one failed under retry_after_s ago); wait up to `wait_s` for
        it. Calls do this themselves within their deadline; this is for a warm-up."""
        future = self._start_connect()
        if future is None:
            return False
        try:
            future.result(wait_s)
            return True
        except Exception:  # noqa: BLE001 - failures are logged by the setup thread
            return False

    def want_segment(self) -> None:
        """Contribute `settings.segment_bytes` (a lookup-only client mounts it on its next call)."""
        with self._lock:
            self._segment_bytes = self.settings.segment_bytes

    def reconnect(self) -> None:
        """Replace the client with a new one (set up in the background; buffers registered again)."""
        with self._lock:
            client, self._client = self._client, None
            self._last_attempt_s = None
            self._counts["reconnects_total"] += 1
        if client is not None:
            self._retire(client)
        self._start_connect()

    # -- calls ----------------------------------------------------------------------------------

    def _call(self, what: str, timeout_s: float, fn: Callable[[_Client], Any]) -> Any:
        deadline_s = self._clock() + timeout_s
        client = self._acquire(what, deadline_s)
        try:
            future = self._pool.submit(fn, client)
        except RuntimeError:  # closed since _acquire
            self._release(client)
            self._unavailable("the Mooncake pool client is closed")
        future.add_done_callback(lambda _: self._release(client))
        try:
            return future.result(max(0.0, deadline_s - self._clock()))
        except cf.TimeoutError:
            with self._lock:
                self._counts["timeouts_total"] += 1
                self._overdue += 1
            future.add_done_callback(lambda _: self._finish_overdue())
            self._unavailable(f"Mooncake {what} took over {timeout_s:g} s")

    def _acquire(self, what: str, deadline_s: float) -> _Client:
        """The client a call may run on now (its in-flight count taken), or PoolUnavailable."""
        master = self.settings.master_address
        while True:
            with self._lock:
                if self._closed:
                    self._unavailable("the Mooncake pool client is closed", locked=True)
                if self._overdue:
                    self._unavailable(f"a Mooncake call is overdue; {what} skipped", locked=True)
                client = self._client
                if client is not None and self._reachable(client):
                    client.inflight += 1
                    if client.segment_bytes < self._segment_bytes and not client.mount_tried:
                        client.mount_tried = True
                        client.inflight += 1
                        self._pool.submit(self._mount, client, self._segment_bytes)
                    return client
            if client is not None:
                self._unavailable(f"Mooncake master {master} unreachable")
            connecting = self._start_connect()
            if connecting is None:
                self._unavailable(f"not connected to Mooncake master {master} (retrying later)")
            try:
                connecting.result(max(0.0, deadline_s - self._clock()))
            except cf.TimeoutError:
                self._unavailable(f"still connecting to Mooncake master {master}")
            except PoolUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed setup of any kind means "unavailable"
                self._unavailable(f"connecting to Mooncake master {master} failed: {exc}")

    def _reachable(self, client: _Client) -> bool:
        """False while the client's ping thread finds the master unreachable (called locked).
        Unreachable for `retry_after_s` while the master's port answers: replace the client."""
        if client.raw.health_check() != _MASTER_UNREACHABLE:
            client.unreachable_since_s = None
            return True
        now_s = self._clock()
        if client.unreachable_since_s is None:
            client.unreachable_since_s = now_s
        elif now_s - client.unreachable_since_s >= self.settings.retry_after_s:
            client.unreachable_since_s = now_s  # checked once per retry_after_s
            threading.Thread(target=self._replace_if_master_up, args=(client,), daemon=True).start()
        return False

    def _replace_if_master_up(self, client: _Client) -> None:
        if self._master_port_open() and self._client is client:
            logger.warning("Mooncake client still finds master %s unreachable while it accepts "
                           "connections; re-creating the client", self.settings.master_address)
            self.reconnect()

    def _release(self, client: _Client) -> None:
        with self._lock:
            client.inflight -= 1
            close_now = client.retired and client.inflight == 0
        if close_now:
            threading.Thread(target=self._close_raw, args=(client,), daemon=True).start()

    def _finish_overdue(self) -> None:
        with self._lock:
            self._overdue -= 1

    def _register(self, client: _Client, address: int, nbytes: int) -> int:
        with self._lock:
            if (address, nbytes) in client.registered:
                return 0
            client.registered.add((address, nbytes))
        rc = client.raw.register_buffer(address, nbytes)
        if rc != 0:
            with self._lock:
                client.registered.discard((address, nbytes))
        return rc

    def _mount(self, client: _Client, segment_bytes: int) -> None:
        try:
            result = client.raw.allocate_and_mount_segment(segment_bytes, self.settings.protocol)
            if result.get("ret") == 0:
                client.segment_bytes = segment_bytes
                client.put_config = _own_segment_first(client.raw)
            else:
                logger.warning("Mooncake allocate_and_mount_segment(%d) failed: %s", segment_bytes, result)
        except Exception:  # noqa: BLE001 - the client still serves lookups without a segment
            logger.warning("Mooncake allocate_and_mount_segment(%d) failed", segment_bytes, exc_info=True)
        finally:
            self._release(client)

    # -- setup and close --------------------------------------------------------------------------

    def _start_connect(self) -> cf.Future | None:
        """The setup under way (or done), or None when the last one failed under retry_after_s ago."""
        with self._lock:
            if self._closed:
                return None
            if self._client is not None:
                done: cf.Future = cf.Future()
                done.set_result(self._client)
                return done
            if self._connecting is not None:
                return self._connecting
            now_s = self._clock()
            if self._last_attempt_s is not None and now_s - self._last_attempt_s < self.settings.retry_after_s:
                return None
            self._last_attempt_s = now_s
            self._connecting = future = cf.Future()
        # Its own thread: setup() can block for ~90 s and must not hold a pool worker.
        threading.Thread(target=self._connect, args=(future,), daemon=True, name="mooncake-setup").start()
        return future

    def _connect(self, future: cf.Future) -> None:
        try:
            client = self._setup()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting callers
            with self._lock:
                self._connecting = None
            logger.warning("Mooncake pool unavailable: %s", exc)
            future.set_exception(exc)
            return
        with self._lock:
            self._connecting = None
            closed = self._closed
            if not closed:
                self._client = client
                client.inflight += 1  # held while buffers recorded during setup are registered
            late = list(self._buffers)
        if closed:
            self._retire(client)
            future.set_exception(PoolUnavailable("the Mooncake pool client is closed"))
            return
        for address, nbytes in late:
            if self._register(client, address, nbytes) != 0:
                logger.warning("Mooncake register_buffer(%#x, %d) failed on a new client", address, nbytes)
        self._release(client)
        future.set_result(client)

    def _setup(self) -> _Client:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise PoolUnavailable("the KV pool needs Mooncake Store: pip install "
                                  "mooncake-transfer-engine-cuda13 (-non-cuda on CPU machines)") from exc
        s = self.settings
        if not self._master_port_open():  # setup() against no master blocks ~90 s
            raise PoolUnavailable(f"Mooncake master {s.master_address} does not accept connections")
        with self._lock:
            segment_bytes = self._segment_bytes
            buffers = list(self._buffers)
        raw = MooncakeDistributedStore()
        disk_dir = self._new_disk_folder()
        rc = raw.setup(s.local_hostname, s.metadata_url, segment_bytes, s.local_buffer_bytes, s.protocol,
                       s.device_name, s.master_address, None, bool(disk_dir), disk_dir)
        if rc != 0:
            if disk_dir:
                shutil.rmtree(disk_dir, ignore_errors=True)
            hint = " (a disk tier needs a master started with it: moe-serve down, then deploy)" if disk_dir else ""
            raise PoolUnavailable(f"Mooncake setup against {s.master_address} returned {rc}{hint}")
        client = _Client(raw, segment_bytes, put_config=_own_segment_first(raw) if segment_bytes else None,
                         disk_dir=disk_dir)
        for address, nbytes in buffers:
            rc = self._register(client, address, nbytes)
            if rc != 0:
                self._retire(client)
                raise PoolUnavailable(f"Mooncake register_buffer({address:#x}, {nbytes}) returned {rc}")
        return client

    def _new_disk_folder(self) -> str:
        """The next client's own disk-tier folder ("" without a disk tier)."""
        return new_client_folder(self.settings.disk_dir, self.settings.disk_bytes) if self.settings.disk_dir else ""

    def _retire(self, client: _Client) -> threading.Event | None:
        """Close the client once no call runs on it (Event: set when closed, None: closed later)."""
        with self._lock:
            client.retired = True
            if client.inflight:
                return None
        done = threading.Event()
        threading.Thread(target=self._close_raw, args=(client, done), daemon=True, name="mooncake-close").start()
        return done

    @staticmethod
    def _close_raw(client: _Client, done: threading.Event | None = None) -> None:
        try:
            client.raw.close()  # 2 s; 15 s with the master gone
        except Exception:  # noqa: BLE001 - leaving the pool is best effort
            logger.warning("closing a Mooncake client failed", exc_info=True)
        if client.disk_dir:
            shutil.rmtree(client.disk_dir, ignore_errors=True)
        if done is not None:
            done.set()

    def _master_port_open(self, timeout_s: float = 0.5) -> bool:
        host, _, port = self.settings.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout_s).close()
            return True
        except (OSError, ValueError):
            return False

    def _check(self, codes: Sequence[int], expected: int, what: str, all_negative_is_failure: bool = False) -> None:
        if len(codes) != expected:
            self._unavailable(f"Mooncake {what} answered {len(codes)} results for {expected} keys")
        if any(_rpc_failure(code) for code in codes) or (all_negative_is_failure and all(c < 0 for c in codes)):
            self._unavailable(f"Mooncake {what} failed: codes {sorted(set(int(c) for c in codes))}")

    def _unavailable(self, message: str, locked: bool = False) -> None:
        if locked:
            self._counts["unavailable_total"] += 1
        else:
            with self._lock:
                self._counts["unavailable_total"] += 1
        raise PoolUnavailable(message)
