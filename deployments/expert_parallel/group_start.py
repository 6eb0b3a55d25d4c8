"""Starting an expert-parallel group: rank 0 is built while the other ranks' starts are watched
(deployments/expert_parallel/expert_group.py uses it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def start_local_rank(build: Callable[[], Any], remote_start_failure: Callable[[], str | None],
                     poll_s: float = 1.0) -> Any:
    """Build rank 0's server while watching the other ranks start. Rank 0's engine waits in its
    constructor until every rank has joined (vLLM waits for its DP coordinator's READY without a
    bound): a rank whose engine failed to start (CI: its KV port was taken) left the replica
    STARTING for good. Rank 0 is therefore built on a thread, and the group's constructor raises
    as soon as another rank's start failed, so that Serve replaces the replica (its processes go
    with it: cluster/ray_node_env.py)."""
    import threading

    built: dict[str, Any] = {}

    def run() -> None:
        try:
            built["server"] = build()
        except BaseException as exc:  # re-raised on the constructor's thread below
            built["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="ep-rank0-start")
    thread.start()
    while True:
        thread.join(poll_s)
        if not thread.is_alive():
            break
        failure = remote_start_failure()
        if failure:
            raise RuntimeError(f"expert-parallel group could not start: {failure}")
    if "error" in built:
        raise built["error"]
    return built["server"]


def ray_start_failure(actors: list) -> Callable[[], str | None]:
    """For rank actors: the first whose constructor raised, described; None while none has."""
    if not actors or not all(hasattr(actor, "__ray_ready__") for actor in actors):
        return lambda: None  # not Ray actors (tests' fakes): nothing to watch
    import ray

    ready = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(actors, start=1)}

    def failure() -> str | None:
        done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:
                return f"rank {ready[ref]} failed to start: {type(exc).__name__}: {str(exc)[-600:]}"
        return None

    return failure
