"""The KV pool's disk tier on Mooncake Store: its client settings, each client's folder, and the
rule for making room when Mooncake stops doing it (`kv_transfer/pool/mooncake_store.py` uses them;
docs/long-context.md has the measurements behind each)."""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from typing import Sequence

STUCK_S = 30.0  # puts refused this long: the tiers are not making room by themselves
REMEMBERED_KEYS = 1 << 20  # keys remembered in put order (to drop the oldest)
_FOLDERS = itertools.count()


def disk_env(disk_bytes: int) -> dict[str, str]:
    """Mooncake's disk-tier settings (environment variables read at setup; 0.3.13). The bucket
    backend writes objects in buckets of at most 16 keys or 8 MiB (nothing is written before a
    bucket fills; at most an eighth of the tier, so that it evicts whole buckets and never stops
    at one), drops the oldest buckets (fifo) past `disk_bytes`, and is rescanned after a master
    restart; the per-client read buffer is 32 MiB instead of 1.25 GB; offload and promotion
    run on a 1 s heartbeat."""
    return {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
            "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "16",
            "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(max(min(8 << 20, disk_bytes // 8), 1 << 20)),
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(disk_bytes),
            "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "fifo",
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(2 * disk_bytes),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
            "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(32 << 20)}


def new_client_folder(disk_dir: str, disk_bytes: int) -> str:
    """A folder only the next client writes to, with the settings it reads at setup applied: a
    retired client's files are deleted with its folder, never rescanned by its successor."""
    os.environ.update(disk_env(disk_bytes))
    folder = os.path.realpath(os.path.join(disk_dir, f"{os.getpid()}-{next(_FOLDERS)}"))
    os.makedirs(folder, exist_ok=True)
    return folder


class RoomMaker:
    """What a store with a disk tier put, oldest first, and when to drop the oldest: once its puts
    have been refused for `stuck_s`, the oldest quarter (at least the refused batch's size).
    Not thread-safe (the store calls it under its lock); times come in, keys go out."""

    def __init__(self, stuck_s: float = STUCK_S, remembered: int = REMEMBERED_KEYS):
        self.stuck_s = stuck_s
        self._remembered = remembered
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._refused_since_s: float | None = None

    def after_put(self, keys: Sequence[str], ok: Sequence[bool], refused: bool, now_s: float) -> list[str]:
        """Record a put's outcome; the keys to remove now (empty unless the tiers are stuck)."""
        for key, stored in zip(keys, ok):
            if stored:
                self._stored[key] = None
                self._stored.move_to_end(key)
        while len(self._stored) > self._remembered:
            self._stored.popitem(last=False)
        if not refused:
            self._refused_since_s = None
            return []
        if self._refused_since_s is None:
            self._refused_since_s = now_s
            return []
        if now_s - self._refused_since_s < self.stuck_s:
            return []
        self._refused_since_s = None
        count = min(max(len(keys), len(self._stored) // 4), len(self._stored))
        return [self._stored.popitem(last=False)[0] for _ in range(count)]
