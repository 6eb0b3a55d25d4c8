"""Which of a session's pool objects to pin in DRAM, and when to renew a pin. Pure policy.

A request that belongs to a session (`X-Session-Id`, with `kv_pool.sessions` in the manifest)
stores its blocks with a soft pin of `pin_s` seconds, the session's idle window: while the pin
lasts the master evicts (demotes to disk) unpinned objects first, so an active session's
history stays in the fastest tier and idle ones move down. Measured on Mooncake 0.3.13
(docs/long-context.md): a pin lasts `pin_s` from its put; reads and puts of a held key do not
renew it, an upsert does. So at the end of each of a session's turns the blocks it reused get
their pins renewed by an upsert of the bytes the engine holds anyway, but only when the pin
this engine knows of has less than half its time left (or it knows of none): a conversation
with turns every few seconds rewrites its history about once per `pin_s / 2`, not every turn.

Bounds: the pins one engine holds live never exceed `budget_bytes` (a share of the segment
it contributes), so pinned objects can never fill DRAM and leave the master nothing to evict;
past the budget a block is stored unpinned. The ledger knows only the pins this engine set;
pins set by another engine (prefill's, another replica's) count as unknown and are renewed
once here, after which this engine knows them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PinPlan:
    """For one chunk of a session's store: which new objects to put pinned (the rest unpinned),
    and which held objects to renew (upsert pinned)."""

    pin_new: tuple[bool, ...]
    renew: tuple[bool, ...]


class SessionPins:
    """The pins this engine set, oldest expiry first. Not thread-safe: one store thread uses it."""

    def __init__(self, pin_s: float, budget_bytes: int):
        if not pin_s > 0:
            raise ValueError(f"a session pin must last more than 0 s, got {pin_s}")
        self.pin_s = pin_s
        self.budget_bytes = max(0, budget_bytes)
        self._expiry: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (pin ends at, bytes)
        self._live_bytes = 0

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    def plan(self, new_keys: Sequence[str], held_keys: Sequence[str], object_bytes: int, now_s: float) -> PinPlan:
        """New objects are pinned while the budget has room; held objects are renewed when the
        pin this engine knows of ends within half the window (or it knows none), budget allowing.
        Renewals come first: they keep a live session's history, which is what pins are for."""
        self._expire(now_s)
        room = self.budget_bytes - self._live_bytes
        renew = []
        for key in held_keys:
            known = self._expiry.get(key)
            due = known is None or known[0] - now_s < self.pin_s / 2
            extra = 0 if known is not None else object_bytes  # a known pin's bytes are counted already
            take = due and extra <= room
            room -= extra if take else 0
            renew.append(take)
        pin_new = []
        for _ in new_keys:
            take = object_bytes <= room
            room -= object_bytes if take else 0
            pin_new.append(take)
        return PinPlan(tuple(pin_new), tuple(renew))

    def pinned(self, keys: Sequence[str], object_bytes: int, now_s: float) -> None:
        """These objects now hold a pin from `now_s` (a successful pinned put or upsert)."""
        ends_s = now_s + self.pin_s
        for key in keys:
            previous = self._expiry.pop(key, None)
            if previous is not None:
                self._live_bytes -= previous[1]
            self._expiry[key] = (ends_s, object_bytes)  # to the end: pins all last pin_s, so ends stay in order
            self._live_bytes += object_bytes

    def _expire(self, now_s: float) -> None:
        while self._expiry:
            key, (ends_s, nbytes) = next(iter(self._expiry.items()))
            if ends_s > now_s:
                break
            del self._expiry[key]
            self._live_bytes -= nbytes
