"""Registry of KV transport backends: one backend per module, chosen by name.

    backend = get_backend("tcp")
    server = backend.server_cls(host, 0, source, on_release, on_stats)
    client = backend.client_cls()

Built-in backends are imported on first use, so a backend whose dependency is missing (the
Mooncake wheel for "mooncake") only fails when someone asks for it by name.
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from kv_transfer.errors import UnknownBackendError
from kv_transfer.transport.base import TransportBackend

_B = TypeVar("_B", bound=type[TransportBackend])

_REGISTRY: dict[str, type[TransportBackend]] = {}
# name -> module that registers it when imported
_BUILTIN_MODULES = {"tcp": "kv_transfer.transport.tcp",
                    "mooncake": "kv_transfer.transport.mooncake"}


def register_backend(name: str) -> Callable[[_B], _B]:
    """Class decorator: make the TransportBackend subclass available as `name`."""

    def register(cls: _B) -> _B:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"KV transport backend {name!r} is already registered by {existing!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def known_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def get_backend(name: str) -> type[TransportBackend]:
    """The backend registered as `name`; UnknownBackendError lists the known names."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownBackendError(name, known_backends()) from None
