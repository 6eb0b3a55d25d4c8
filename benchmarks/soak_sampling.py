"""The soak's memory sampler: the resident memory of every process of the stack on this machine
(Ray workers and replicas, vLLM engine processes, raylets, GCS, the Mooncake master), in total,
outside preallocated arenas and by kind of mapping, every few seconds on a thread of its own.
What the samples mean is soak_analysis.py's job."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from benchmarks.soak_analysis import Sample, rss_by_kind, rss_outside_arenas


def stack_processes() -> tuple[dict, dict, dict]:
    """pid -> (label, resident bytes) of every process the stack runs on this machine, the same
    outside preallocated arenas (soak_analysis.rss_outside_arenas), and pid -> (label, resident
    bytes by kind of mapping) (soak_analysis.rss_by_kind)."""
    import psutil

    out, outside, kinds = {}, {}, {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "memory_info"]):
        info = proc.info
        cmdline = info.get("cmdline") or []
        name = info.get("name") or ""
        title = cmdline[0] if cmdline else name
        if title.startswith("ray::") or name.startswith("VLLM") or name in ("raylet", "gcs_server", "mooncake_master"):
            label = title.split(".", 1)[0] if title.startswith("ray::") else (name if not title.startswith("/") else
                                                                               Path(title).name)
            if info.get("memory_info") is None:
                continue
            try:
                smaps = Path(f"/proc/{info['pid']}/smaps").read_text()
            except OSError:  # exited while we looked
                continue
            rest, _arenas = rss_outside_arenas(smaps)
            out[info["pid"]] = (label[:60], info["memory_info"].rss)
            outside[info["pid"]] = (label[:60], rest)
            kinds[info["pid"]] = (label[:60], rss_by_kind(smaps))
    return out, outside, kinds


class Sampler:
    def __init__(self, every_s: float):
        self.every_s, self.samples, self.samples_outside_arenas = every_s, [], []
        self.samples_by_kind: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            total, outside, kinds = stack_processes()
            self.samples.append(Sample(now, total))
            self.samples_outside_arenas.append(Sample(now, outside))
            self.samples_by_kind.append((now, kinds))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
