"""The exposition parser the integration tests read Ray's metrics endpoints with."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tests.metrics_text import samples


def test_finds_samples_by_exposed_name_and_labels_as_a_scrape_shows_them():
    registry = CollectorRegistry()
    tokens = Counter("ray_moe_serve_expert_routed_tokens", "tokens", ("pool", "rank", "expert"), registry=registry)
    tokens.labels("decode", "0", "3").inc(5)
    tokens.labels("decode", "1", "4").inc(2)
    tokens.labels("prefill", "0", "3").inc(7)
    holding = Gauge("ray_moe_serve_autoscaler_holding", "holding", ("reason",), registry=registry)
    holding.labels('stale "pool", decode').set(1)  # quotes and commas inside a value
    text = generate_latest(registry).decode()

    decode = samples(text, "ray_moe_serve_expert_routed_tokens_total", pool="decode")
    assert sorted((s.labels["rank"], s.labels["expert"], s.value) for s in decode) == [("0", "3", 5.0), ("1", "4", 2.0)]
    assert samples(text, "ray_moe_serve_expert_routed_tokens", pool="decode") == []  # the family name is not a series
    [held] = samples(text, "ray_moe_serve_autoscaler_holding")
    assert held.labels == {"reason": 'stale "pool", decode'} and held.value == 1.0
    assert samples(text, "ray_moe_serve_autoscaler_holding", reason="unreachable") == []
