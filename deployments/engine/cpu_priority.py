"""On CPU nodes the engines yield the cores to the request path.

There the engines' forward passes, the HTTP front (HAProxy or Serve's proxy) and the OpenAI
ingress share the same cores. Ray starts every worker at niceness 15, so all of them compete
as equals, and whenever the cores are busy a 429, a routing decision or a streamed token waits
behind a forward pass. Measured at three times the sustainable rate, side by side on the same
engines (BENCHMARKS.md 9e): the 429s' p99 was 105 ms with the engines at Ray's niceness and
32 ms with them at 19, with the same admitted rate (18.0 vs 17.9/s) and TTFT SLO attainment
(99%). Niceness only matters when the cores are contended: an idle request path leaves the
engines every cycle.

So an engine on the CPU platform runs at niceness 19 unless the manifest's `engine.nice` says
otherwise; GPU engines keep Ray's (their CPU work is the loop that keeps the GPU fed).

Linux keeps a nice value per thread, and a new thread or process inherits its creator's. So
every thread of the engine's process is set before vLLM starts its engine-core and worker
processes, which then inherit it with every thread they create.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CPU_ENGINE_NICENESS = 19  # the lowest priority: below Ray's workers (15), hence below the request path


def engine_niceness(requested: int | None, on_cpu: bool) -> int | None:
    """The niceness an engine's processes run at; None leaves Ray's."""
    if requested is not None:
        return requested
    return CPU_ENGINE_NICENESS if on_cpu else None


def set_process_niceness(niceness: int | None, tasks_dir: str = "/proc/self/task") -> int:
    """Set every thread of this process to `niceness`; how many threads changed. Lowering the
    niceness (a higher priority) needs CAP_SYS_NICE: without it the engine keeps its own and says so."""
    if niceness is None:
        return 0
    try:
        thread_ids = [int(name) for name in os.listdir(tasks_dir)]
    except OSError:  # no /proc (not Linux): the process's own value is all there is
        thread_ids = [0]
    changed = 0
    for thread_id in thread_ids:
        try:
            if os.getpriority(os.PRIO_PROCESS, thread_id) != niceness:
                os.setpriority(os.PRIO_PROCESS, thread_id, niceness)
                changed += 1
        except PermissionError:
            logger.warning("engine: staying at niceness %d; %d needs CAP_SYS_NICE",
                           os.getpriority(os.PRIO_PROCESS, thread_id), niceness)
            return changed
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return changed
