"""Every engine server and engine client implements its Protocol (deployments/engine_client.py):
the same methods, each as a coroutine or an async generator where the Protocol has one, and
accepting the Protocol's arguments."""

from __future__ import annotations

import inspect

import pytest

from deployments.disagg_client import DisaggregatedEngineClient
from deployments.engine.llm_server import LLMServer
from deployments.engine_client import EngineClient, EngineServer, HandleEngineClient
from deployments.expert_parallel.expert_group import ExpertParallelGroup


def _members(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if callable(fn) and not name.startswith("_")}


def _streams(fn) -> bool:
    """An async generator, or a plain function returning one (a stream)."""
    return inspect.isasyncgenfunction(fn) or not inspect.iscoroutinefunction(fn)


@pytest.mark.parametrize("implementation, protocol", [
    (LLMServer, EngineServer), (ExpertParallelGroup, EngineServer),
    (HandleEngineClient, EngineClient), (DisaggregatedEngineClient, EngineClient)])
def test_implementations_match_their_protocol(implementation, protocol):
    for name, expected in _members(protocol).items():
        method = getattr(implementation, name, None)
        assert method is not None, f"{implementation.__name__} lacks {name}"
        declared = getattr(protocol, name)
        if inspect.iscoroutinefunction(declared):
            assert inspect.iscoroutinefunction(method), f"{implementation.__name__}.{name} must be async"
        else:
            assert _streams(method), f"{implementation.__name__}.{name} must return a stream"
        parameters = inspect.signature(method).parameters
        for parameter in list(expected.parameters.values())[1:]:  # self aside
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                continue  # options the implementation may define as keywords
            assert parameter.name in parameters, f"{implementation.__name__}.{name} lacks {parameter.name}"
