"""KV transport throughput against its floors: memcpy, a raw loopback TCP socket, our "tcp"
backend, and Mooncake's transfer engine (TCP protocol) when it is installed.

    .venv/bin/python -m benchmarks.bench_kv_transport --max-mib 256 --repeats 5

For each payload size every method is set up at once and the timed runs alternate between
methods (round-robin, `--repeats` rounds), so drift of this shared machine hits all alike;
the result is the median. A run repeats small payloads until it has moved >= 16 MiB so the
clock resolves them. Each method's bytes are checked against the source before timing.

- memcpy: numpy.copyto between two arrays.
- raw_tcp: one loopback connection, sender in a thread; a pull is a 1-byte request, then
  sendall of the payload into recv_into of the destination.
- ours_tcp: our backend, server in a thread, fetching 32 KiB pages (one CPU KV page of the
  tiny model) straight between page buffers, like a decode worker pulling a request's blocks.
- ours_mooncake: our "mooncake" backend the same way (server and client engines in this
  process): DESCRIBE over our TCP control connection, then one Mooncake batch read of the
  32 KiB pages; needs the Mooncake wheel, else an error row.
- mooncake_tcp: TransferEngine on the TCP protocol, reader and peer in two processes (driven
  through a pipe and timed inside the reader); any failure becomes an error row.

Writes benchmarks/results/kv_transport.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.kv_bench_lease import REQUEST_ID, bench_lease
from kv_transfer.transport import get_backend

RESULTS = Path(__file__).resolve().parent / "results"
KIB, MIB = 1024, 1024 * 1024
SIZES_BYTES = [64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB]
PAGE_BYTES = 32 * KIB
MIN_RUN_BYTES = 16 * MIB
METHODS = ["memcpy", "raw_tcp", "ours_tcp", "ours_mooncake", "mooncake_tcp"]

# A prepared method: run(ops) -> seconds for `ops` transfers of the payload; close().
Runner = tuple[Callable[[int], float], Callable[[], None]]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _payload(n_bytes: int) -> np.ndarray:
    return np.random.default_rng(n_bytes).integers(0, 256, n_bytes, dtype=np.uint8)


def _timed(op: Callable[[], object]) -> Callable[[int], float]:
    def run(ops: int) -> float:
        started = time.perf_counter()
        for _ in range(ops):
            op()
        return time.perf_counter() - started
    return run


def prepare_memcpy(src: np.ndarray, dst: np.ndarray) -> Runner:
    return _timed(lambda: np.copyto(dst, src)), lambda: None


def prepare_raw_tcp(src: np.ndarray, dst: np.ndarray) -> Runner:
    listener = socket.create_server(("127.0.0.1", 0))

    def sender():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while conn.recv(1) == b"g":
                conn.sendall(memoryview(src))

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view, n_bytes = memoryview(dst), dst.size

    def pull():
        sock.sendall(b"g")
        got = 0
        while got < n_bytes:
            got += sock.recv_into(view[got:])

    def close():
        sock.close()
        thread.join(5)
        listener.close()

    return _timed(pull), close


class _ArrayPages:
    """PageSource/PageSink over a [num_pages, PAGE_BYTES] uint8 array (one layer)."""

    def __init__(self, array: np.ndarray):
        self.array = array.reshape(-1, min(PAGE_BYTES, array.size))

    def regions(self) -> list[tuple[int, int]]:
        return [(self.array.ctypes.data, self.array.nbytes)]

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        return [memoryview(self.array[b]) for b in block_ids]


def prepare_ours(src: np.ndarray, dst: np.ndarray, backend_name: str = "tcp") -> Runner:
    source, sink = _ArrayPages(src), _ArrayPages(dst)
    block_ids = list(range(source.array.shape[0]))
    dest_pages = sink.pages(block_ids)
    backend = get_backend(backend_name)
    lease = bench_lease(len(block_ids))
    server = backend.server("127.0.0.1", 0, source, lambda rid: None, lambda: {},
                            leases=lease.leases, grant_key=lease.grant_key)
    server.start()
    client = backend.client()
    client.register_sink(sink)
    host, port = server.address

    def close():
        client.close()
        server.stop()

    return _timed(lambda: client.fetch(host, port, REQUEST_ID, block_ids, dest_pages, 60.0, lease.grant)), close


def prepare_ours_mooncake(src: np.ndarray, dst: np.ndarray) -> Runner:
    return prepare_ours(src, dst, "mooncake")


def _mooncake_peer(conn, n_bytes: int) -> None:
    """Holds the source buffer; reports (rpc_port, address), then waits to be told to exit."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    buf = _payload(n_bytes)
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0 or \
            engine.register_memory(buf.ctypes.data, n_bytes) != 0:
        conn.send(("error", "peer initialize/register_memory failed"))
        return
    conn.send(("ready", engine.get_rpc_port(), buf.ctypes.data))
    try:
        conn.recv()
    except EOFError:
        pass


def _mooncake_reader(conn, max_bytes: int) -> None:
    """Child process: sets up reader + peer, then serves ("run", n, ops) -> seconds | error."""
    ctx = mp.get_context("spawn")
    peer_conn, child_conn = ctx.Pipe()
    peer = None
    try:
        from mooncake.engine import TransferEngine

        peer = ctx.Process(target=_mooncake_peer, args=(child_conn, max_bytes))
        peer.start()
        if not peer_conn.poll(60):
            raise RuntimeError("peer did not report within 60 s")
        reply = peer_conn.recv()
        if reply[0] != "ready":
            raise RuntimeError(reply[1])
        _, rpc_port, remote_addr = reply
        engine = TransferEngine()
        dst = np.zeros(max_bytes, dtype=np.uint8)
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0 or \
                engine.register_memory(dst.ctypes.data, max_bytes) != 0:
            raise RuntimeError("reader initialize/register_memory failed")
        expected = _payload(max_bytes)  # what the peer holds
        conn.send(("ready",))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        if peer is not None:
            peer.kill()
        return
    try:
        while (command := conn.recv())[0] == "run":
            _, n, ops = command
            dst[:n] = 0

            def read():
                rc = engine.transfer_sync_read(f"127.0.0.1:{rpc_port}", dst.ctypes.data, remote_addr, n)
                if rc < 0:
                    raise RuntimeError(f"transfer_sync_read returned {rc}")
            try:
                seconds = _timed(read)(ops)
                ok = np.array_equal(dst[:n], expected[:n])
                conn.send(("ok", seconds) if ok else ("error", "bytes read differ from the peer's"))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except EOFError:
        pass  # the parent is gone
    finally:
        peer_conn.send("done")
        peer.join(10)
        if peer.is_alive():
            peer.kill()


class MooncakeHarness:
    """Parent-side handle on the reader process; every wait is bounded by `timeout_s`."""

    def __init__(self, max_bytes: int, timeout_s: float):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._timeout_s = timeout_s
        self._proc = ctx.Process(target=_mooncake_reader, args=(child_conn, max_bytes))
        self._proc.start()
        reply = self._wait()
        self.error: str | None = None if reply[0] == "ready" else reply[1]

    def _wait(self) -> tuple:
        if not self._conn.poll(self._timeout_s):
            self.close()
            raise RuntimeError(f"no answer from the Mooncake harness within {self._timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"Mooncake harness died (exit code {self._proc.exitcode})") from None

    def prepare(self, src: np.ndarray, dst: np.ndarray) -> Runner:
        def run(ops: int) -> float:
            self._conn.send(("run", src.size, ops))
            status, value = self._wait()
            if status != "ok":
                raise RuntimeError(value)
            return value
        return run, lambda: None

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()


def measure(n_bytes: int, preparers: dict[str, Callable | str], repeats: int) -> list[dict]:
    """One row per method; a preparer given as a string is that method's error."""
    src, dst = _payload(n_bytes), np.zeros(n_bytes, dtype=np.uint8)
    runners: dict[str, Runner] = {}
    errors = {name: prepare for name, prepare in preparers.items() if isinstance(prepare, str)}
    for name, prepare in preparers.items():
        if name in errors:
            continue
        try:
            runners[name] = prepare(src, dst)
            dst[:] = 0
            runners[name][0](1)  # warm-up, and the bytes check (Mooncake checks in its process)
            if name != "mooncake_tcp" and not np.array_equal(src, dst):
                raise RuntimeError("received bytes differ from the source")
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    ops = max(1, MIN_RUN_BYTES // n_bytes)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, (run, _) in runners.items():
            if name not in errors:
                try:
                    seconds[name].append(run(ops))
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {exc}"
    for _, close in runners.values():
        close()
    rows = []
    for name in preparers:
        if name in errors:
            rows.append({"payload_bytes": n_bytes, "method": name, "error": errors[name]})
        else:
            rows.append({"payload_bytes": n_bytes, "method": name,
                         "bytes_per_s": n_bytes * ops / statistics.median(seconds[name])})
    return rows


def _fmt_size(n_bytes: int) -> str:
    return f"{n_bytes // MIB} MiB" if n_bytes >= MIB else f"{n_bytes // KIB} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-mib", type=int, default=256, help="largest payload in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--mooncake-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    sizes = [n for n in SIZES_BYTES if n <= args.max_mib * MIB]

    preparers: dict[str, Callable | str] = {"memcpy": prepare_memcpy, "raw_tcp": prepare_raw_tcp,
                                      "ours_tcp": prepare_ours}
    mooncake = None
    if not args.no_mooncake:
        preparers["ours_mooncake"] = prepare_ours_mooncake
        _progress("starting the Mooncake harness (two processes) ...")
        try:
            mooncake = MooncakeHarness(max(sizes), args.mooncake_timeout_s)
            if mooncake.error:
                raise RuntimeError(mooncake.error)
            preparers["mooncake_tcp"] = mooncake.prepare
        except Exception as exc:
            preparers["mooncake_tcp"] = f"{type(exc).__name__}: {exc}"
    rows: list[dict] = []
    try:
        for n in sizes:
            _progress(f"{_fmt_size(n):>8}: {', '.join(preparers)} x {args.repeats} rounds ...")
            rows += measure(n, preparers, args.repeats)
    finally:
        if mooncake is not None:
            mooncake.close()

    floor = {(r["payload_bytes"], r["method"]): r.get("bytes_per_s") for r in rows}
    print(f"{'payload':>8}  {'method':<13} {'GB/s':>7} {'ms/op':>9} {'x memcpy':>9} {'x raw TCP':>9}")
    for r in rows:
        rate = r.get("bytes_per_s")
        if rate is None:
            print(f"{_fmt_size(r['payload_bytes']):>8}  {r['method']:<13} error: {r['error']}")
            continue
        r["ms_per_op"] = r["payload_bytes"] / rate * 1e3
        base = [floor.get((r["payload_bytes"], m)) for m in ("memcpy", "raw_tcp")]
        r["vs_memcpy"], r["vs_raw_tcp"] = (rate / b if b else None for b in base)
        ratios = " ".join(f"{x:9.3f}" if x is not None else f"{'-':>9}" for x in (r["vs_memcpy"], r["vs_raw_tcp"]))
        print(f"{_fmt_size(r['payload_bytes']):>8}  {r['method']:<13} {rate / 1e9:7.2f} {r['ms_per_op']:9.3f} {ratios}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "kv_transport.json"
    out.write_text(json.dumps({
        "config": {"max_mib": args.max_mib, "repeats": args.repeats, "page_bytes": PAGE_BYTES,
                   "min_run_bytes": MIN_RUN_BYTES},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "results": rows,
    }, indent=2) + "\n")
    _progress(f"wrote {out}")


if __name__ == "__main__":
    main()
