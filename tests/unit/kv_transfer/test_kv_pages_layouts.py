"""KVPages on every KV layout vLLM's backends hand a connector: CPU GQA (LBHNC), CUDA GQA's
token-major blocks (LBNHC: a block view that is not contiguous), MLA's single latent per token,
a K/V split before the block dimension. Gathering blocks from one cache and scattering them into
another must copy exactly the named blocks, whatever either side's physical layout."""

from __future__ import annotations

import os

import pytest
import torch

from kv_transfer.kv_pages import KVLayoutError, KVPages

# The same tests on a GPU (scripts/gpu_selfcheck.sh): MOE_SERVE_KV_TEST_DEVICE=cuda.
DEVICE = torch.device(os.environ.get("MOE_SERVE_KV_TEST_DEVICE", "cpu"))
BLOCKS, LAYERS = 6, 3
HEADS, BLOCK_SIZE, HEAD_DIM = 2, 16, 32


def _lbnhc(generator=None) -> torch.Tensor:
    """CUDA's default for GQA in vLLM 0.32: [blocks, heads, tokens, dim] view of a token-major buffer."""
    buffer = torch.randn(BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=generator)
    return buffer.permute(0, 2, 1, 3)


def _fp8(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 (e4m3) KV cache of the same layout: one byte per element."""
    return tensor.to(torch.float8_e4m3fn)


LAYOUTS = {
    "cpu_gqa_lbhnc": lambda g: torch.randn(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_DIM, generator=g),
    "cuda_gqa_lbnhc": _lbnhc,
    "cuda_gqa_lbnhc_fp8": lambda g: _fp8(_lbnhc(g)),
    "mla_latent": lambda g: torch.randn(BLOCKS, BLOCK_SIZE, 576, generator=g),
    # vLLM's fp8_ds_mla cache: 656 bytes per token (fp8 latent, scales, bf16 rope part) as uint8.
    "mla_fp8_ds": lambda g: torch.randint(0, 256, (BLOCKS, BLOCK_SIZE, 656), generator=g, dtype=torch.uint8),
    "kv_split": lambda g: torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g),
    "kv_split_fp8": lambda g: _fp8(torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g)),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (torch.equal has no fp8 kernel on CPU)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _caches(layout: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": _on_device(LAYOUTS[layout](generator)) for i in range(LAYERS)}


def _on_device(cache: torch.Tensor) -> torch.Tensor:
    """`cache` on DEVICE with the same strides (a token-major view stays one)."""
    if DEVICE.type == "cpu":
        return cache
    moved = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=DEVICE)
    return moved.copy_(cache)


def _block(tensor: torch.Tensor, block: int) -> torch.Tensor:
    return tensor[:, block] if tensor.shape[0] == 2 and tensor.shape[1] == BLOCKS else tensor[block]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_then_scatter_copies_exactly_the_named_blocks(layout):
    source_caches, sink_caches = _caches(layout, seed=1), _caches(layout, seed=2)
    untouched = {name: t.clone() for name, t in sink_caches.items()}
    source, sink = KVPages(source_caches, BLOCKS), KVPages(sink_caches, BLOCKS)
    remote, local = [4, 1], [0, 5]
    sink.scatter(local, source.gather(remote))
    for name in source_caches:
        for r, l in zip(remote, local):
            assert _same(_block(sink_caches[name], l), _block(source_caches[name], r)), (name, r, l)
        for other in set(range(BLOCKS)) - set(local):
            assert _same(_block(sink_caches[name], other), _block(untouched[name], other))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pages_received_into_reach_the_cache_only_when_the_transfer_succeeds(layout):
    source, sink_caches = KVPages(_caches(layout, seed=3), BLOCKS), _caches(layout, seed=4)
    sink = KVPages(sink_caches, BLOCKS)
    before = {name: t.clone() for name, t in sink_caches.items()}
    sent = source.pages([2, 3])
    assert len(sent) == LAYERS * 2 and all(p.nbytes == source.page_bytes for p in sent)
    with pytest.raises(ConnectionError):
        with sink.receiving([0, 1]) as dest:
            dest[0][:] = sent[0]
            raise ConnectionError("peer went away mid-transfer")
    assert all(_same(sink_caches[n], before[n]) for n in sink_caches)
    with sink.receiving([0, 1]) as dest:
        for d, s in zip(dest, sent):
            d[:] = s
    assert torch.equal(sink.gather([0, 1]), source.gather([2, 3]))


def test_a_page_is_the_block_in_memory_order():
    """Blocks are copied as the dense runs of memory they are (at memcpy speed, whatever the
    view's dimension order), so a page of a token-major cache is its token-major bytes; a byte
    copy is a valid KV copy between engines of one attention backend, as P/D and a pool require."""
    token_major = _caches("cuda_gqa_lbnhc", seed=5)
    name = next(iter(token_major))
    buffer_block = token_major[name].permute(0, 2, 1, 3)[1]  # [tokens, heads, dim], contiguous
    page = KVPages(token_major, BLOCKS).gather([1])[0, 0]
    assert torch.equal(page, buffer_block.contiguous().view(-1).view(torch.uint8))


def test_page_bytes_count_every_segment_of_one_block():
    assert KVPages(_caches("mla_latent", 0), BLOCKS).page_bytes == BLOCK_SIZE * 576 * 4
    split = KVPages(_caches("kv_split", 0), BLOCKS)
    assert split.page_bytes == 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4 and split.num_blocks == BLOCKS
    assert split.gather([0, 1]).shape == (LAYERS, 2, split.page_bytes)


def test_layers_sharing_one_cache_are_listed_once():
    shared = torch.zeros(BLOCKS, BLOCK_SIZE, 576)
    pages = KVPages({"model.layers.0.attn": shared, "model.layers.1.attn": shared}, BLOCKS)
    assert pages.num_layers == 1


def test_a_layout_without_a_block_dimension_is_refused_naming_the_shape():
    with pytest.raises(KVLayoutError, match=r"\(3, 4, 16, 576\)"):
        KVPages({"model.layers.0.attn": torch.zeros(3, 4, 16, 576)}, num_blocks=BLOCKS)


def test_blocks_outside_the_cache_are_refused_before_any_copy():
    pages = KVPages(_caches("mla_latent", 0), BLOCKS)
    with pytest.raises(ValueError, match="outside"):
        pages.gather([BLOCKS])
    with pytest.raises(ValueError, match="outside"):
        with pages.receiving([-1]):
            pass


def test_in_place_host_memory_refuses_what_it_cannot_address():
    """The mooncake backend moves bytes in place: strided blocks and device caches are refused
    when the engine starts, naming the fix, instead of failing every transfer."""
    with pytest.raises(KVLayoutError, match="backend: tcp"):
        KVPages(_caches("cuda_gqa_lbnhc", 0), BLOCKS).host_memory()
    on_device = {"model.layers.0.attn": torch.empty(BLOCKS, BLOCK_SIZE, 576, device="meta")}
    with pytest.raises(KVLayoutError, match="on meta"):
        KVPages(on_device, BLOCKS).host_memory()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="in-place pages exist only for a host-memory cache")
def test_in_place_pages_are_views_of_the_cache():
    caches = _caches("kv_split", 7)
    memory = KVPages(caches, BLOCKS).host_memory()
    views = memory.pages([2])
    assert len(views) == LAYERS * 2  # K and V apart: two runs of bytes per (layer, block)
    views[0][:] = bytes(views[0].nbytes)
    assert torch.count_nonzero(caches["model.layers.0.self_attn.attn"][0, 2]) == 0
