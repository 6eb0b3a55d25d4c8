"""The one adapter to Prometheus's HTTP API (instant and range queries, rules, alerts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class PrometheusError(RuntimeError):
    """Prometheus unreachable, or it rejected a query (the message says which)."""


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class RangeSeries:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix seconds, value)


class PrometheusAPI:
    def __init__(self, base_url: str, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(timeout=timeout_s)

    def query(self, expr: str, at_s: float | None = None) -> list[Sample]:
        params: dict[str, Any] = {"query": expr}
        if at_s is not None:
            params["time"] = at_s
        data = self._get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        return [Sample(item["metric"], float(item["value"][1])) for item in data["result"]]

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[RangeSeries]:
        data = self._get("/api/v1/query_range", {"query": expr, "start": start_s, "end": end_s, "step": step_s})
        return [RangeSeries(item["metric"], [(float(t), float(v)) for t, v in item["values"]])
                for item in data["result"]]

    def alerts(self) -> list[dict]:
        return self._get("/api/v1/alerts", {})["alerts"]

    def ready(self) -> bool:
        try:
            return self._client.get(f"{self.base_url}/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _get(self, path: str, params: dict) -> Any:
        try:
            response = self._client.get(f"{self.base_url}{path}", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"Prometheus at {self.base_url} unreachable: {exc}") from exc
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{path} {params.get('query', '')!r}: {body.get('error', response.text[:300])}")
        return body["data"]

    def close(self) -> None:
        self._client.close()
