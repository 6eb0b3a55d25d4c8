"""Per-peer back-off of the transfer client: a dead prefill node costs one timeout, not one per pull.

Against a node that is down or blackholed, every connect or request waits out its whole timeout
(transfer_timeout_s, 5 s by default), and each of decode's pulls and releases would pay it while
pulls from healthy prefills queue behind them. Rule, per peer (host, port):
- a failure that shows the peer unreachable (`PeerUnreachable`: the connect failed or timed out,
  or no reply came within the deadline) marks it down for a back-off window: `base_s` after the
  first such failure, doubling with each failed probe (below), at most `max_s`; calls that were
  already in flight when it went down fail within the same window;
- while it is down, a call to it fails at once (`PeerDown`) without touching the network;
- when the window has passed, one call goes through as a probe; the others keep failing at once
  until the probe ends (or `probe_s` passes, should its caller never report);
- any success (or a reply of any kind) clears the record.
Other failures (an ERROR reply, a transfer cut off after bytes arrived) show the peer alive.

`PeerHealth` is pure (time is an argument); `guarded` is the adapter that reads the clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from kv_transfer.errors import KVTransferError

Peer = tuple[str, int]  # (host, port)


class PeerUnreachable(KVTransferError):
    """Marks a client failure that says nothing answered: no connection, or no reply at all.
    The transport raises subclasses that are also its TransferFailed or TransferTimeout."""


class PeerDown(KVTransferError):
    """A call was not attempted: its peer failed recently and its back-off window is open."""

    def __init__(self, peer: Peer, retry_in_s: float):
        super().__init__(f"{peer[0]}:{peer[1]} was unreachable; not tried again for {retry_in_s:.1f} s")
        self.peer = peer
        self.retry_in_s = retry_in_s


@dataclass
class _Down:
    failures: int  # unreachable in a row
    until_s: float  # calls fail at once before this
    probe_until_s: float = 0.0  # a probe is out until then


class PeerHealth:
    """Thread-safe; no I/O."""

    def __init__(self, base_s: float = 5.0, max_s: float = 30.0, probe_s: float = 5.0):
        self.base_s = base_s
        self.max_s = max_s
        self.probe_s = probe_s  # the longest one call can take (the transfer timeout)
        self._lock = threading.Lock()
        self._down: dict[Peer, _Down] = {}

    def admit(self, peer: Peer, now_s: float) -> float:
        """0.0 when a call to `peer` may go ahead now; else the seconds until one may."""
        with self._lock:
            down = self._down.get(peer)
            if down is None:
                return 0.0
            if now_s < down.until_s:
                return down.until_s - now_s
            if now_s < down.probe_until_s:
                return down.probe_until_s - now_s
            down.probe_until_s = now_s + self.probe_s  # this call is the probe
            return 0.0

    def failed(self, peer: Peer, now_s: float) -> float:
        """The peer was unreachable; returns the back-off window it is down for."""
        with self._lock:
            down = self._down.setdefault(peer, _Down(0, now_s))
            if now_s < down.until_s:  # a call that was in flight when the peer went down: same outage
                return down.until_s - now_s
            down.failures += 1
            window_s = min(self.max_s, self.base_s * 2 ** (down.failures - 1))
            down.until_s = now_s + window_s
            down.probe_until_s = 0.0
            return window_s

    def succeeded(self, peer: Peer) -> None:
        with self._lock:
            self._down.pop(peer, None)

    def peers_down(self, now_s: float) -> int:
        """Peers whose calls fail at once now."""
        with self._lock:
            return sum(1 for down in self._down.values() if now_s < max(down.until_s, down.probe_until_s))


@contextlib.contextmanager
def guarded(health: PeerHealth, host: str, port: int,
            clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Around one client call to (host, port): raises PeerDown at once while the peer is down;
    records what the call showed about the peer."""
    peer = (host, port)
    retry_in_s = health.admit(peer, clock())
    if retry_in_s:
        raise PeerDown(peer, retry_in_s)
    try:
        yield
    except PeerUnreachable:
        health.failed(peer, clock())
        raise
    except KVTransferError:  # the peer answered (an ERROR, a cut-off transfer): it is there
        health.succeeded(peer)
        raise
    health.succeeded(peer)
