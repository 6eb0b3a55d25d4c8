"""The adapter from vLLM's KV cache tensors to the bytes the transports and the pool move.

One data path for every device: blocks are gathered from the engine's cache tensors with
`index_select` on the block dimension into a host staging tensor, and received blocks are
written back with `index_copy_`, one batched op per layer and transfer, on the tensors' own
device. Nothing takes a numpy array or a memoryview of engine memory, so the code CI runs on
CPU is the code that runs on CUDA; there the staging is pinned, the copies run on a side
stream, and an event is waited on before bytes leave (gather) and before a block is reported
received (scatter). The host staging is the only memory the transports see.

What one block of one layer looks like depends on the attention backend. Every layout is
addressed by indexing, never by assuming a block is one contiguous run of bytes, so the
token-major block layout vLLM's CUDA backends default to for GQA models (LBNHC, whose block
view is not contiguous) works like CPU's head-major one (LBHNC). The block dimension is the
one (0 or 1) whose size is the engine's number of blocks (`KVCacheConfig.num_blocks`):

    CPU, GQA/MHA            [blocks, kv_heads, 2*block_size, head_dim]  block dim 0
    CUDA GQA (vLLM 0.32)    [blocks, kv_heads, block_size, head_dim] view of a token-major buffer
    MLA (CPU, FlashMLA)     [blocks, block_size, 576] (fp8 MLA: its own last dim)  block dim 0
    K/V split backends      [2, blocks, block_size, kv_heads, head_dim]  block dim 1

Bytes are always in the logical (view) order, so two engines with different physical layouts of
the same model exchange valid KV. Order of a transfer: layer-major, then block: `gather` returns
[layers, blocks, page_bytes] and a page is the bytes of one (layer, block).

`host_memory()` is the exception, for the "mooncake" P/D backend only: it reads and writes
engine memory in place through registered addresses, which is possible only for a cache in host
memory (vLLM CPU) and is refused for a device cache.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kv_transfer.host_staging import HostStaging, RegisteredStaging


class KVLayoutError(ValueError):
    """A KV cache tensor whose blocks this adapter cannot address."""


@dataclass(frozen=True)
class _Layer:
    tensor: torch.Tensor  # the engine's cache (its own dtype and shape)
    block_dim: int  # 0: block-major; 1: a leading split (K/V) before the block dimension
    # The cache as rows of whole words: [blocks, words] (block-major) or [split, blocks, words],
    # one row per block (per split segment), in memory order, in the widest integer type that
    # tiles them. Row copies (index_select/index_copy_) of these run at memcpy speed, where the
    # same copies of a multi-dimensional or byte view crawl element by element.
    rows: torch.Tensor

    @property
    def leading(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.tensor.shape[:self.block_dim])


class KVPages:
    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None):
        seen: set[int] = set()
        self._layers: list[_Layer] = []
        for name in sorted(kv_caches, key=_layer_index):
            tensor = kv_caches[name]
            if tensor.data_ptr() in seen:  # layers sharing one cache appear under several names
                continue
            seen.add(tensor.data_ptr())
            self._layers.append(_describe(name, tensor, num_blocks))
        first = self._layers[0] if self._layers else None
        self.num_blocks = int(first.tensor.shape[first.block_dim]) if first else 0
        self.page_bytes = _block_bytes(first) if first else 0  # bytes of one block of one layer
        self.device = first.tensor.device if first else torch.device("cpu")
        for layer in self._layers:
            if _block_bytes(layer) != self.page_bytes or layer.tensor.device != self.device:
                raise KVLayoutError(
                    f"KV caches differ between layers ({tuple(layer.tensor.shape)} on {layer.tensor.device} "
                    f"vs {self.page_bytes} B per block on {self.device}): one page size per engine is assumed")
        self._stream = None  # CUDA: the side stream copies run on (made on first use)
        # Pinned on CUDA: device copies to and from it run asynchronously (and a NIC can DMA it).
        self._staging = HostStaging(pinned=self.device.type == "cuda")

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def describe(self) -> str:
        """One line for logs: shape of the first layer's cache and where its blocks are."""
        if not self._layers:
            return "no KV cache"
        layer = self._layers[0]
        kind = "block-major" if layer.block_dim == 0 else f"{layer.leading[0]}-way split (K/V) before blocks"
        dense = "" if layer.tensor[(*(0 for _ in layer.leading), 0)].is_contiguous() else ", strided blocks"
        return f"{tuple(layer.tensor.shape)} {layer.tensor.dtype} on {self.device}, {kind}{dense}"

    # -- batched copies ---------------------------------------------------------------------

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of these blocks: uint8 [layers, len(block_ids), page_bytes]."""
        return self._gather_into(self._staging.take(self._staged_shape(len(block_ids))), block_ids)

    @contextlib.contextmanager
    def gathered(self, block_ids: list[int]) -> Iterator[torch.Tensor]:
        """`gather` into a reused staging buffer, given back when the block exits."""
        with self._staging.lease(self._staged_shape(len(block_ids))) as staged:
            yield self._gather_into(staged, block_ids)

    def _gather_into(self, out: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        index = self._index(block_ids)
        count = len(block_ids)
        with self._fenced():
            for i, layer in enumerate(self._layers):
                dest = out[i].view(layer.rows.dtype).view(count, *layer.leading, -1)
                if layer.block_dim == 0 and self.device.type == "cpu":
                    torch.index_select(layer.rows, 0, index, out=dest)  # straight into staging
                    continue
                picked = layer.rows.index_select(layer.block_dim, index)
                if layer.block_dim:
                    picked = picked.movedim(layer.block_dim, 0)  # (block, segment): one page per block
                dest.copy_(picked, non_blocking=True)
        return out

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write [layers, len(block_ids), page_bytes] bytes (any host tensor; pinned on CUDA
        for an asynchronous copy) into these blocks; returns once they are in the cache."""
        index = self._index(block_ids)
        count = len(block_ids)
        expected = (self.num_layers, count, self.page_bytes)
        if tuple(blocks.shape) != expected or blocks.dtype != torch.uint8:
            raise ValueError(f"scatter needs uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")
        with self._fenced():
            for i, layer in enumerate(self._layers):
                part = _as_words(blocks[i], layer.rows.dtype).view(count, *layer.leading, -1)
                part = part.to(self.device, non_blocking=True)
                if layer.block_dim:
                    part = part.movedim(0, layer.block_dim)
                layer.rows.index_copy_(layer.block_dim, index, part)

    # -- what the transports see ------------------------------------------------------------

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        """PageSource: a snapshot of these blocks as one page per (layer, block), layer-major."""
        return self._snapshot(block_ids, self._staging)

    @contextlib.contextmanager
    def receiving(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        """Host pages to receive these blocks into; written to the cache when the block exits
        without an exception (a failed transfer leaves the cache as it was)."""
        with self._receiving(block_ids, self._staging) as pages:
            yield pages

    def registered_staging(self, arena_bytes: int) -> "RegisteredKVStaging":
        """The same pages staged through one host arena registered once (`regions()`), for a
        transport that registers memory with a NIC: any device, any layout."""
        return RegisteredKVStaging(self, RegisteredStaging(arena_bytes, pinned=self.device.type == "cuda"))

    def _snapshot(self, block_ids: list[int], staging) -> list[memoryview]:
        self._check_ids(block_ids)  # before a buffer is taken: a refused read keeps none
        staged = staging.take(self._staged_shape(len(block_ids)))
        try:
            self._gather_into(staged, block_ids)
        except BaseException:
            staging.give_back(staged)
            raise
        return _page_views(staging.views_until_dropped(staged), staged.shape)

    @contextlib.contextmanager
    def _receiving(self, block_ids: list[int], staging) -> Iterator[list[memoryview]]:
        self._check_ids(block_ids)  # refuse bad ids before any byte arrives (no device index yet)
        with staging.lease(self._staged_shape(len(block_ids))) as staged:
            yield _page_views(memoryview(staged.numpy()).cast("B"), staged.shape)
            self.scatter(block_ids, staged)

    def host_memory(self) -> HostKVMemory:
        """The cache's own memory, for a transport that registers it and moves bytes in place."""
        if self.device.type != "cpu":
            raise KVLayoutError(
                f"the KV cache is on {self.device}: the 'mooncake' P/D backend moves bytes in place "
                "through host addresses, so it serves only a cache in host memory; use "
                "kv_transfer.backend: tcp (host-staged, any device)")
        return HostKVMemory(self._layers, self.num_blocks, self.page_bytes)

    def in_place(self) -> bool:
        """Whether `host_memory()` can serve this cache (host memory, dense blocks)."""
        return self.device.type == "cpu" and all(
            layer.tensor[(*(0 for _ in layer.leading), 0)].is_contiguous() for layer in self._layers)

    # -- internals --------------------------------------------------------------------------

    def _check_ids(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} outside [0, {self.num_blocks})")

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        self._check_ids(block_ids)
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _staged_shape(self, blocks: int) -> tuple[int, int, int]:
        return (self.num_layers, blocks, self.page_bytes)

    @contextlib.contextmanager
    def _fenced(self) -> Iterator[None]:
        """Run device copies on a side stream (never behind the engine's forward pass on the
        default stream) and wait for them before returning; on CPU, just run them."""
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # Whatever the current stream of this thread queued on the cache comes first.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()


class HostKVMemory:
    """Pages as views of a host-memory cache, in place (the "mooncake" backend registers
    `regions()` once and moves bytes between addresses). Same page order and sizes as KVPages."""

    def __init__(self, layers: list[_Layer], num_blocks: int, page_bytes: int):
        for layer in layers:
            if not layer.tensor[(*(0 for _ in layer.leading), 0)].is_contiguous():
                raise KVLayoutError(
                    f"KV cache {tuple(layer.tensor.shape)} (strides {tuple(layer.tensor.stride())}) has "
                    "strided blocks, which the 'mooncake' backend cannot address in place; use "
                    "kv_transfer.backend: tcp")
        self._layers = layers
        self.num_layers, self.num_blocks, self.page_bytes = len(layers), num_blocks, page_bytes

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) spanned by each layer's cache."""
        return [(layer.tensor.data_ptr(), _span_bytes(layer.tensor)) for layer in self._layers]

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        """One view per (layer, block, leading index), layer-major: a block of a K/V split
        layout is two runs of bytes."""
        for block in block_ids:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} outside [0, {self.num_blocks})")
        out: list[memoryview] = []
        for layer in self._layers:
            for block in block_ids:
                for lead in itertools.product(*(range(n) for n in layer.leading)):
                    segment = layer.tensor[(*lead, block)]
                    out.append(memoryview(segment.view(torch.uint8).numpy()).cast("B"))
        return out

    @contextlib.contextmanager
    def receiving(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        yield self.pages(block_ids)


class RegisteredKVStaging:
    """KVPages' staged pages through a RegisteredStaging arena: the "mooncake" backend registers
    `regions()` (the arena) once and reads or writes pages there, while the blocks are gathered
    from and scattered into the engine's cache on its device as on every staged path. A page
    snapshot lives until the transport server drops its views (the mooncake server holds them
    until the lease is released or its read window has passed)."""

    def __init__(self, pages: KVPages, staging: RegisteredStaging):
        self._kv, self._staging = pages, staging
        self.num_layers, self.num_blocks, self.page_bytes = pages.num_layers, pages.num_blocks, pages.page_bytes
        self.device = pages.device

    def describe(self) -> str:
        return f"{self._kv.describe()}, staged through a registered {self._staging.regions()[0][1] >> 20} MiB arena"

    def regions(self) -> list[tuple[int, int]]:
        return self._staging.regions()

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        return self._kv._snapshot(block_ids, self._staging)

    @contextlib.contextmanager
    def receiving(self, block_ids: list[int]) -> Iterator[list[memoryview]]:
        with self._kv._receiving(block_ids, self._staging) as pages:
            yield pages


def _page_views(flat: memoryview, shape: tuple[int, ...]) -> list[memoryview]:
    """One view per (layer, block) of host staging of ours (never engine memory)."""
    layers, blocks, page = shape
    return [flat[i * page:(i + 1) * page] for i in range(layers * blocks)]


def _describe(name: str, tensor: torch.Tensor, num_blocks: int | None) -> _Layer:
    if num_blocks is None or tensor.shape[0] == num_blocks:
        block_dim = 0
    elif tensor.dim() > 1 and tensor.shape[1] == num_blocks:
        block_dim = 1
    else:
        raise KVLayoutError(
            f"KV cache of {name} has shape {tuple(tensor.shape)}; neither dimension 0 nor 1 is the "
            f"engine's {num_blocks} blocks, so its pages cannot be addressed (unknown backend layout)")
    segment = tensor[(0,) * (block_dim + 1)]  # one block (of one split half): [heads, tokens, dim]...
    if not _dense(segment):
        raise KVLayoutError(
            f"KV cache of {name} has shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())}: "
            "a block is not one dense run of memory, so it cannot be copied as a row")
    outer = tuple(int(n) for n in tensor.shape[:block_dim + 1])
    rows = torch.as_strided(tensor, (*outer, segment.numel()),
                            (*tensor.stride()[:block_dim + 1], 1), tensor.storage_offset())
    return _Layer(tensor, block_dim, _widest_words(rows))


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements of `tensor` fill one run of memory exactly (in any dimension order)."""
    expected = 1
    for stride, size in sorted((int(s), int(n)) for n, s in zip(tensor.shape, tensor.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _widest_words(rows: torch.Tensor) -> torch.Tensor:
    """`rows` reinterpreted as the widest integers that tile every row and row start."""
    row_bytes = rows.shape[-1] * rows.element_size()
    starts = [rows.data_ptr(), *(s * rows.element_size() for s in rows.stride()[:-1])]
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % width == 0 and all(x % width == 0 for x in starts):
            return rows.view(torch.uint8).view(dtype)
    return rows.view(torch.uint8)


def _as_words(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [count, page_bytes] (possibly strided, as the pool's object views are) as `dtype`."""
    try:
        return blocks.view(dtype)
    except RuntimeError:  # rows that do not start on a word boundary: copy once
        return blocks.contiguous().view(dtype)


def _block_bytes(layer: _Layer) -> int:
    per_block = layer.tensor.numel() // int(layer.tensor.shape[layer.block_dim])
    return per_block * layer.tensor.element_size()


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to one past the last element (numel * size when contiguous)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else 0, name)
