"""Variables every Ray node of a moe-serve cluster starts with, wherever it runs (`moe-serve
up`'s local nodes, the test cluster, KubeRay pods).

Engine replicas and expert-parallel ranks are Ray actors whose vLLM engines start child
processes (the engine core, its workers, the data-parallel coordinator of an EP group). When Ray
kills an actor outright (a failed health check, a dead peer rank, a node drained), nothing in
the actor runs to stop them: a leftover coordinator holds ~0.5 GiB and a leftover worker a core
and its KV cache, on a node the replacement replica needs. Our vLLM plugin makes most engine
processes exit once orphaned (deployments/engine/vllm_orphan_guard.py), but vLLM starts some
without loading plugins (the DP coordinator). Ray's per-worker process groups close the gap at
the source: each worker process starts in its own process group, and the raylet kills that group
when the worker exits, however it exits. Processes that call setsid() leave the group; none of
vLLM's do.
"""

from __future__ import annotations

NODE_ENVIRONMENT: dict[str, str] = {
    # Read by the raylet when it starts (Ray 2.60; default off).
    "RAY_process_group_cleanup_enabled": "1",
}
