"""The KV pool's disk tier against a plain sequential read of the same bytes.

    .venv/bin/python -m benchmarks.bench_pool_disk --rounds 5

One real Mooncake master with offload on (as `kv_pool.disk` starts it) and one client with a
16 MiB DRAM segment and a disk tier in a temporary folder (`MooncakePoolStore`, our adapter).
It stores OBJECTS objects of 256 KiB (the tiny Qwen3-MoE's float32 block of 128 tokens), four
times the segment, waits until the master has demoted the overflow to disk, then times, per
round and alternating:
- disk_tier_get: our adapter's batched get of the objects that are only on disk, in batches of
  16 (Mooncake reads the bucket files into its buffer and moves them over its transfer engine);
- sequential_read: reading the bucket files that hold them, front to back, in 1 MiB reads
  (what the same bytes cost without Mooncake: the target is a disk-tier get at 0.7x of it).
Both read through the page cache (the files were just written; nothing here drops caches).
Writes benchmarks/results/pool_disk.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

OBJ = 256 << 10
OBJECTS = 256
BATCH = 16
RESULTS = Path(__file__).resolve().parent / "results" / "pool_disk.json"


def _start_master(log: Path):
    from cluster.kv_pool_service import MasterConfig, free_port, master_binary, port_open

    config = MasterConfig("127.0.0.1", free_port(), free_port(), free_port(), offload=True)
    proc = subprocess.Popen(config.command(master_binary()), stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while not (port_open("127.0.0.1", config.rpc_port) and port_open("127.0.0.1", config.http_port)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mooncake_master did not start; see {log}")
        time.sleep(0.05)
    return config, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from kv_transfer.pool.mooncake_store import MooncakePoolStore
    from kv_transfer.pool.store import PoolSettings

    work = Path(tempfile.mkdtemp(prefix="bench-pool-disk-"))
    config, master = _start_master(work / "master.log")
    store = None
    try:
        settings = PoolSettings(master_address=f"127.0.0.1:{config.rpc_port}",
                                metadata_url=f"http://127.0.0.1:{config.http_port}/metadata",
                                segment_bytes=16 << 20, local_buffer_bytes=8 << 20,
                                disk_dir=str(work / "disk"), disk_bytes=1 << 30)
        store = MooncakePoolStore(settings, transfer_timeout_s=30.0)
        assert store.connect(30.0), "the pool client did not set up"
        data = np.random.default_rng(0).integers(0, 255, OBJECTS * OBJ, dtype=np.uint8)
        out = np.zeros_like(data)
        store.register_buffer(data.ctypes.data, data.nbytes)
        store.register_buffer(out.ctypes.data, out.nbytes)
        keys = [f"bench/{i}" for i in range(OBJECTS)]
        print(f"[bench] storing {OBJECTS} objects of 256 KiB into a 16 MiB segment with a disk tier", flush=True)
        for start in range(0, OBJECTS, BATCH):
            batch = keys[start:start + BATCH]
            while not all(store.put_from(batch, [data.ctypes.data + (start + i) * OBJ for i in range(len(batch))],
                                         [OBJ] * len(batch))):
                time.sleep(0.3)  # the segment is full until the next heartbeat demotes
        time.sleep(3.0)
        tiers = store.tiers_of(keys)
        on_disk = [i for i, tier in enumerate(tiers) if tier == "disk"]
        print(f"[bench] tiers: {tiers.count('memory')} in memory, {len(on_disk)} on disk, "
              f"{tiers.count('missing')} missing", flush=True)
        files = sorted(p for p in (work / "disk").rglob("*") if p.is_file())
        file_bytes = sum(p.stat().st_size for p in files)

        def disk_get() -> float:
            started = time.perf_counter()
            for start in range(0, len(on_disk), BATCH):
                chunk = on_disk[start:start + BATCH]
                codes = store.get_into([keys[i] for i in chunk], [out.ctypes.data + i * OBJ for i in chunk],
                                       [OBJ] * len(chunk))
                assert all(code == OBJ for code in codes), codes
            return time.perf_counter() - started

        def sequential() -> float:
            started = time.perf_counter()
            for path in files:
                with open(path, "rb", buffering=0) as handle:
                    while handle.read(1 << 20):
                        pass
            return time.perf_counter() - started

        disk_s, seq_s = [], []
        for _ in range(args.rounds):
            disk_s.append(disk_get())
            seq_s.append(sequential())
        for i in on_disk:
            assert np.array_equal(out[i * OBJ:(i + 1) * OBJ], data[i * OBJ:(i + 1) * OBJ]), f"object {i} differs"
        disk_mib = len(on_disk) * OBJ / 2**20
        row = {"objects_on_disk": len(on_disk), "disk_mib": disk_mib, "bucket_file_mib": file_bytes / 2**20,
               "disk_tier_get_s": statistics.median(disk_s), "sequential_read_s": statistics.median(seq_s),
               "disk_tier_mib_s": disk_mib / statistics.median(disk_s),
               "sequential_mib_s": file_bytes / 2**20 / statistics.median(seq_s), "rounds": args.rounds}
        row["ratio"] = row["disk_tier_mib_s"] / row["sequential_mib_s"]
        print(f"| what | MiB | median s | MiB/s |\n|---|---|---|---|\n"
              f"| disk tier get ({len(on_disk)} objects) | {disk_mib:.0f} | {row['disk_tier_get_s']:.3f} | "
              f"{row['disk_tier_mib_s']:.0f} |\n"
              f"| sequential read of its bucket files | {file_bytes / 2**20:.0f} | {row['sequential_read_s']:.3f} | "
              f"{row['sequential_mib_s']:.0f} |\n\ndisk tier / sequential read: {row['ratio']:.2f}x "
              f"(median of {args.rounds} rounds)")
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(row, indent=1))
    finally:
        if store is not None:
            store.close()
        master.kill()
        master.wait()


if __name__ == "__main__":
    main()
