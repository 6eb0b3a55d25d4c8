"""An in-memory pool store with the real PoolStore interface (unit tests of our pool logic)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

from kv_transfer.pool.store import PoolUnavailable


class FakePoolStore:
    """Objects in a dict; `down` makes every call raise PoolUnavailable, `capacity` refuses
    puts beyond that many objects. Addresses are real memory (read/written with ctypes)."""

    def __init__(self, capacity: int | None = None, disk_tier: bool = False):
        self.objects: dict[str, bytes] = {}
        self.has_disk_tier = disk_tier
        self.on_disk: set[str] = set()
        self.pins: dict[str, float] = {}  # key -> the pin_s of the put or upsert that last pinned it
        self.upserts: list[str] = []
        self.capacity = capacity
        self.down = False
        self.calls: list[str] = []
        self.registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if self.down:
            raise PoolUnavailable("fake pool is down")

    def connect(self, wait_s: float) -> bool:
        return not self.down

    def register_buffer(self, address: int, nbytes: int) -> None:
        self._check("register_buffer")
        self.registered.append((address, nbytes))

    def exists(self, keys):
        self._check("exists")
        with self._lock:
            return [key in self.objects for key in keys]

    def put_from(self, keys, addresses, sizes, pin_s: float = 0.0, replace: bool = False):
        self._check("upsert_from" if replace else "put_from")
        out = []
        with self._lock:
            for key, address, size in zip(keys, addresses, sizes):
                if key not in self.objects and self.capacity is not None and len(self.objects) >= self.capacity:
                    out.append(False)
                    continue
                if replace:
                    self.objects[key] = ctypes.string_at(address, size)
                    self.upserts.append(key)
                    self.on_disk.discard(key)
                elif key in self.objects:
                    out.append(True)  # immutable: held, unchanged (and its pin with it)
                    continue
                else:
                    self.objects[key] = ctypes.string_at(address, size)
                if pin_s > 0:
                    self.pins[key] = pin_s
                out.append(True)
        return out

    def get_into(self, keys, addresses, sizes):
        self._check("get_into")
        out = []
        with self._lock:
            for key, address, size in zip(keys, addresses, sizes):
                data = self.objects.get(key)
                if data is None or len(data) > size:
                    out.append(-1)
                    continue
                ctypes.memmove(address, data, len(data))
                out.append(len(data))
        return out

    def tiers_of(self, keys):
        """Only on a store with a disk tier (`on_disk`: keys demoted there)."""
        self._check("tiers_of")
        with self._lock:
            return ["disk" if key in self.on_disk else "memory" if key in self.objects else "missing" for key in keys]

    def remove(self, keys):
        self._check("remove")
        with self._lock:
            for key in keys:
                self.objects.pop(key, None)

    def stats(self):
        return {"objects": len(self.objects)}

    def close(self) -> None:
        pass


@dataclass
class PoolRequest:
    """The attributes of vLLM's Request that the pool tier reads."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def chained_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Stand-in for vLLM's chained block hashes (full blocks only)."""
    import hashlib

    out, parent = [], b"root"
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(token_ids[start:start + block_size]).encode()).digest()
        out.append(parent)
    return out
