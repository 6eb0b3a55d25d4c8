"""Manifest loading: YAML text -> validated Manifest, with every problem as a ManifestIssue.

Pydantic reports errors by location tuples and its own messages; users need the dotted field,
the value they wrote and what to do. The schema's field docstrings supply the "what to do".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from cluster.errors import ManifestError, ManifestIssue

if TYPE_CHECKING:
    from cluster.manifest import Manifest

# cluster.manifest re-exports this module's functions, so its names are imported where used.


def parse_manifest(data: Any, source: str = "<manifest>") -> "Manifest":
    from cluster.manifest import Manifest

    if not isinstance(data, dict):
        raise ManifestError(source, [ManifestIssue(
            "<top level>", type(data).__name__, "the manifest must be a mapping", "start from manifests/local.yaml")])
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, _issues_from(exc)) from None


def load_manifest(path: str | Path) -> "Manifest":
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(str(path), [ManifestIssue(
            "<file>", str(path), f"cannot read: {exc.strerror}", "pass the path of a manifest YAML file")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise ManifestError(str(path), [ManifestIssue(
            "<yaml>", where, f"not valid YAML: {getattr(exc, 'problem', exc)}", "fix the YAML syntax there")]) from None
    return parse_manifest(data, str(path))


def _issues_from(exc: ValidationError) -> list[ManifestIssue]:
    from cluster.manifest import _ConsistencyError

    issues: list[ManifestIssue] = []
    for error in exc.errors():
        context = error.get("ctx", {}).get("error")
        if isinstance(context, _ConsistencyError):
            issues.extend(context.issues)
            continue
        loc = error["loc"]
        field = _dotted(loc)
        if error["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = ", ".join(sorted(parent.model_fields)) if parent else "see manifests/local.yaml"
            issues.append(ManifestIssue(field, error["input"], "unknown field", f"remove it or use one of: {known}"))
            continue
        if error["type"] == "missing":
            issues.append(ManifestIssue(field, None, "required field is missing", _describe(loc) or "add it"))
            continue
        issues.append(ManifestIssue(field, error.get("input"), error["msg"], _describe(loc) or "see manifests/local.yaml"))
    return issues


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """Walk the schema along a pydantic error location to the model that owns the last key."""
    from cluster.manifest import Manifest

    model: Any = Manifest
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in get_args(arg):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _describe(loc: tuple) -> str | None:
    parent = _model_at(loc[:-1])
    if parent is None or not loc or isinstance(loc[-1], int):
        return None
    field = parent.model_fields.get(loc[-1])
    return " ".join(field.description.split()) if field and field.description else None
