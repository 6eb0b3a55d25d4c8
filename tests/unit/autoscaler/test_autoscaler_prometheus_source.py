"""PrometheusSource with a fake Prometheus API: which query feeds which observation field."""

from __future__ import annotations

from autoscaler.observations import NO_SAMPLES_AGE_S
from autoscaler.prometheus_source import PoolRef, PrometheusSource
from monitoring import queries as q
from monitoring.prometheus_api import PrometheusError, Sample


class FakeAPI:
    def __init__(self, values: dict[str, float | None], fail: bool = False):
        self.values, self.fail, self.asked = values, fail, []

    def query(self, expr):
        self.asked.append(expr)
        if self.fail:
            raise PrometheusError("unreachable")
        value = self.values.get(expr)
        return [] if value is None else [Sample({}, value)]


POOLS = [PoolRef("prefill", "prefill"), PoolRef("decode", "decode", ranks_per_replica=2)]


def test_each_pool_gets_its_own_signals():
    api = FakeAPI({q.ttft_p90("30s"): 2.5, q.itl_p90("30s"): 0.12, q.arrival_rps("30s"): 4.0,
                   q.kv_pull_latency("30s"): 0.003, q.pool_kv_usage("decode"): 0.4, q.pool_kv_usage("prefill"): 0.9,
                   q.pool_metrics_age("prefill"): 3.0, q.pool_metrics_age("decode"): 4.0,
                   q.pool_queued("prefill"): 5.0, q.pool_running("decode"): 7.0})
    prefill, decode = PrometheusSource(api, POOLS, window="30s").observe({"prefill": 1, "decode": 1}, {"decode": 1})
    assert (prefill.ttft_p90_s, prefill.itl_p90_s, prefill.queue_depth, prefill.kv_transfer_s) == (2.5, None, 5.0, None)
    assert (decode.ttft_p90_s, decode.itl_p90_s, decode.running, decode.kv_transfer_s) == (None, 0.12, 7.0, 0.003)
    # Prefill's cache holds prompts only until decode pulls them: its fullness is no decode signal.
    assert (prefill.kv_cache_usage, decode.kv_cache_usage) == (None, 0.4)
    assert decode.ranks_per_replica == 2 and decode.starting_replicas == 1
    assert prefill.arrival_rps == decode.arrival_rps == 4.0
    assert (prefill.metrics_age_s, decode.metrics_age_s) == (3.0, 4.0)


def test_a_pool_without_samples_is_stale_and_an_unreachable_prometheus_gives_none():
    observations = PrometheusSource(FakeAPI({}), POOLS).observe({"prefill": 1, "decode": 1})
    assert all(o.metrics_age_s == NO_SAMPLES_AGE_S for o in observations)
    assert PrometheusSource(FakeAPI({}, fail=True), POOLS).observe({"prefill": 1}) is None


def test_the_controller_holds_on_what_the_source_reports():
    from autoscaler.controller import CoordinatedController
    from autoscaler.observations import ControllerConfig, PoolLimits

    controller = CoordinatedController(ControllerConfig(ttft_slo_s=2.0, itl_slo_s=0.2, budget_units=8),
                                       [PoolLimits("prefill", 1, 4), PoolLimits("decode", 1, 4, 2.0)])
    stale = PrometheusSource(FakeAPI({}), POOLS).observe({"prefill": 1, "decode": 1})
    assert controller.decide(stale, 0.0).held
    down = PrometheusSource(FakeAPI({}, fail=True), POOLS).observe({"prefill": 1, "decode": 1})
    decisions = controller.decide(down, 10.0)
    assert decisions.held and decisions.targets() == {"prefill": 1, "decode": 1}
