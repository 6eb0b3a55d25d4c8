"""Variables every Ray node of a moe-serve cluster starts with, wherever it runs (`moe-serve
up`'s local nodes, the test cluster, KubeRay pods).

Engine replicas and expert-parallel ranks are Ray actors whose vLLM engines start child
processes (the engine core, its workers, the data-parallel coordinator of an EP group). When Ray
kills an actor outright (a failed health check, a dead peer rank, a node drained), nothing in
the actor runs to stop them: a leftover coordinator holds ~0.5 GiB and a leftover worker a core
and its KV cache, on a node the replacement replica needs. Our vLLM plugin makes the engine
processes that load plugins exit once orphaned (deployments/engine/vllm_orphan_guard.py); the DP
coordinator does not load plugins. Ray's per-worker process groups cover every child: each
worker process starts in its own process group, and the raylet kills that group when the worker
exits, however it exits (measured here: a child of a SIGKILLed actor is gone within a second).
Ray 2.60 documents the setting as off by default; we set it so that the behaviour does not
depend on a default. Processes that call setsid() leave the group; none of vLLM's do.
"""

from __future__ import annotations

NODE_ENVIRONMENT: dict[str, str] = {
    # Read by the raylet when it starts (Ray 2.60; default off).
    "RAY_process_group_cleanup_enabled": "1",
}
