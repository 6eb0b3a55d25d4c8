"""The connector's block copies (kv_pages.KVPages) against a plain copy of the same bytes, per
KV layout, on CPU or CUDA: the part of every P/D pull and pool store/load that touches the
engine's cache.

    .venv/bin/python -m benchmarks.bench_kv_pages                  # CPU
    .venv/bin/python -m benchmarks.bench_kv_pages --device cuda    # a GPU machine

For each layout, `--blocks` blocks scattered over a cache of `--cache-blocks` are gathered into
host staging as a prefill's transfer server does (`pages`), and received into other blocks as a
decode's pull does (`receiving`: host staging, then scattered into the cache). The baseline moves the same bytes with one
`copy_` between a contiguous device tensor and host staging: the floor of a copy between the
cache's device and host memory. Every method's bytes are checked first (a round trip through
KVPages must reproduce the source blocks exactly). Runs alternate between methods; the table is
the median of `--repeats`. Layouts (per layer, one block of 16 tokens):

- gqa_lbhnc: [blocks, 4 kv heads, 2*16, 128] bf16 (vLLM CPU's K|V per head)
- gqa_lbnhc: [blocks, 4, 16, 128] bf16 view of a token-major buffer (vLLM CUDA's GQA default:
  a block is not one contiguous run in view order)
- mla_latent: [blocks, 16, 576] bf16 (DeepSeek's compressed KV)
- kv_split: [2, blocks, 16, 4, 128] bf16 (K and V apart before the block dimension)

Writes benchmarks/results/kv_pages-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kv_transfer.kv_pages import KVPages

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, BLOCK, HEAD_DIM, LATENT = 4, 16, 128, 576


def _layouts(cache_blocks: int) -> dict[str, Callable[[], torch.Tensor]]:
    def lbnhc() -> torch.Tensor:
        return torch.randn(cache_blocks, BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16).permute(0, 2, 1, 3)

    return {
        "gqa_lbhnc": lambda: torch.randn(cache_blocks, HEADS, 2 * BLOCK, HEAD_DIM).to(torch.bfloat16),
        "gqa_lbnhc": lbnhc,
        "mla_latent": lambda: torch.randn(cache_blocks, BLOCK, LATENT).to(torch.bfloat16),
        "kv_split": lambda: torch.randn(2, cache_blocks, BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(run: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _measure(name: str, make: Callable[[], torch.Tensor], args: argparse.Namespace, device: torch.device,
             source_ids: list[int], dest_ids: list[int]) -> list[dict] | None:
    """Rows of the table for one layout; None (and a message) when the bytes came back wrong."""
    caches = {f"model.layers.{i}.attn": make().to(device) for i in range(args.layers)}
    if name == "gqa_lbnhc":  # keep the sink token-major too
        sinks = {n: torch.zeros(args.cache_blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16,
                                device=device).permute(0, 2, 1, 3) for n in caches}
    else:
        sinks = {n: torch.zeros_like(t) for n, t in caches.items()}
    source, sink = KVPages(caches, args.cache_blocks), KVPages(sinks, args.cache_blocks)
    staged = source.gather(source_ids)
    sink.scatter(dest_ids, staged)
    if not torch.equal(sink.gather(dest_ids), staged):
        print(f"{name}: the blocks scattered back differ from the source", file=sys.stderr)
        return None
    nbytes = staged.numel()
    flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def receive() -> None:
        with sink.receiving(dest_ids):
            pass  # a transport writes the pages here; on exit they are scattered into the cache

    methods = {
        "gather": lambda: source.pages(source_ids),  # a prefill's READ: staged, pages dropped after
        "scatter": receive,
        "copy_to_host": lambda: flat_host.copy_(flat_device, non_blocking=True),
        "copy_from_host": lambda: flat_device.copy_(flat_host, non_blocking=True),
    }
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):  # alternate methods so drift hits all alike
        for method, run in methods.items():
            samples[method] += _median_ms(run, device, 1)
    medians = {m: statistics.median(s) for m, s in samples.items()}
    rows = []
    for method, ms in medians.items():
        baseline = medians["copy_to_host" if method in ("gather", "copy_to_host") else "copy_from_host"]
        rows.append({"layout": name, "method": method, "ms": ms, "gb_per_s": nbytes / ms / 1e6,
                     "x_copy": ms / baseline, "bytes": nbytes})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per transfer (256 = 4,096 tokens)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu", file=sys.stderr)
        return 2
    out = Path(args.out or RESULTS / f"kv_pages-{device.type}.json")
    generator = torch.Generator().manual_seed(0)
    source_ids = torch.randperm(args.cache_blocks, generator=generator)[:args.blocks].tolist()
    dest_ids = torch.randperm(args.cache_blocks, generator=generator)[:args.blocks].tolist()

    rows = []
    for name, make in _layouts(args.cache_blocks).items():
        measured = _measure(name, make, args, device, source_ids, dest_ids)
        if measured is None:
            return 1
        rows += measured

    print(f"\n{args.blocks} blocks x {args.layers} layers per transfer, median of {args.repeats}, "
          f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'})\n")
    print("| layout | method | MB | ms | GB/s | x plain copy |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['layout']} | {row['method']} | {row['bytes'] / 1e6:.1f} | {row['ms']:.2f} | "
              f"{row['gb_per_s']:.2f} | {row['x_copy']:.2f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "device": str(device), "torch": torch.__version__,
                               "config": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
