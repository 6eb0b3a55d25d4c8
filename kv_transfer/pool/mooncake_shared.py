"""One Mooncake pool client per process and pool (the scheduler and worker of an engine share it
when vLLM runs them in one process)."""

from __future__ import annotations

import os
import threading

from kv_transfer.pool.mooncake_store import MooncakePoolStore
from kv_transfer.pool.store import PoolSettings

_SHARED: dict[tuple[str, str], MooncakePoolStore] = {}
_SHARED_PID = os.getpid()
_SHARED_LOCK = threading.Lock()


def shared_store(settings: PoolSettings, lookup_only: bool = False) -> MooncakePoolStore:
    """The process's client for (master_address, key_prefix), created on first use.

    vLLM on CPU runs scheduler and worker in one process, on GPU often not: both ask here, and
    a process holds one client (one segment). `lookup_only` (the scheduler) contributes no
    segment; a later caller without it (the worker) makes the shared client mount one.
    Clients of a parent process are not reused after fork (their threads did not survive).
    """
    global _SHARED_PID
    key = (settings.master_address, settings.key_prefix)
    with _SHARED_LOCK:
        if _SHARED_PID != os.getpid():
            _SHARED.clear()
            _SHARED_PID = os.getpid()
        store = _SHARED.get(key)
        if store is None or store.closed:
            store = _SHARED[key] = MooncakePoolStore(settings, lookup_only=lookup_only)
        elif not lookup_only:
            store.want_segment()
        return store
