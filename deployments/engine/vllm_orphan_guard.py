"""Engine processes that outlive their parent exit (a vLLM general plugin, loaded in every
vLLM process: the front end, the engine core and the workers).

vLLM starts its engine core and workers as child processes. When Ray kills a replica or a rank
actor outright (a failed health check, a dead peer rank, `ray stop`), those children are not
told: a worker waiting in a collective for a peer that is gone waits forever, holding memory
and a core. Each process therefore remembers its parent and exits once it has been re-parented
(its parent died). Registered in pyproject.toml under `vllm.general_plugins`.
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

CHECK_PERIOD_S = 1.0
_installed = False


def install() -> None:
    """Start the watcher once per process (vLLM may load plugins more than once)."""
    global _installed
    if _installed:
        return
    _installed = True
    parent = os.getppid()
    if parent == 1:  # started by init (a container's main process): nothing to watch
        return
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="moe-serve-orphan-guard").start()


def _watch(parent: int) -> None:
    while True:
        time.sleep(CHECK_PERIOD_S)
        if os.getppid() != parent:
            logger.warning("parent process %d is gone; exiting this orphaned vLLM process %d", parent, os.getpid())
            os._exit(1)  # no clean-up can run: what it would release belonged to the dead parent
