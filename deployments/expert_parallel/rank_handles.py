"""How an expert-parallel group reaches its ranks: rank 0 in the group's own process, ranks
1..N-1 as Ray actors pinned to the replica's placement-group bundles, behind one interface
(`LocalRank`, `RemoteRank`), so the group (expert_group.py) never cares which is which."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.engine.llm_server import LLMServer
from deployments.records import EngineRequest


class LocalRank:
    def __init__(self, server: Any):
        self._server = server

    def generate(self, request: EngineRequest) -> AsyncIterator:
        return self._server.generate(request)

    async def prefill(self, request):
        return await self._server.prefill(request)

    async def stats(self):
        return await self._server.stats()

    async def routed_tokens_per_expert(self):
        return await self._server.routed_tokens_per_expert()

    async def placement(self):
        return await self._server.placement()

    async def check_health(self) -> None:
        await self._server.check_health()

    async def record_routing_stats(self) -> dict:
        return self._server.record_routing_stats()

    def shutdown_engine(self) -> None:
        self._server.shutdown_engine()


class RemoteRank:
    """A rank actor seen through the same interface; its streams are Ray streaming generators."""

    def __init__(self, actor: Any, cancel: Callable[[Any], None]):
        self._actor = actor
        self._cancel = cancel

    async def generate(self, request: EngineRequest) -> AsyncIterator:
        refs = self._actor.generate.remote(request)
        finished = False
        try:
            async for ref in refs:
                yield await ref
            finished = True
        finally:
            if not finished:  # the caller left: cancel, so the rank aborts it in its engine
                self._cancel(refs)
                # A cancel that lands while the rank's stream sits between items (or has not
                # started) never reaches its generate(): abort by id as well, which the rank
                # remembers for a request it has not added yet. Fire and forget: the rank may be dead.
                self._actor.abort.remote(request.request_id)

    async def prefill(self, request):
        return await self._actor.prefill.remote(request)

    async def stats(self):
        return await self._actor.stats.remote()

    async def routed_tokens_per_expert(self):
        return await self._actor.routed_tokens_per_expert.remote()

    async def placement(self):
        return await self._actor.placement.remote()

    async def check_health(self) -> None:
        await self._actor.check_health.remote()

    async def record_routing_stats(self) -> dict:
        return await self._actor.record_routing_stats.remote()

    def shutdown_engine(self) -> None:
        self._actor.shutdown_engine.remote()  # fire and forget: the actor may be dead already

    async def wait_forever(self):
        return await self._actor.wait_forever.remote()


def ray_cancel(refs: Any) -> None:
    import ray

    ray.cancel(refs)


def ray_rank_factory(rank_options: dict) -> Callable[..., Any]:
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("an expert-parallel replica must run in a placement group (see deployments/builder.py)")
    actor_cls = ray.remote(LLMServer)

    def start(rank: int, model: dict, engine: dict, model_path: str, kv_transfer: dict | None, **server_kwargs):
        return actor_cls.options(
            name=None, max_concurrency=10_000, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            **rank_options,
        ).remote(model, engine, model_path, kv_transfer, rank=rank, **server_kwargs)

    return start


async def close_stream(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (Exception, asyncio.CancelledError):  # already closed or the rank is gone
            pass
