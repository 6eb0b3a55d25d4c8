"""Error types of the autoscaler package: each says what is wrong and how to fix it."""

from __future__ import annotations


class AutoscalerConfigError(ValueError):
    """A controller, pool limit or simulation setting that cannot work. Raised at construction."""

    def __init__(self, field: str, value: object, problem: str, fix: str):
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem} (got {value!r}). Fix: {fix}")
