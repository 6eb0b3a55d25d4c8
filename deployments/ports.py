"""Ports that one process picks and another binds later.

An engine's KV transfer server, its KV event sockets and an expert-parallel group's RPC port are
chosen before the engine starts (other processes must be told them), and bound by a vLLM worker
seconds to minutes later. A port found free by binding port 0 comes from the kernel's ephemeral
range, the range every outgoing connection and every other `bind(0)` on the machine draws from
(vLLM's ZMQ sockets, gloo, Ray): on a busy node one of them took such a port in between, and the
worker's bind failed with EADDRINUSE (seen in CI: an EP rank's KV server, while a second
application started). So we pick below the ephemeral range, where the kernel never assigns ports
by itself, at random so that concurrent pickers rarely meet, and check the port is free now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000  # clear of well-known and registered low ports services on a node may own
_ATTEMPTS = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in path.read_text().split())
        return low, high
    except (OSError, ValueError):  # not Linux, or an unreadable file: Linux's default
        return 32768, 60999


def reserve_port(host: str = "127.0.0.1", rng: random.Random | None = None,
                 ephemeral: tuple[int, int] | None = None, count: int = 1) -> int:
    """A TCP port on `host` that is free now and that the kernel will not hand out on its own;
    with `count`, the first of that many consecutive such ports (a tensor-parallel engine's
    workers serve KV on port + rank)."""
    rng = rng or random.SystemRandom()
    low, high = ephemeral or ephemeral_range()
    candidates = [(LOWEST_PORT, low - count)] if low - count > LOWEST_PORT else []
    if high + count <= 65535:
        candidates.append((high + 1, 65536 - count))
    for _ in range(_ATTEMPTS if candidates else 0):
        start, end = rng.choice(candidates)
        port = rng.randint(start, end)
        if all(_free(host, p) for p in range(port, port + count)):
            return port
    if count > 1:
        raise RuntimeError(f"found no {count} consecutive free ports on {host} outside the ephemeral range")
    with socket.socket() as probe:  # no room outside the ephemeral range: the kernel's pick
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
