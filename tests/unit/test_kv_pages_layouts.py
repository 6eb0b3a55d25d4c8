"""The page map on every KV layout vLLM's backends hand a connector: CPU GQA (LBHNC), MLA's
single latent per token, FlashAttention's K/V split before the block dimension. A copy of
the listed segments from one cache into another must copy exactly the named blocks."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.kv_pages import KVLayoutError, KVPages

BLOCKS = 6


def _caches(shape, layers=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=generator) for i in range(layers)}


LAYOUTS = {
    "cpu_gqa_lbhnc": (BLOCKS, 2, 2 * 16, 32),  # [blocks, kv_heads, 2*block, head]
    "mla_latent": (BLOCKS, 16, 576),  # [blocks, block, kv_lora_rank + rope]
    "flash_attn_kv_split": (2, BLOCKS, 16, 2, 32),  # [K|V, blocks, block, kv_heads, head]
}


def _block(tensor: torch.Tensor, block: int) -> torch.Tensor:
    return tensor[:, block] if tensor.shape[0] == 2 and tensor.shape[1] == BLOCKS else tensor[block]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_copying_segments_copies_exactly_the_named_blocks(layout):
    shape = LAYOUTS[layout]
    source_caches, sink_caches = _caches(shape, seed=1), _caches(shape, seed=2)
    untouched = {name: t.clone() for name, t in sink_caches.items()}
    source, sink = KVPages(source_caches, BLOCKS), KVPages(sink_caches, BLOCKS)
    remote, local = [4, 1], [0, 5]
    src, dst = source.pages(remote), sink.pages(local)
    assert len(src) == len(dst) == 3 * 2 * source.segments_per_page
    for s, d in zip(src, dst):
        d[:] = s
    for name in source_caches:
        for r, l in zip(remote, local):
            assert torch.equal(_block(sink_caches[name], l), _block(source_caches[name], r)), (name, r, l)
        for other in set(range(BLOCKS)) - set(local):
            assert torch.equal(_block(sink_caches[name], other), _block(untouched[name], other))


def test_page_bytes_count_every_segment_of_one_block():
    assert KVPages(_caches(LAYOUTS["mla_latent"]), BLOCKS).page_bytes == 16 * 576 * 4
    split = KVPages(_caches(LAYOUTS["flash_attn_kv_split"]), BLOCKS)
    assert split.page_bytes == 2 * 16 * 2 * 32 * 4 and split.segments_per_page == 2
    assert split.num_blocks == BLOCKS


def test_layers_sharing_one_cache_are_listed_once():
    shared = torch.zeros(LAYOUTS["mla_latent"])
    pages = KVPages({"model.layers.0.attn": shared, "model.layers.1.attn": shared}, BLOCKS)
    assert pages.num_layers == 1


def test_a_layout_without_a_block_dimension_is_refused_naming_the_shape():
    with pytest.raises(KVLayoutError, match=r"\(3, 4, 16, 576\)"):
        KVPages({"model.layers.0.attn": torch.zeros(3, 4, 16, 576)}, num_blocks=BLOCKS)


def test_non_contiguous_blocks_are_refused():
    permuted = torch.zeros(BLOCKS, 16, 2, 32).permute(0, 2, 1, 3)  # HND view of an NHD buffer
    with pytest.raises(KVLayoutError, match="non-contiguous"):
        KVPages({"model.layers.0.attn": permuted}, BLOCKS)
