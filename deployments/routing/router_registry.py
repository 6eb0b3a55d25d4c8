"""This process's request routers, by pool name: how the disaggregated client finds the decode
pool's router to ask it for a decision before the prefill runs.

A module of its own on purpose: Ray Serve pickles a request router's module *by value* (with
every global its methods reference) whenever it serializes the deployment config, so a registry
of live routers (which hold locks) must not be a global of serve_router.py.
"""

from __future__ import annotations

from typing import Any

_ROUTERS: dict[str, Any] = {}  # pool name -> the PolicyRequestRouter of that pool in this process


def register(pool: str, router: Any) -> None:
    _ROUTERS[pool] = router


def router_for(pool: str) -> Any | None:
    """This process's router for `pool`, once its handle has routed a first call."""
    return _ROUTERS.get(pool)
