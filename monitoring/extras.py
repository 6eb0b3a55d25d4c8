"""Parts of monitoring/ whose libraries come with a pyproject extra rather than the base install:
the dashboard generator (`dashboards`: grafana-foundation-sdk) and `moe-serve report`
(`report`: matplotlib). Without the extra they fail with this error, which names it."""

from __future__ import annotations


class MissingExtraError(ImportError):
    """A feature's library is not installed; the message names the extra that installs it."""

    def __init__(self, feature: str, extra: str, distribution: str):
        self.feature = feature
        self.extra = extra
        self.distribution = distribution
        super().__init__(f"{feature} needs {distribution}, which moe-serve's `{extra}` extra installs: "
                         f"pip install -e '.[{extra}]' (scripts/setup.sh installs it)")
