"""Interfaces of a KV transport backend (no torch, no vLLM: pages are plain memoryviews).

A page is the bytes of one (layer, block) of the KV cache; on vLLM CPU that is
`kv_caches[layer][block]`, one contiguous tensor slice the connector hands us as a memoryview.
Page lists are always layer-major: for each layer, for each block id in the order given.

The decode worker's `TransferClient` pulls pages from the prefill worker's `TransferServer`
straight into its own pages, then asks the server to release the request's blocks.

A page source or sink may also implement `HasRegions.regions()`: the few large buffers all its
pages live in. Backends that must register memory before moving it (Mooncake, RDMA) register
those once instead of page by page.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Protocol, runtime_checkable


@runtime_checkable
class PageSource(Protocol):
    """Prefill side: readable pages of blocks this worker holds."""

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        """One page per (layer, block), layer-major. Raises KeyError/ValueError/IndexError
        for blocks it cannot serve; the server turns that into an ERROR reply."""
        ...


@runtime_checkable
class PageSink(Protocol):
    """Decode side: writable pages to receive into, same order and layout as PageSource."""

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        ...


@runtime_checkable
class HasRegions(Protocol):
    """Optional for a PageSource / PageSink: the memory every page of it lies in."""

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) of each buffer holding pages; ranges may overlap or touch."""
        ...


class CoversBlocks(Protocol):
    def covers(self, block_ids: Iterable[int]) -> bool:
        ...


class LeaseLookup(Protocol):
    """What the server asks before serving a read: `LeaseTable`, or a connector's own guard."""

    def get(self, request_id: str) -> CoversBlocks | None:
        """None refuses every read of the request; otherwise `covers` decides per read."""
        ...


@dataclass(frozen=True)
class FetchResult:
    """Outcome of one successful fetch."""

    bytes: int  # payload bytes received into the dest pages
    seconds: float  # from sending the request to the last byte landing in the pages


class TransferServer(abc.ABC):
    """Serves pages of one prefill worker to any number of decode clients, in the background.

    `on_release(request_id)` runs (on a server thread) when a client releases a request; it
    should free the request's blocks. `on_stats()` returns a JSON-able dict. When `leases` is
    given, a read is served only if the request holds a lease covering every block asked for,
    so a late or stray read cannot return blocks that were freed and reused by another request.
    """

    def __init__(self, host: str, port: int, source: PageSource,
                 on_release: Callable[[str], None], on_stats: Callable[[], dict],
                 *, leases: LeaseLookup | None = None, grant_key: Any = None):
        """`grant_key`: this engine's kv_transfer.grants.EngineGrants. READ, DESCRIBE and
        RELEASE are answered only for a grant of this engine that verifies (reads also only
        before its deadline and only for a known lease); without one (an engine that lends no
        KV) they are refused, and the server answers STATS only."""
        self.grant_key = grant_key
        self.host = host
        self.port = port
        self.source = source
        self.on_release = on_release
        self.on_stats = on_stats
        self.leases = leases

    @abc.abstractmethod
    def start(self) -> None:
        """Bind and start serving; returns once `address` is valid."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop accepting, drop open connections, join the threads. Idempotent."""

    @property
    @abc.abstractmethod
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; port 0 at construction means an ephemeral port."""


class TransferClient(abc.ABC):
    """Pulls pages from TransferServers. Thread-safe; reuses connections per (host, port).

    Every call finishes within its `timeout_s`, raising TransferTimeout, or TransferFailed
    when the server replied ERROR or the connection broke.
    """

    @abc.abstractmethod
    def fetch(self, host: str, port: int, request_id: str, remote_block_ids: list[int],
              dest_pages: list[memoryview], timeout_s: float, grant: bytes = b"") -> FetchResult:
        """Receive the remote pages of `remote_block_ids` (layer-major) into `dest_pages`.
        `grant`: the prefill's signed grant of these blocks (TransferParams.grant_bytes()).

        On failure the dest pages may hold part of the data; the caller must not use them.
        """

    @abc.abstractmethod
    def release(self, host: str, port: int, request_id: str, timeout_s: float,
                block_ids: tuple[int, ...] | list[int] = (), grant: bytes = b"") -> None:
        """Tell the server the request's blocks may be freed (with the lease's grant)."""

    @abc.abstractmethod
    def stats(self, host: str, port: int, timeout_s: float) -> dict:
        """The server's `on_stats()`."""

    def register_sink(self, sink: PageSink) -> None:
        """Hint: `fetch` will receive into pages of `sink`. Backends that register memory do it
        here once (for a sink with `regions()`); the default does nothing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close pooled connections. The client stays usable (it reconnects on demand)."""


class TransportBackend:
    """What the registry hands out: a backend's server and client classes, chosen by name."""

    name: ClassVar[str]
    server_cls: ClassVar[type[TransferServer]]
    client_cls: ClassVar[type[TransferClient]]
    # True: pages are the engine's own memory, registered and moved in place (kv_pages.HostKVMemory);
    # False: pages are host copies the connector stages (kv_pages.KVPages, any device).
    moves_engine_memory: ClassVar[bool] = False

    @classmethod
    def server_options(cls, transfer_timeout_s: float, protocol: str = "tcp", device_name: str = "") -> dict[str, Any]:
        """This backend's own keyword arguments for its server (none for ours, which speaks tcp only)."""
        if protocol != "tcp":
            raise ValueError(f"the {cls.name!r} KV transport speaks tcp only, not {protocol!r}")
        return {}

    @classmethod
    def client_options(cls, protocol: str = "tcp", device_name: str = "", local_host: str = "") -> dict[str, Any]:
        """This backend's own keyword arguments for its client."""
        return {}

    @classmethod
    def server(cls, host: str, port: int, source: PageSource, on_release: Callable[[str], None],
               on_stats: Callable[[], dict], *, leases: LeaseLookup | None = None,
               grant_key: Any = None) -> TransferServer:
        return cls.server_cls(host, port, source, on_release, on_stats, leases=leases, grant_key=grant_key)

    @classmethod
    def client(cls) -> TransferClient:
        return cls.client_cls()
