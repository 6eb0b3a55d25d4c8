"""A pool load against a TCP pull of the same KV blocks, with the GIL free and with it busy.

    .venv/bin/python -m benchmarks.bench_pool_load --rounds 7

Why the GIL: pool loads and KV pulls run on connector threads inside the engine process,
whose main thread (vLLM's busy loop) holds the GIL most of the time. Every C call on such a
thread that lets go of the GIL waits up to one switch interval (5 ms) to get it back, so what
matters on a serving engine is how many hand-offs a load makes, not only its bytes/s.
`--busy` runs a pure-Python spinning thread beside the transfers to stand for that loop.

Methods (one process, real Mooncake master; each moves the same 32 blocks of 256 KiB in
8 pages of 32 KiB, the tiny model's CPU block, into the pages of a second "engine"):
- pool_load: our pool worker (`PoolWorker.load`: batched Mooncake get into a staging buffer,
  header and XXH3 checksum checked per block, scattered into the pages), checksums keeping
  the GIL (`kv_transfer/pool/checksum.py`), the objects in another client's segment (the writer's);
- pool_load_own_segment: the same, the objects in the reader's own segment (stored by the
  reader: decode reading back a conversation it stored, or any engine with
  `kv_pool.prefill_segment_mib: 0` in P/D);
- bare_get, bare_get_own_segment: Mooncake's batched get of the same objects alone (through
  our store adapter, into the staging buffer; no checks, no scatter);
- checksum_xxh3, checksum_crc32: the checksum of the 32 blocks alone, ours (XXH3-64 in
  64 KiB updates, keeping the GIL) and `zlib.crc32` (the pool's checksum before 2026-12-06,
  called through libz to keep the GIL; zlib's own module lets go of it per block);
- tcp_pull: our TCP transport (`kv_transfer/transport/tcp`: server thread, one fetch of the
  blocks' pages, as decode pulls a lease).
`--hogs N` runs N busy processes for the whole run, as the other engines, replicas and the
benchmark client do on a loaded node: every hand-off between threads or processes then waits
for a core. Each round runs every method once per setting (alternating); the table is the median.
Writes benchmarks/results/pool_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.kv_bench_lease import REQUEST_ID, bench_lease
from kv_transfer.kv_pages import KVPages

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS, LAYER_PAGES, PAGE_BYTES = 32, 8, 32 * 1024  # 8 x 32 KiB = one 256 KiB block


class _Pages(KVPages):
    """The connector's own KVPages over one uint8 cache per layer (LAYER_PAGES x BLOCKS pages)."""

    def __init__(self, fill: bool):
        generator = torch.Generator().manual_seed(0)
        self.layers = [torch.randint(0, 256, (BLOCKS, PAGE_BYTES), dtype=torch.uint8, generator=generator) if fill
                       else torch.zeros((BLOCKS, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYER_PAGES)]
        super().__init__({f"model.layers.{i}.attn": layer for i, layer in enumerate(self.layers)}, BLOCKS)

    def clear(self) -> None:
        for layer in self.layers:
            layer.zero_()


def _libz_crc32():
    """libz's CRC-32 through ctypes.PyDLL (keeps the GIL): the pool's checksum before XXH3."""
    import ctypes
    import ctypes.util

    fn = ctypes.PyDLL(ctypes.util.find_library("z")).crc32_z
    fn.argtypes, fn.restype = [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ulong

    def crc32(view: memoryview) -> int:
        array = np.frombuffer(view, dtype=np.uint8)
        return fn(0, array.ctypes.data, array.size)

    return crc32


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def _hog() -> None:
    while True:
        sum(range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hogs", type=int, default=0, help="busy processes running beside the benchmark")
    parser.add_argument("--out", default=None, help="default benchmarks/results/pool_load[-hogsN].json")
    args = parser.parse_args()
    args.out = args.out or str(RESULTS / (f"pool_load-hogs{args.hogs}.json" if args.hogs else "pool_load.json"))
    import multiprocessing

    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()

    from cluster.kv_pool_service import KVPoolMaster
    from kv_transfer.pool.checksum import xxh3_64
    from kv_transfer.pool.health import PoolHealth
    from kv_transfer.pool.keys import KeySpace
    from kv_transfer.pool.mooncake_store import MooncakePoolStore
    from kv_transfer.pool.objects import token_digest
    from kv_transfer.pool.records import PoolBlock
    from kv_transfer.pool.store import PoolSettings
    from kv_transfer.pool.worker_tier import PoolWorker
    from kv_transfer.transport import get_backend

    master = KVPoolMaster("bench-pool-load")
    try:
        deadline = time.monotonic() + 30
        while not master.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = master.address()
        settings = PoolSettings(master_address=address["master_address"], metadata_url=address["metadata_url"],
                                segment_bytes=256 << 20, key_prefix="bench")

        def worker(segment: bool, pages: _Pages) -> PoolWorker:
            store = MooncakePoolStore(settings if segment else PoolSettings(**{**settings.to_dict(), "segment_bytes": 0}))
            w = PoolWorker(lambda: store, KeySpace("bench", "pool-load"), 0, PoolHealth(5.0), 64 << 20)
            w.attach(pages)
            return w

        source, sink = _Pages(fill=True), _Pages(fill=False)
        writer, reader = worker(True, source), worker(True, sink)
        blocks = [PoolBlock(os.urandom(16), token_digest([i]), i) for i in range(BLOCKS)]
        if writer.store(blocks) != BLOCKS:  # into the writer's segment (puts prefer their own)
            raise RuntimeError(f"storing {BLOCKS} blocks in the pool failed: {writer.snapshot()}")
        own_blocks = [PoolBlock(os.urandom(16), token_digest([i]), i) for i in range(BLOCKS)]
        for layer, data in zip(sink.layers, source.layers):
            layer.copy_(data)
        if reader.store(own_blocks) != BLOCKS:  # into the reader's own segment
            raise RuntimeError(f"storing {BLOCKS} blocks in the pool failed: {reader.snapshot()}")
        keys = KeySpace("bench", "pool-load")
        for who, which in ((writer, blocks), (reader, own_blocks)):
            store = who._store_factory()
            placed = set(store.segments_of([keys.key(b.block_hash, 0) for b in which]))
            if placed != {store.own_segment()}:
                raise RuntimeError(f"objects landed in {placed}, not in their writer's segment {store.own_segment()}")

        tcp = get_backend("tcp")
        lease = bench_lease(BLOCKS)
        server = tcp.server("127.0.0.1", 0, source, lambda rid: None, lambda: {},
                            leases=lease.leases, grant_key=lease.grant_key)
        server.start()
        client = tcp.client()
        client.register_sink(sink)
        host, port = server.address
        ids = list(range(BLOCKS))

        def tcp_pull(block_ids) -> None:
            with sink.receiving(block_ids) as dest:
                client.fetch(host, port, REQUEST_ID, block_ids, dest, 60.0, lease.grant)

        def pool_load(which) -> None:
            reader.load(which)

        reader_store = reader._store_factory()
        staging = reader._staging["load"][0]  # registered with the reader's client
        object_bytes = reader.layout.object_bytes

        def bare_get(which) -> None:  # Mooncake's read alone: no executor, checksum or scatter
            got = reader_store.get_into([keys.key(b.block_hash, 0) for b in which],
                                        [staging.data_ptr() + i * object_bytes for i in range(len(which))],
                                        [object_bytes] * len(which))
            if got != [object_bytes] * len(which):
                raise RuntimeError(f"a bare get read {got}")

        staged = [memoryview(staging.numpy())[i * object_bytes:(i + 1) * object_bytes] for i in range(BLOCKS)]
        libz_crc32 = _libz_crc32()

        methods = {"pool_load": lambda: pool_load(blocks),
                   "pool_load_own_segment": lambda: pool_load(own_blocks),
                   "bare_get": lambda: bare_get(blocks),
                   "bare_get_own_segment": lambda: bare_get(own_blocks),
                   "checksum_xxh3": lambda: [xxh3_64(obj) for obj in staged],
                   "checksum_crc32": lambda: [libz_crc32(obj) for obj in staged],
                   "tcp_pull": lambda: tcp_pull(ids)}
        nbytes = BLOCKS * LAYER_PAGES * PAGE_BYTES
        for name, run in methods.items():  # warm-up and the bytes check
            sink.clear()
            run()
            if name.startswith(("pool_load", "tcp")) and not all(torch.equal(a, b)
                                                            for a, b in zip(source.layers, sink.layers)):
                raise RuntimeError(f"{name}: the blocks that arrived differ from the source")
        seconds = {(name, busy): [] for name in methods for busy in (False, True)}
        for index in range(args.rounds):
            for busy in (False, True):
                stop = threading.Event()
                spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
                if busy:
                    spinner.start()
                for name, run in methods.items():
                    started = time.perf_counter()
                    run()
                    seconds[(name, busy)].append(time.perf_counter() - started)
                stop.set()
                if busy:
                    spinner.join()
            print(f"[bench] round {index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        client.close()
        server.stop()
        reader.snapshot()
    finally:
        master.stop()
        for hog in hogs:
            hog.terminate()

    rows = []
    for (name, busy), values in seconds.items():
        median = statistics.median(values)
        rows.append({"method": name, "gil_busy": busy, "ms": median * 1e3, "mb_per_s": nbytes / median / 1e6})
    tcp_rate = {r["gil_busy"]: r["mb_per_s"] for r in rows if r["method"] == "tcp_pull"}
    print(f"\n{BLOCKS} blocks of {LAYER_PAGES * PAGE_BYTES // 1024} KiB ({nbytes / 1e6:.1f} MB), median of "
          f"{args.rounds} rounds; {args.hogs} busy processes beside\n")
    print("| method | GIL | ms | MB/s | x tcp_pull |\n|---|---|---:|---:|---:|")
    for r in rows:
        r["x_tcp_pull"] = r["mb_per_s"] / tcp_rate[r["gil_busy"]]
        print(f"| {r['method']} | {'busy' if r['gil_busy'] else 'free'} | {r['ms']:.1f} | {r['mb_per_s']:.0f} "
              f"| {r['x_tcp_pull']:.2f} |")
    out = Path(args.out)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "hogs": args.hogs, "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
