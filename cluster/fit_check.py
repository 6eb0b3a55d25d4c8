"""Refuse, before anything starts, a manifest whose weights cannot fit its ranks: the same
arithmetic `moe-serve plan` prints, run by every deploy path (the CLI and the config-file
builder) so that a misfit fails with numbers and a fix rather than as replicas Serve restarts."""

from __future__ import annotations

from cluster.errors import ManifestError, ManifestIssue
from cluster.manifest import Manifest


def model_facts_for(manifest: Manifest):
    from cluster.checkpoints import resolve_model_path
    from cluster.model_facts import read_model_facts

    model = manifest.model
    return read_model_facts(resolve_model_path(model.path, build=False), model.dtype, model_name=model.name,
                            quantization=model.quantization)


def check_fit(manifest: Manifest) -> None:
    from cluster.plan import make_plan

    errors = make_plan(manifest, model_facts_for(manifest)).errors
    if errors:
        raise ManifestError(manifest.name, [ManifestIssue("pools", "", error, "see `moe-serve plan`") for error in errors])
