"""Error types of the cluster package: each carries what failed and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ManifestIssue:
    """One problem in a manifest: where, what was found, and what to do about it."""

    field: str  # dotted path, e.g. "pools[0].replicas"
    value: object
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem} (got {self.value!r}). Fix: {self.fix}"


class ManifestError(ValueError):
    """A manifest that cannot run. Raised before anything starts."""

    def __init__(self, source: str, issues: list[ManifestIssue]):
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  - {issue}" for issue in issues)
        super().__init__(f"invalid manifest {source}:\n{lines}")


class ClusterError(RuntimeError):
    """The local cluster could not be started, reached or stopped."""
