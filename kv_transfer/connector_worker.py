"""Worker side of our connector (runs in the vLLM worker process, which owns the KV tensors).

Every engine serves its blocks (prefill role) and pulls blocks (decode role):
- serve: a transport server hands out pages of leased blocks; a RELEASE from decode, or the
  lease's deadline, frees them (reported to vLLM as finished_sending);
- pull: each PullJob runs on a small thread pool so engine steps never wait on the network;
  success or failure is reported to vLLM on its next step (finished_recving / failed_recving);
- pool (when configured): a PullJob's pool blocks are read from the KV pool before the lease's
  blocks are pulled; store jobs run on their own thread, and a finished request's blocks are
  reported free (finished_sending) only when both its lease and its store are done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import OrderedDict
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_transfer.connector_scheduler import LeaseGrant, PullJob, StepPlan
from kv_transfer.counters import TransferCounters
from kv_transfer.errors import KVTransferError
from kv_transfer.leases import LeaseTable
from kv_transfer.params import LoadTiming
from kv_transfer.peer_health import PeerDown, PeerHealth, guarded
from kv_transfer.pool.store import PoolSettings
from kv_transfer.pool.store_queue import StoreQueue
from kv_transfer.releaser import BackgroundReleaser
from kv_transfer.settings import ConnectorSettings
from kv_transfer.transport import get_backend

logger = logging.getLogger(__name__)

_REMEMBER_DONE = 10_000  # ids of released/expired leases kept to recognise duplicate releases
# How long a read waits for its lease to reach this worker (one engine step after the prefill
# finished, usually milliseconds; a busy CPU engine's step can take a second).
LEASE_WAIT_S = 3.0


class InjectedFailure(KVTransferError):
    """A failure requested by the test hook in TransferParams (inject_failure)."""


class LeaseExpired(KVTransferError):
    """The prefill's lease deadline passed before decode could pull."""


class _ReadGuard:
    """What the transport server asks before serving a read (the LeaseTable interface it uses).

    A read may legitimately arrive before this worker hears of the lease: the grant comes with
    the prefill engine's next step, milliseconds after decode got the transfer parameters. The
    read then waits for the lease, at most `LEASE_WAIT_S`; an id this worker never leases is
    refused when that wait ends, and one whose lease ended (released or expired) at once, since
    those blocks may already hold another request's KV. No lease, no read.
    """

    def __init__(self, worker: "WorkerSide", max_waiting: int = 8):
        self._worker = worker
        # Reads waiting for a lease at once: a connection in that wait is busy, not idle, so the
        # server cannot close it to make room. Reads for ids nobody leased (a client with no
        # grant) could otherwise hold every connection; past the bound they are refused at once.
        self._waiting = threading.BoundedSemaphore(max_waiting)

    @contextlib.contextmanager
    def sending(self, request_id: str):
        """Around the server's send of a request's pages: a lease that ends meanwhile (released
        or expired) keeps its blocks until the send is done, so no page is reused mid-send."""
        worker = self._worker
        with worker._lock:
            worker._sends_in_flight[request_id] = worker._sends_in_flight.get(request_id, 0) + 1
        try:
            yield
        finally:
            with worker._lock:
                left = worker._sends_in_flight.pop(request_id) - 1
                if left:
                    worker._sends_in_flight[request_id] = left

    def get(self, request_id: str):
        worker = self._worker
        with worker._lock:
            lease = worker._leases.get(request_id)
            if lease is not None or request_id in worker._recently_done:
                return lease
        if not self._waiting.acquire(blocking=False):
            return None
        try:
            deadline_s = time.monotonic() + LEASE_WAIT_S
            with worker._lease_known:
                while True:
                    lease = worker._leases.get(request_id)
                    if lease is not None or request_id in worker._recently_done:
                        return lease
                    left_s = deadline_s - time.monotonic()
                    if left_s <= 0:
                        return None
                    worker._lease_known.wait(left_s)
        finally:
            self._waiting.release()


class TensorParallelMismatch(KVTransferError):
    """The prefill engine's tensor-parallel size is not this engine's: rank r's shard of a
    block (its KV heads) is not what decode's rank r holds."""


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, pool=None, tp_rank: int = 0):
        """`pool`: a PoolWorker when the engine uses a KV pool; `tp_rank`: this worker's
        tensor-parallel rank. Each rank serves its own shard of every block on its own port
        (`settings.rank_port`), pulls from the prefill rank of the same number, and releases
        there: the engine's ranks together cover every shard and every rank's lease."""
        self._settings = settings
        self._tp_rank = tp_rank
        self._port = settings.rank_port(tp_rank)
        self._pool = pool
        pool_settings = PoolSettings.from_dict(settings.pool) or PoolSettings()
        # Bounded, and shed under pressure (pool/store_queue.py): a slow pool must not hold the engine's KV.
        self._stores = (StoreQueue(self._store, lambda job: self._store(job, shed=True),
                                   pool_settings.max_pending_stores, pool_settings.max_store_wait_s)
                        if pool is not None else None)
        self._stores_pending: set[str] = set()
        self._sends_in_flight: dict[str, int] = {}  # request id -> pages being sent now (server threads)
        self._backend = get_backend(settings.backend)
        self._leases = LeaseTable()
        self._counters = TransferCounters()
        self._lock = threading.Lock()
        self._lease_known = threading.Condition(self._lock)  # notified when a lease is granted
        # RELEASE can arrive before this worker hears of the lease (decode is fast; the grant
        # comes with the prefill engine's next step), or twice; remember both kinds briefly.
        self._released_early: dict[str, float] = {}
        self._recently_done: OrderedDict[str, None] = OrderedDict()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_times: dict[str, LoadTiming] = {}  # finished loads, until the next step reports them
        self._pulls = ThreadPoolExecutor(settings.max_concurrent_pulls, thread_name_prefix="kv-pull")
        self._client = self._backend.client_cls(
            **self._backend.client_options(settings.protocol, settings.device_name, settings.host))
        # A peer found unreachable fails pulls and releases at once for a while (peer_health.py), and
        # releases have threads of their own (two: one may wait out a dead peer's first timeout):
        # a dead prefill node costs one timeout, and pulls from healthy ones never queue behind it.
        self._peers = PeerHealth(probe_s=settings.transfer_timeout_s)
        self._releaser = BackgroundReleaser(
            settings.transfer_timeout_s, client=self._client, peers=self._peers, threads=2,
            on_failure=lambda exc: self._counters.release_failed(skipped=isinstance(exc, PeerDown)))
        self._server = None
        self._pages = None
        self._block_bytes = 0  # one block of every layer of this worker's cache (set by register)

    # -- set-up ---------------------------------------------------------------------------------

    def register(self, pages) -> None:
        """`pages`: kv_pages.KVPages over the engine's caches (or a test's equivalent)."""
        self._block_bytes = pages.num_layers * pages.page_bytes
        if self._pool is not None:
            self._pool.attach(pages)  # the pool always copies through host staging
        # P/D pages: host-staged copies (any device). A backend that registers memory with its
        # engine (mooncake) moves a host cache's dense blocks in place, and any other cache (on a
        # GPU, or strided) through one staging arena registered once.
        if self._backend.moves_engine_memory:
            self._pages = (pages.host_memory() if pages.in_place()
                           else pages.registered_staging(self._settings.staging_bytes))
        else:
            self._pages = pages
        self._client.register_sink(self._pages)  # backends that register memory do it once, here
        self._server = self._backend.server_cls(self._settings.host, self._port, source=self._pages,
                                            on_release=self._on_release, on_stats=self.stats,
                                            leases=_ReadGuard(self),
                                            # Only an engine that lends KV answers reads and releases.
                                            grant_key=self._settings.engine_grants() if self._settings.lends_kv else None,
                                            max_connections=self._settings.max_connections,
                                            min_bytes_per_s=self._settings.min_transfer_bytes_per_s,
                                            **self._backend.server_options(self._settings.transfer_timeout_s,
                                                                           self._settings.protocol,
                                                                           self._settings.device_name))
        self._server.start()
        logger.info("kv transfer: serving %d layers x %d blocks (%d B pages; %s) on %s:%s via %s (TP rank %d of %d)",
                    pages.num_layers, pages.num_blocks, pages.page_bytes,
                    pages.describe() if hasattr(pages, "describe") else "", self._settings.host,
                    self._port, self._settings.backend, self._tp_rank, self._settings.tp_size)

    # -- per step ---------------------------------------------------------------------------------

    def apply(self, plan: StepPlan) -> None:
        now_s = time.monotonic()
        for grant in plan.grants:
            self._grant(grant, now_s)
        if self._pool is not None:
            self._pool.add_lookups(plan.pool_lookups)
        for store in plan.pool_stores:
            with self._lock:
                self._stores_pending.add(store.request_id)
            self._stores.submit(store)  # or, with too many pending, shed now: self._store(store, shed=True)
        for job in plan.pulls:
            self._pulls.submit(self._pull, job)
        for params in plan.releases:
            self._release_remote(params)  # on the releaser's threads, never behind pulls

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        now_s = time.monotonic()
        with self._lock:  # early releases whose grant never came (request was not leased)
            for request_id, at_s in list(self._released_early.items()):
                if now_s - at_s > 2 * self._settings.lease_s:
                    del self._released_early[request_id]
            # Under self._lock so that a RELEASE racing the expiry finds the id already done.
            expired = self._leases.expire(now_s)
            for lease in expired:
                self._finished_sending.add(lease.request_id)
                self._remember_done(lease.request_id)
        for lease in expired:
            self._counters.lease_expired()
            logger.warning("kv transfer: lease of %s expired unreleased; freeing %d blocks",
                           lease.request_id, len(lease.block_ids))
        with self._lock:
            # A lease that ended while the request's blocks are still being stored or sent: keep
            # the blocks until that is done (reported on a later call).
            sending = self._finished_sending - self._stores_pending - self._sends_in_flight.keys()
            out = (sending, self._finished_recving, self._failed_recving)
            self._finished_sending -= sending
            self._finished_recving, self._failed_recving = set(), set()
        return out

    def take_load_times(self) -> dict[str, LoadTiming]:
        """How long each load finished since the last call took (for the scheduler side)."""
        with self._lock:
            out, self._load_times = self._load_times, {}
        return out

    def stats(self) -> dict[str, Any]:
        pool = self._pool.snapshot() if self._pool is not None else {}
        server = self._server.counters() if hasattr(self._server, "counters") else {}
        return {**self._counters.snapshot(), "leases_outstanding": self._leases.outstanding(),
                "leased_blocks": self._leases.outstanding_blocks(), **server, **pool}

    def shutdown(self) -> None:
        if self._stores is not None:
            self._stores.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.stop()
        self._pulls.shutdown(wait=False, cancel_futures=True)
        self._releaser.shutdown()
        self._client.close()

    # -- internals --------------------------------------------------------------------------------

    def _grant(self, grant: LeaseGrant, now_s: float) -> None:
        self._counters.lease_granted(len(grant.block_ids))
        # The check for an early release and the grant happen under one lock (as does
        # _on_release's lookup and record): otherwise a RELEASE landing between them is
        # recorded as early while the lease is granted anyway, pinning the blocks until expiry.
        with self._lock:
            early = self._released_early.pop(grant.request_id, None) is not None
            if early:  # decode already pulled and released: free at once
                self._finished_sending.add(grant.request_id)
                self._remember_done(grant.request_id)
            else:
                self._leases.grant(grant.request_id, grant.block_ids, now_s, grant.lease_s)
                self._lease_known.notify_all()  # reads waiting for this lease
        if early:
            self._counters.lease_released()

    def _on_release(self, request_id: str) -> None:
        """Transport server thread: decode is done with (or gave up on) these blocks."""
        with self._lock:
            lease = self._leases.release(request_id)
            if lease is not None:
                self._finished_sending.add(request_id)
                self._remember_done(request_id)
            elif request_id not in self._recently_done:
                self._released_early[request_id] = time.monotonic()
        if lease is not None:
            self._counters.lease_released()

    def _remember_done(self, request_id: str) -> None:
        self._recently_done[request_id] = None
        while len(self._recently_done) > _REMEMBER_DONE:
            self._recently_done.popitem(last=False)

    def _store(self, job, shed: bool = False) -> None:
        """Store thread: write a finished request's blocks to the pool, then let them go.
        `shed`: the store queue dropped the job (too many pending, or waited too long): only let
        them go (from the engine's thread when the queue was full)."""
        try:
            if shed:
                self._pool.shed(job.blocks)
            else:
                self._pool.store(job.blocks, session=job.session, history_blocks=job.history_blocks)
        except Exception as exc:  # never lose the blocks' release over a pool bug
            logger.warning("kv pool: store for %s failed: %s", job.request_id, exc)
        finally:
            with self._lock:
                self._stores_pending.discard(job.request_id)
                if job.holds_blocks:
                    self._finished_sending.add(job.request_id)

    def _pull(self, job: PullJob) -> None:
        started = time.monotonic()
        loaded = None
        if job.pool_blocks:
            try:
                loaded = self._pool.load(job.pool_blocks)
            except Exception as exc:  # missing, corrupt, pool down: vLLM recomputes (or fails) the request
                logger.warning("kv pool: load of %d blocks for %s failed (%s: %s); policy %s",
                               len(job.pool_blocks), job.request_id, type(exc).__name__, exc,
                               self._settings.failure_policy)
                with self._lock:
                    # Tells the scheduler side to store the recomputed blocks at the end.
                    self._load_times[job.request_id] = LoadTiming(time.monotonic() - started, 0, pool_failed=True)
                    self._finished_recving.add(job.request_id)
                    self._failed_recving.add(job.request_id)
                if job.params is not None:
                    self._release_remote(job.params)
                return
        pool = LoadTiming(time.monotonic() - started, len(job.pool_blocks),
                          pool_disk_s=loaded.disk_s if loaded else 0.0,
                          pool_disk_blocks=loaded.disk_blocks if loaded else 0)
        if job.params is None:
            with self._lock:
                self._load_times[job.request_id] = pool
                self._finished_recving.add(job.request_id)
            return
        if not job.local_block_ids:  # the pool held everything the lease did
            with self._lock:
                self._load_times[job.request_id] = pool
                self._finished_recving.add(job.request_id)
            self._release_remote(job.params)
            return
        self._pull_remote(job, pool)

    def _pull_remote(self, job: PullJob, pool: LoadTiming = LoadTiming()) -> None:
        params = job.params
        self._counters.pull_started(len(job.local_block_ids))
        started = time.monotonic()
        try:
            if params.inject_failure:
                raise InjectedFailure("injected transfer failure (test hook)")
            if params.remote_tp_size != self._settings.tp_size:  # the manifest refuses this; a record may not
                raise TensorParallelMismatch(f"prefill engine has {params.remote_tp_size} tensor-parallel ranks, "
                                             f"this engine {self._settings.tp_size}")
            port = params.rank_port(self._tp_rank)
            budget_s = self._settings.transfer_budget_s(len(job.local_block_ids) * self._block_bytes)
            if params.ends_within(budget_s, time.monotonic(), time.time()):
                # A pull that could still be running at the deadline would be refused (the prefill
                # checks its own clock) or fail mid-way: never start one. Decided on this node's
                # monotonic clock from the lease time the prefill sent (kv_transfer/params.py).
                raise LeaseExpired(f"lease of {params.remote_request_id} ends before a pull could finish")
            # The blocks reach the cache (and the device, fenced) only if the whole fetch succeeded.
            with self._pages.receiving(list(job.local_block_ids)) as dest, \
                    guarded(self._peers, params.remote_host, port):  # PeerDown at once while it is down
                result = self._client.fetch(params.remote_host, port, params.remote_request_id,
                                            list(job.remote_block_ids), dest, budget_s,
                                            params.grant_bytes())
            self._counters.pull_succeeded(len(job.local_block_ids), result.bytes, time.monotonic() - started)
            failed = False
        except Exception as exc:  # network, timeout, remote error, injected: the policy decides
            failed = True
            self._counters.pull_failed(fallback=self._settings.failure_policy == "recompute",
                                       skipped=isinstance(exc, PeerDown))
            logger.warning("kv transfer: pull for %s failed (%s: %s); policy %s", job.request_id,
                           type(exc).__name__, exc, self._settings.failure_policy)
        with self._lock:
            self._load_times[job.request_id] = dataclasses.replace(
                pool, pull_s=time.monotonic() - started, pull_blocks=len(job.local_block_ids), pull_failed=failed)
            self._finished_recving.add(job.request_id)
            if failed:
                self._failed_recving.add(job.request_id)
        self._release_remote(params)

    def _release_remote(self, params) -> None:
        """Queue the lease's release on the prefill rank of this worker's number (returns at
        once; the engine's other ranks release theirs); a failed one is counted in
        releases_failed_total, and the prefill side's lease expiry frees the blocks anyway."""
        ranks = [self._tp_rank] if params.remote_tp_size == self._settings.tp_size else None  # None: all
        self._releaser.submit(params, ranks)
