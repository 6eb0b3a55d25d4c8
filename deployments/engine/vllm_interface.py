"""Lookups of the vLLM internals our patches rely on, failing with the file to update.

Our worker extensions patch private vLLM functions; when a vLLM upgrade renames one, the engine
must refuse to start with an error that names the symbol and the module of ours that needs the
update, not fail later inside a forward pass."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any


def vllm_symbol(module_name: str, name: str, owner: str) -> Any:
    """`module_name.name`, or RuntimeError naming it and `owner` (our file that needs it)."""
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"moe-serve needs {module_name}.{name}, which this vLLM does not have "
            f"({exc}); update {owner} for this vLLM version"
        ) from exc


def require_params(fn: Callable, qualname: str, names: Sequence[str], owner: str) -> inspect.Signature:
    """`fn`'s signature, or RuntimeError when one of `names` is no longer a parameter of it."""
    signature = inspect.signature(fn)
    missing = [n for n in names if n not in signature.parameters]
    if missing:
        raise RuntimeError(
            f"moe-serve relies on parameters {missing} of {qualname}, but its "
            f"signature is now {signature}; update {owner}"
        )
    return signature
