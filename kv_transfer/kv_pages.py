"""The adapter from vLLM's KV cache tensors to plain byte pages (the transport's unit).

On the CPU backend every layer's cache is a view `[num_blocks, heads, 2*block_size, head]`
(LBHNC) into one buffer, so `cache[block]` is one contiguous page. Pages are listed
layer-major: for each layer, for each requested block. Prefill and decode must run the same
model, dtype and block size, which makes a byte copy of a page a valid KV copy.
"""

from __future__ import annotations

import torch


class KVPages:
    def __init__(self, kv_caches: dict[str, torch.Tensor]):
        seen: set[int] = set()
        self._layers: list[torch.Tensor] = []
        for name in sorted(kv_caches, key=_layer_index):
            tensor = kv_caches[name]
            if tensor.data_ptr() in seen:  # layers sharing one cache appear under several names
                continue
            seen.add(tensor.data_ptr())
            if not tensor[0].is_contiguous():
                raise ValueError(f"KV cache of {name} has non-contiguous blocks (layout {tuple(tensor.stride())})")
            self._layers.append(tensor)
        self.num_blocks = int(self._layers[0].shape[0]) if self._layers else 0
        self.page_bytes = self._layers[0][0].numel() * self._layers[0].element_size() if self._layers else 0

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) spanned by each layer's cache, for transports that register memory."""
        return [(layer.data_ptr(), _span_bytes(layer)) for layer in self._layers]

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        for block in block_ids:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} outside [0, {self.num_blocks})")
        return [memoryview(layer[block].view(torch.uint8).numpy()).cast("B")
                for layer in self._layers for block in block_ids]


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to one past the last element (numel * size when contiguous)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else 0, name)
