"""The PromQL moe-serve's dashboards, alert rules, `moe-serve report` and the autoscaler use.

Every expression is built from the metric catalogue (monitoring/metrics.py), so a query can
only name an exported metric; the integration test evaluates every one of them against a real
Prometheus scraping a real stack and requires data from each.

Names as scraped: Ray's metrics agent prefixes every application metric with `ray_`; vLLM's
Ray stat logger records `vllm:*` metrics through the same pipeline (`:` becomes `_`).
"""

from __future__ import annotations

from dataclasses import dataclass

from monitoring import metrics as m

RAY_PREFIX = "ray_"
RATE_WINDOW = "1m"


def series(metric: m.MetricDef, suffix: str = "") -> str:
    """The scraped series name of a catalogue metric (suffix: _bucket, _sum, _count)."""
    return f"{RAY_PREFIX}{metric.name}{suffix}"


def quantile(q: float, metric: m.MetricDef, window: str = RATE_WINDOW, by: str = "") -> str:
    keys = ", ".join(["le", *filter(None, by.split(","))])
    return f"histogram_quantile({q}, sum by ({keys}) (rate({series(metric, '_bucket')}[{window}])))"


def recent_increase(selector: str, window: str = "10m") -> str:
    """How much a counter grew within `window`, counting a series born inside the window from 0.

    `increase()` needs two samples, so it misses the first increment of a series that only
    appears when something first happens (Ray cannot export a counter at 0): a first KV
    failure would never alert. A series absent `window` ago is taken at its current value.
    """
    return f"clamp_min(({selector} - {selector} offset {window}) or {selector}, 0)"


def held(selector: str, window: str = "30s") -> str:
    """Each series' latest sample within `window`, for gauges that leave their endpoint now and then.

    vLLM's engine gauges (requests running and waiting, KV cache usage), recorded through Ray's
    metrics agent, vanish from a node's metrics endpoint for ~10 s at a time, about every 30 s
    (measured on a local cluster, idle or serving): an instant query in such a gap finds no
    series and the panel blinks to "no data". Holding the last sample for 30 s (six scrapes)
    bridges the gaps; a series that is gone for good leaves the panel 30 s later.
    """
    return f"last_over_time({selector}[{window}])"


@dataclass(frozen=True)
class Query:
    key: str
    expr: str
    legend: str  # Grafana legend format
    unit: str  # Grafana unit id: s, reqps, Bps, short, percentunit, ...
    title: str


# -- overview -----------------------------------------------------------------------------------
REQUEST_RATE = Query("request_rate", f"sum by (outcome) (rate({series(m.REQUESTS)}[{RATE_WINDOW}]))",
                     "{{outcome}}", "reqps", "Requests by outcome")
TTFT_P50 = Query("ttft_p50", quantile(0.5, m.TTFT), "p50", "s", "Time to first token")
TTFT_P90 = Query("ttft_p90", quantile(0.9, m.TTFT), "p90", "s", "Time to first token")
TTFT_P99 = Query("ttft_p99", quantile(0.99, m.TTFT), "p99", "s", "Time to first token")
TPOT_P50 = Query("tpot_p50", quantile(0.5, m.TPOT), "p50", "s", "Inter-token latency (per request mean)")
TPOT_P90 = Query("tpot_p90", quantile(0.9, m.TPOT), "p90", "s", "Inter-token latency (per request mean)")
TPOT_P99 = Query("tpot_p99", quantile(0.99, m.TPOT), "p99", "s", "Inter-token latency (per request mean)")
E2E_P50 = Query("e2e_p50", quantile(0.5, m.REQUEST_E2E), "p50", "s", "End-to-end latency")
E2E_P99 = Query("e2e_p99", quantile(0.99, m.REQUEST_E2E), "p99", "s", "End-to-end latency")
GOODPUT = Query("goodput", f"sum(rate({series(m.SLO_MET)}[{RATE_WINDOW}]))", "within SLO", "reqps",
                "Goodput (requests meeting TTFT and ITL targets)")
SLO_ATTAINMENT = Query(
    "slo_attainment",
    f"sum(rate({series(m.SLO_MET)}[5m])) / sum(rate({series(m.REQUESTS)}{{outcome=\"ok\"}}[5m]))",
    "attainment", "percentunit", "SLO attainment (share of successful requests within SLO)")
TOKEN_RATE = Query("token_rate", f"sum(rate({series(m.GENERATION_TOKENS)}[{RATE_WINDOW}]))", "generated",
                   "short", "Generated tokens per second")
PHASE_MEAN = Query(
    "phase_mean",
    f"sum by (phase) (rate({series(m.REQUEST_PHASE_TIME)}[{RATE_WINDOW}])) / "
    f"scalar(sum(rate({series(m.REQUESTS)}{{outcome=\"ok\"}}[{RATE_WINDOW}])))",
    "{{phase}}", "s", "Where a request's time goes (mean seconds per phase)")
PHASE_P90 = Query("phase_p90", quantile(0.9, m.REQUEST_PHASE, by="phase"), "{{phase}}", "s",
                  "Request phases, p90")

# -- pools ----------------------------------------------------------------------------------------
IN_FLIGHT = Query("in_flight", f"sum by (pool, rank) ({series(m.ENGINE_IN_FLIGHT)})", "{{pool}} rank {{rank}}",
                  "short", "Requests in flight per engine (rank)")
REPLICAS_HEALTHY = Query("replicas_healthy",
                         "sum by (deployment) (ray_serve_deployment_replica_healthy)",
                         "{{deployment}}", "short", "Healthy Serve replicas per deployment")
SERVE_QUEUED = Query("serve_queued", "sum by (deployment) (ray_serve_deployment_queued_queries)",
                     "{{deployment}}", "short", "Requests queued at Serve handles")
ENGINE_RUNNING = Query("engine_running", f"sum by (model_name) ({held('ray_vllm_num_requests_running')})",
                       "running", "short", "vLLM requests running")
ENGINE_WAITING = Query("engine_waiting", f"sum by (model_name) ({held('ray_vllm_num_requests_waiting')})",
                       "waiting", "short", "vLLM requests waiting")
KV_CACHE_USAGE = Query("kv_cache_usage", f"max by (ReplicaId) ({held('ray_vllm_kv_cache_usage_perc')})",
                       "{{ReplicaId}}", "percentunit", "vLLM KV cache usage per engine")
REPLICA_STARTS = Query("replica_starts",
                       f"sum by (deployment) ({recent_increase('ray_serve_deployment_replica_starts_total')})",
                       "{{deployment}}", "short", "Replica starts in the last 10 minutes")

# -- routing -------------------------------------------------------------------------------------
PROMPT_CACHE_HIT = Query(
    "prompt_cache_hit",
    f"sum(rate({series(m.PROMPT_CACHED_TOKENS)}[{RATE_WINDOW}])) / sum(rate({series(m.PROMPT_TOKENS)}[{RATE_WINDOW}]))",
    "served from cache", "percentunit", "Share of prompt tokens the engines did not compute")
ROUTER_EXPECTED_HIT = Query(
    "router_expected_hit",
    f"sum by (pool) (rate({series(m.ROUTING_PROMPT_BLOCKS)}{{kind=\"expected_hit\"}}[{RATE_WINDOW}])) / "
    f"sum by (pool) (rate({series(m.ROUTING_PROMPT_BLOCKS)}{{kind=\"routed\"}}[{RATE_WINDOW}]))",
    "{{pool}} expected by the router", "percentunit", "Share of prompt blocks the router expected to hit")
ROUTING_DECISION_RATE = Query(
    "routing_decisions", f"sum by (pool, reason) (rate({series(m.ROUTING_DECISIONS)}[{RATE_WINDOW}]))",
    "{{pool}} {{reason}}", "reqps", "Routing decisions by reason")
ADMISSION_REJECTIONS = Query(
    "admission_rejections",
    f"sum(rate({series(m.REQUESTS)}{{outcome=\"rejected\"}}[{RATE_WINDOW}])) or vector(0)",  # none yet: 0
    "429 rejected", "reqps", "Requests rejected by admission control")

# -- KV pool --------------------------------------------------------------------------------------
KV_POOL_HIT_RATE = Query(
    "kv_pool_hit_rate",
    f"sum by (pool) (rate({series(m.KV_POOL_LOOKUP_BLOCKS)}{{outcome=\"hit\"}}[{RATE_WINDOW}])) / "
    f"sum by (pool) (rate({series(m.KV_POOL_LOOKUP_BLOCKS)}[{RATE_WINDOW}]))",
    "{{pool}}", "percentunit", "KV pool hit rate (blocks looked up after the engine's own cache)")
KV_POOL_BANDWIDTH = Query("kv_pool_bandwidth", f"sum by (pool, op) (rate({series(m.KV_POOL_BYTES)}[{RATE_WINDOW}]))",
                          "{{pool}} {{op}}", "Bps", "KV pool bytes loaded and stored per second")
KV_POOL_LATENCY = Query(
    "kv_pool_latency",
    f"sum by (pool, op) (rate({series(m.KV_POOL_SECONDS)}[5m])) / "
    f"sum by (pool, op) (rate({series(m.KV_POOL_BLOCKS)}{{op=~\"loaded|loaded_from_disk|stored\"}}[5m]))",
    "{{pool}} {{op}}", "s", "KV pool seconds per block loaded (all, and those of chunks read from disk) or stored")
# A pool without a disk tier never counts a disk load, so that series does not exist (Ray's
# counters start at their first increment): `or 0 * loads` makes its share 0 rather than no data.
KV_POOL_DISK_SHARE = Query(
    "kv_pool_disk_share",
    f"(sum by (pool) (rate({series(m.KV_POOL_BLOCKS)}{{op=\"loaded_from_disk\"}}[{RATE_WINDOW}])) or "
    f"0 * sum by (pool) (rate({series(m.KV_POOL_BLOCKS)}{{op=\"loaded\"}}[{RATE_WINDOW}]))) / "
    f"sum by (pool) (rate({series(m.KV_POOL_BLOCKS)}{{op=\"loaded\"}}[{RATE_WINDOW}]))",
    "{{pool}}", "percentunit", "Share of pool loads read from the disk tier (kv_pool.disk)")
KV_POOL_FAILURES = Query("kv_pool_failures",
                         f"sum by (pool, op) ({recent_increase(series(m.KV_POOL_FAILURES))})", "{{pool}} {{op}}",
                         "short", "KV pool failures and corrupt objects in the last 10 minutes")
KV_POOL_DOWN = Query("kv_pool_down", f"sum by (pool) (1 - {series(m.KV_POOL_UP)})", "{{pool}}", "short",
                     "Engines serving without the KV pool")  # 0 when all are up (a series, not no data)

# -- KV transfer ----------------------------------------------------------------------------------
KV_PULL_RATE = Query("kv_pull_rate", f"sum by (pool, outcome) (rate({series(m.KV_PULLS)}[{RATE_WINDOW}]))",
                     "{{pool}} {{outcome}}", "reqps", "KV pulls by outcome")
KV_BANDWIDTH = Query("kv_bandwidth", f"sum by (pool) (rate({series(m.KV_PULLED_BYTES)}[{RATE_WINDOW}]))",
                     "{{pool}}", "Bps", "KV bytes pulled per second")
KV_PULL_LATENCY = Query(
    "kv_pull_latency",
    f"sum by (pool) (rate({series(m.KV_PULL_SECONDS)}[5m])) / "
    f"sum by (pool) (rate({series(m.KV_PULLS)}{{outcome=\"ok\"}}[5m]))",
    "{{pool}}", "s", "Mean KV pull latency")
_FAILED_PULLS = series(m.KV_PULLS) + '{outcome="failed"}'
KV_FAILURES = Query("kv_failures", f"sum by (pool) ({recent_increase(_FAILED_PULLS)})",
                    "{{pool}}", "short", "Failed KV pulls in the last 10 minutes")
KV_FALLBACKS = Query("kv_fallbacks", f"sum by (pool) ({recent_increase(series(m.KV_FALLBACKS))})",
                     "{{pool}}", "short", "Pulls recomputed on decode in the last 10 minutes")
KV_LEASES = Query("kv_leases", f"sum by (pool) ({series(m.KV_LEASES_OUTSTANDING)})", "{{pool}}", "short",
                  "Prefill leases outstanding")
KV_LEASES_EXPIRED = Query("kv_leases_expired",
                          f"sum by (pool) ({recent_increase(series(m.KV_LEASES_EXPIRED))})", "{{pool}}", "short",
                          "Leases freed by deadline (stuck) in the last 10 minutes")

# -- experts ----------------------------------------------------------------------------------------
EXPERT_LOAD = Query("expert_load", f"sum by (pool, expert) (rate({series(m.EXPERT_TOKENS)}[{RATE_WINDOW}]))",
                    "expert {{expert}}", "short", "Routed tokens per second per expert")
RANK_LOAD = Query("rank_load", f"sum by (pool, rank) (rate({series(m.EXPERT_TOKENS)}[{RATE_WINDOW}]))",
                  "{{pool}} rank {{rank}}", "short", "Routed tokens per second per rank")
EXPERT_IMBALANCE = Query(
    "expert_imbalance",
    f"max by (pool) (sum by (pool, expert) (rate({series(m.EXPERT_TOKENS)}[5m]))) / "
    f"avg by (pool) (sum by (pool, expert) (rate({series(m.EXPERT_TOKENS)}[5m])))",
    "{{pool}}", "short", "Expert load imbalance (busiest / mean expert)")
RANK_REQUESTS = Query("rank_requests", f"sum by (pool, rank) (rate({series(m.ROUTED_REQUESTS)}[{RATE_WINDOW}]))",
                      "{{pool}} rank {{rank}}", "reqps", "Requests routed to each rank")
GROUP_FAILURES = Query("group_failures", f"sum by (pool) ({recent_increase(series(m.GROUP_FAILURES))})",
                       "{{pool}}", "short", "Engine groups broken by a dead rank (last 10 minutes)")

# -- freshness ------------------------------------------------------------------------------------------
SCRAPE_UP = Query("scrape_up", 'min(up{job="ray"})', "all targets up", "short", "Ray metrics endpoints up")
METRICS_AGE = Query("metrics_age", f"time() - max(timestamp({series(m.ENGINE_IN_FLIGHT)}))", "age", "s",
                    "Age of the newest engine metric sample")

# -- autoscaler (exported by the Serve controller while a manifest autoscales) ------------------------------
AUTOSCALER_TARGETS = Query("autoscaler_targets", f"max by (pool) ({series(m.AUTOSCALER_TARGET)})", "{{pool}} target",
                           "short", "Autoscaler target replicas (groups) per pool")
AUTOSCALER_CURRENT = Query("autoscaler_current", f"max by (pool) ({series(m.AUTOSCALER_CURRENT)})",
                           "{{pool}} current", "short", "Replicas (groups) per pool at the latest decision")
_SCALING_ACTIONS = series(m.AUTOSCALER_DECISIONS) + '{action!="hold"}'
AUTOSCALER_ACTIONS = Query(
    "autoscaler_actions", f"sum by (pool, action) ({recent_increase(_SCALING_ACTIONS)})",
    "{{pool}} {{action}}", "short", "Scale-outs and scale-ins in the last 10 minutes")
AUTOSCALER_HOLDING = Query("autoscaler_holding", f"max by (reason) ({series(m.AUTOSCALER_HOLDING)})", "{{reason}}",
                           "short", "Autoscaler holding all pools (1) because metrics are unreachable or stale")
AUTOSCALER_DECISION_AGE = Query("autoscaler_decision_age", f"time() - max({series(m.AUTOSCALER_LAST_DECISION)})",
                                "age", "s", "Seconds since the autoscaler's latest decision")
ENGINE_WAITING_BY_POOL = Query("engine_waiting_by_pool", f"sum by (pool) ({series(m.ENGINE_WAITING)})", "{{pool}}",
                               "short", "Requests waiting in the engines' schedulers per pool")

ALL: tuple[Query, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Query))
# Series that exist only while an autoscaling manifest runs (the Serve controller exports them).
AUTOSCALER: tuple[Query, ...] = (AUTOSCALER_TARGETS, AUTOSCALER_CURRENT, AUTOSCALER_ACTIONS, AUTOSCALER_HOLDING,
                                 AUTOSCALER_DECISION_AGE)
BY_KEY: dict[str, Query] = {query.key: query for query in ALL}


# -- per pool (the autoscaler's inputs; `pool` is a Serve deployment name) ------------------------------
def pool_running(pool: str) -> str:
    """Requests inside the pool's engines (running or waiting in vLLM), summed over replicas and ranks."""
    return f'sum({series(m.ENGINE_IN_FLIGHT)}{{pool="{pool}"}})'


def pool_queued(pool: str) -> str:
    """Requests waiting for the pool: at Serve handles (no replica free) plus in its engines'
    schedulers (admitted by a replica, not yet in a batch; where waiting mostly happens)."""
    handles = f'sum(ray_serve_deployment_queued_queries{{deployment="{pool}"}}) or vector(0)'
    engines = f'sum({series(m.ENGINE_WAITING)}{{pool="{pool}"}}) or vector(0)'
    return f"({handles}) + ({engines})"


def pool_kv_usage(pool: str) -> str:
    """The fullest KV cache among the pool's engines (0..1)."""
    return f'max({series(m.ENGINE_KV_USAGE)}{{pool="{pool}"}})'


def pool_metrics_age(pool: str) -> str:
    """Seconds since the pool's engines last exported (large: the pool or the pipeline is down)."""
    return f'time() - max(timestamp({series(m.ENGINE_IN_FLIGHT)}{{pool="{pool}"}}))'


def ttft_p90(window: str) -> str:
    return quantile(0.9, m.TTFT, window=window)


def itl_p90(window: str) -> str:
    return quantile(0.9, m.TPOT, window=window)


def arrival_rps(window: str) -> str:
    return f"sum(rate({series(m.REQUESTS)}[{window}]))"


def kv_pull_latency(window: str) -> str:
    return (f"sum(rate({series(m.KV_PULL_SECONDS)}[{window}])) / "
            f'sum(rate({series(m.KV_PULLS)}{{outcome="ok"}}[{window}]))')
