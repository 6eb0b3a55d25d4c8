"""The adapter from vLLM's KV cache tensors to plain byte pages (the transport's unit).

What one block of one layer looks like depends on the attention backend, so the block
dimension is found, not assumed: it is the dimension (0 or 1) whose size is the engine's
number of blocks (`KVCacheConfig.num_blocks`). Layouts seen in vLLM 0.32/0.33:

    CPU, GQA/MHA          [blocks, kv_heads, 2*block_size, head_dim]   block dim 0 (LBHNC)
    CPU MLA               [blocks, block_size, 576]                    block dim 0 (one latent)
    FlashMLA / FlashInfer [blocks, block_size, 576] / [blocks, 2, ...] block dim 0
    FlashAttention        [2, blocks, block_size, kv_heads, head_dim]  block dim 1 (K, V apart)

A block's bytes are then one contiguous segment per index of the dimensions before the
block dimension: one for block-major layouts (MLA's latent, CPU's K|V page), two for a K/V
split (K page, V page). Segments are listed layer-major, then block, then segment, so
prefill and decode, which must run the same model, dtype, block size and backend, produce
lists of the same length and sizes and a byte copy of each segment is a valid KV copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


class KVLayoutError(ValueError):
    """A KV cache tensor whose blocks this adapter cannot address as contiguous segments."""


@dataclass(frozen=True)
class _Layer:
    tensor: torch.Tensor
    block_dim: int  # 0: block-major; 1: a leading split (K/V) before the block dimension
    leading: tuple[int, ...]  # sizes of the dimensions before block_dim ((), or (2,) for K/V)


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
        self.segments_per_page = _segments(first) if first else 0

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def describe(self) -> str:
        """One line for logs: shape of the first layer's cache and where its blocks are."""
        if not self._layers:
            return "no KV cache"
        layer = self._layers[0]
        kind = "block-major" if layer.block_dim == 0 else f"{layer.leading[0]}-way split (K/V) before blocks"
        return f"{tuple(layer.tensor.shape)} {layer.tensor.dtype}, {kind}, {self.segments_per_page} segment(s)/page"

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) spanned by each layer's cache, for transports that register memory."""
        return [(layer.tensor.data_ptr(), _span_bytes(layer.tensor)) for layer in self._layers]

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        """The byte segments of these blocks: layer-major, then block, then segment."""
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


def _describe(name: str, tensor: torch.Tensor, num_blocks: int | None) -> _Layer:
    if num_blocks is None or tensor.shape[0] == num_blocks:
        block_dim = 0
    elif tensor.dim() > 1 and tensor.shape[1] == num_blocks:
        block_dim = 1
    else:
        raise KVLayoutError(
            f"KV cache of {name} has shape {tuple(tensor.shape)}; neither dimension 0 nor 1 is the "
            f"engine's {num_blocks} blocks, so its pages cannot be addressed (unknown backend layout)")
    leading = tuple(int(n) for n in tensor.shape[:block_dim])
    example = tensor[(*(0 for _ in leading), 0)]
    if not example.is_contiguous():
        raise KVLayoutError(
            f"KV cache of {name} has non-contiguous blocks (shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())}); a page must be a contiguous run of bytes")
    return _Layer(tensor, block_dim, leading)


def _segments(layer: _Layer) -> int:
    count = 1
    for n in layer.leading:
        count *= n
    return count


def _block_bytes(layer: _Layer) -> int:
    per_segment = layer.tensor[(*(0 for _ in layer.leading), 0)].numel() * layer.tensor.element_size()
    return per_segment * _segments(layer)


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to one past the last element (numel * size when contiguous)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else 0, name)
