"""Every metric moe-serve exports, as plain data: name, kind, help, labels, buckets.

One catalogue shared by the exporters (monitoring/exporter.py), the dashboards, the alert
rules and the tests, so that a query can only name a metric that exists. Names follow
Prometheus conventions: base units in the name (`_seconds`, `_bytes`), counters end in
`_total`, and every label has a bounded set of values (pools, ranks, experts, phases; never
request ids).

What the exposition adds: Ray's metrics agent serves these from each node; a histogram
`x_seconds` appears as `x_seconds_bucket`, `x_seconds_sum`, `x_seconds_count`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    counter = "counter"
    gauge = "gauge"
    histogram = "histogram"


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


# Latencies from a millisecond to two minutes: CPU engines are slow, GPU ones fast.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40, 80, 120)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)


class Phase(str, Enum):
    """Where a request's time goes, measured at the ingress and in the engines; the phases of
    one request partition its end-to-end latency (`moe_serve_request_e2e_seconds`)."""

    ingress = "ingress"  # HTTP body received -> handed to the engine client (parse, validate, tokenize)
    prefill = "prefill"  # disaggregated: prefill pool round trip (its queue, prompt compute, the hop)
    queue = "queue"  # the (decode or colocated) engine's waiting queue: queued -> first scheduled
    pool_load = "pool_load"  # reading KV blocks from the cluster's KV pool's memory (prefill's and decode's reads)
    pool_disk_load = "pool_disk_load"  # reading KV blocks that the pool's disk tier (kv_pool.disk) served
    kv_transfer = "kv_transfer"  # disaggregated decode: scheduled -> first token (KV pull + first step), less pool_load
    first_token_compute = "first_token_compute"  # colocated: scheduled -> first token (prompt compute)
    dispatch = "dispatch"  # the rest before the first token: routing, RPC hops, engine front end
    inter_token = "inter_token"  # first token -> last token (all the decode steps)
    finish = "finish"  # last token -> response complete


REQUESTS = MetricDef("moe_serve_requests_total", Kind.counter,
                     "Requests answered by the OpenAI ingress, by route and outcome "
                     "(ok, client_error, rejected: 429 by admission control, timeout: 504 after a bounded wait, "
                     "server_error, cancelled).", ("route", "outcome"))
REQUEST_TIMEOUTS = MetricDef("moe_serve_request_timeouts_total", Kind.counter,
                             "Requests aborted because a bounded wait expired (manifest request_timeouts), by "
                             "route and wait (prefill, first_token, inter_token, total).", ("route", "wait"))
REQUEST_E2E = MetricDef("moe_serve_request_e2e_seconds", Kind.histogram,
                        "End-to-end latency of successful requests at the ingress (body received -> "
                        "response complete).", ("route",), LATENCY_BUCKETS)
REQUEST_PHASE = MetricDef("moe_serve_request_phase_seconds", Kind.histogram,
                          "Time successful requests spend in each phase; a request's phases sum to its "
                          "end-to-end latency.", ("phase",), LATENCY_BUCKETS)
# Histogram `_sum`s exported by Ray are rebuilt from bucket boundaries (measured: 855 s reported
# for 648 s observed), so exact time accounting uses counters of seconds instead.
REQUEST_TIME = MetricDef("moe_serve_request_time_seconds_total", Kind.counter,
                         "End-to-end seconds of successful requests, summed exactly (see the phase time counter).",
                         ("route",))
REQUEST_PHASE_TIME = MetricDef("moe_serve_request_phase_time_seconds_total", Kind.counter,
                               "Seconds successful requests spent in each phase, summed exactly; over all "
                               "phases it equals moe_serve_request_time_seconds_total.", ("phase",))
TTFT = MetricDef("moe_serve_time_to_first_token_seconds", Kind.histogram,
                 "Time to first token at the ingress.", ("route",), LATENCY_BUCKETS)
TPOT = MetricDef("moe_serve_time_per_output_token_seconds", Kind.histogram,
                 "Mean inter-token latency of each request after its first token.", ("route",),
                 TOKEN_LATENCY_BUCKETS)
PROMPT_TOKENS = MetricDef("moe_serve_prompt_tokens_total", Kind.counter, "Prompt tokens of served requests.",
                          ("route",))
GENERATION_TOKENS = MetricDef("moe_serve_generation_tokens_total", Kind.counter,
                              "Tokens generated for served requests.", ("route",))
PROMPT_CACHED_TOKENS = MetricDef("moe_serve_prompt_cached_tokens_total", Kind.counter,
                                 "Prompt tokens of served requests the engines did not compute (prefix cache, "
                                 "KV pool; in P/D the prefill's count): the cache hits routing aims for.", ("route",))
PROMPT_REUSE_RATIO = MetricDef("moe_serve_prompt_reuse_ratio", Kind.histogram,
                               "Per served request: the share of its prompt the engines did not compute "
                               "(prefix cache, KV pool). session: whether it named its session (X-Session-Id), "
                               "so a session's later turns show how much of their history was reused.",
                               ("route", "session"), (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0))
ROUTING_DECISIONS = MetricDef("moe_serve_routing_decisions_total", Kind.counter,
                              "Replica choices of our request routers, by pool, policy and reason (prefix, "
                              "load_gate, session, least_loaded, pool_prefix, round_robin, only_replica).",
                              ("pool", "policy", "reason"))
ROUTING_PROMPT_BLOCKS = MetricDef("moe_serve_routing_prompt_blocks_total", Kind.counter,
                                  "Full prompt blocks of routed requests, and of those the blocks the router "
                                  "expected the chosen replica to hold (kind: routed, expected_hit).",
                                  ("pool", "kind"))
SLO_MET = MetricDef("moe_serve_requests_within_slo_total", Kind.counter,
                    "Successful requests whose TTFT and mean inter-token latency met the manifest's SLO "
                    "(goodput).", ("route",))
INGRESS_ADMITTED = MetricDef("moe_serve_ingress_admitted_requests", Kind.gauge,
                             "Requests holding an admission place of an ingress replica (generation, /tokenize, "
                             "/detokenize; admitted and not yet ended), by replica (its process id). It returns "
                             "to 0 when the replica is idle: a value that stays up without traffic is a leaked "
                             "place, and every leaked place is one request fewer admitted.", ("replica",))

ENGINE_IN_FLIGHT = MetricDef("moe_serve_engine_requests_in_flight", Kind.gauge,
                             "Requests an engine replica (or group rank) is serving now.", ("pool", "rank"))
ENGINE_WAITING = MetricDef("moe_serve_engine_requests_waiting", Kind.gauge,
                           "Requests waiting in an engine's scheduler for a batch slot (vLLM's scheduler "
                           "stats, last engine step): the pool's queue.", ("pool", "rank"))
ENGINE_KV_USAGE = MetricDef("moe_serve_engine_kv_cache_usage_ratio", Kind.gauge,
                            "Fraction of an engine's KV cache blocks in use (0..1, last engine step).",
                            ("pool", "rank"))
ROUTED_REQUESTS = MetricDef("moe_serve_group_routed_requests_total", Kind.counter,
                            "Requests an expert-parallel group routed to each of its ranks.", ("pool", "rank"))
GROUP_FAILURES = MetricDef("moe_serve_group_failures_total", Kind.counter,
                           "Expert-parallel groups broken by a dead rank (the group restarts).", ("pool",))
EXPERT_TOKENS = MetricDef("moe_serve_expert_routed_tokens_total", Kind.counter,
                          "(token, expert) assignments computed by each expert of an expert-parallel group, "
                          "by rank (includes the few dummy tokens of idle ranks' keep-alive steps).",
                          ("pool", "rank", "expert"))

KV_PULLS = MetricDef("moe_serve_kv_pulls_total", Kind.counter,
                     "KV pulls by decode engines, by outcome (ok, failed).", ("pool", "outcome"))
KV_PULL_SECONDS = MetricDef("moe_serve_kv_pull_seconds_total", Kind.counter,
                            "Seconds decode engines spent in successful KV pulls (divide by the ok pulls "
                            "for the mean pull latency).", ("pool",))
KV_PULLED_BYTES = MetricDef("moe_serve_kv_pulled_bytes_total", Kind.counter,
                            "KV cache bytes decode engines pulled from prefill engines.", ("pool",))
KV_FALLBACKS = MetricDef("moe_serve_kv_fallbacks_total", Kind.counter,
                         "Failed pulls that decode recomputed (failure_policy: recompute).", ("pool",))
KV_LEASES_OUTSTANDING = MetricDef("moe_serve_kv_leases_outstanding", Kind.gauge,
                                  "Prefill leases not yet released (blocks pinned for a decode pull).",
                                  ("pool", "rank"))
KV_LEASES_EXPIRED = MetricDef("moe_serve_kv_leases_expired_total", Kind.counter,
                              "Prefill leases freed by their deadline instead of a release (a decode "
                              "never pulled or never confirmed).", ("pool",))
KV_SERVER_REFUSALS = MetricDef("moe_serve_kv_server_refusals_total", Kind.counter,
                               "What an engine's KV transfer port turned away, by kind: requests without a "
                               "valid grant (refused_request), connections refused with every slot busy "
                               "(refused_connection), idle connections closed to make room "
                               "(evicted_connection), accept() errors (accept_error).", ("pool", "kind"))

# The cluster-wide KV pool (kv_transfer/pool/), per engine pool that reads or writes it.
KV_POOL_LOOKUP_BLOCKS = MetricDef("moe_serve_kv_pool_lookup_blocks_total", Kind.counter,
                                  "Prompt blocks looked up in the KV pool after the engine's own prefix "
                                  "cache, by outcome (hit, miss); hit / all is the pool's hit rate.",
                                  ("pool", "outcome"))
KV_POOL_BLOCKS = MetricDef("moe_serve_kv_pool_blocks_total", Kind.counter,
                           "KV blocks moved between engines and the pool, by op (loaded, stored, "
                           "already_pooled, refused: the pool was full, shed: a store dropped because "
                           "too many were pending or it waited too long; loaded_from_disk: those of the "
                           "loaded read from the pool's disk tier; pinned: put or renewed with a session's "
                           "pin; renewed: of those, held objects whose pin was renewed).", ("pool", "op"))
KV_POOL_BYTES = MetricDef("moe_serve_kv_pool_bytes_total", Kind.counter,
                          "KV cache bytes loaded from and stored to the pool, by op.", ("pool", "op"))
KV_POOL_SECONDS = MetricDef("moe_serve_kv_pool_seconds_total", Kind.counter,
                            "Seconds spent loading from and storing to the pool, by op.", ("pool", "op"))
KV_POOL_FAILURES = MetricDef("moe_serve_kv_pool_failures_total", Kind.counter,
                             "Failed pool calls by op (lookup, load, store) and corrupt objects refused "
                             "(op corrupt); the engine recomputed instead.", ("pool", "op"))
KV_POOL_UP = MetricDef("moe_serve_kv_pool_up", Kind.gauge,
                       "1 while the engine uses the KV pool, 0 while it serves without it after a failure.",
                       ("pool", "rank"))

# The autoscaler's own metrics, exported from the Serve controller process (autoscaler/serve_loop.py).
AUTOSCALER_TARGET = MetricDef("moe_serve_autoscaler_target_replicas", Kind.gauge,
                              "Replicas (expert-parallel groups) the autoscaler wants for each pool.", ("pool",))
AUTOSCALER_CURRENT = MetricDef("moe_serve_autoscaler_current_replicas", Kind.gauge,
                               "Replicas (groups) each pool had when the autoscaler last decided.", ("pool",))
AUTOSCALER_DECISIONS = MetricDef("moe_serve_autoscaler_decisions_total", Kind.counter,
                                 "Autoscaler decisions per pool by action (scale_out, scale_in, hold).",
                                 ("pool", "action"))
AUTOSCALER_HOLDING = MetricDef("moe_serve_autoscaler_holding", Kind.gauge,
                               "1 while the autoscaler holds every pool because its metrics are unreachable "
                               "or stale, by reason; 0 otherwise.", ("reason",))
AUTOSCALER_LAST_DECISION = MetricDef("moe_serve_autoscaler_last_decision_timestamp_seconds", Kind.gauge,
                                     "Unix time of the autoscaler's latest decision (a stuck loop stops it).")

CATALOGUE: tuple[MetricDef, ...] = (
    REQUESTS, REQUEST_TIMEOUTS, REQUEST_E2E, REQUEST_PHASE, REQUEST_TIME, REQUEST_PHASE_TIME, TTFT, TPOT, PROMPT_TOKENS, GENERATION_TOKENS, SLO_MET,
    PROMPT_CACHED_TOKENS, PROMPT_REUSE_RATIO, ROUTING_DECISIONS, ROUTING_PROMPT_BLOCKS, INGRESS_ADMITTED,
    ENGINE_IN_FLIGHT, ENGINE_WAITING, ENGINE_KV_USAGE, ROUTED_REQUESTS, GROUP_FAILURES, EXPERT_TOKENS,
    KV_PULLS, KV_PULL_SECONDS, KV_PULLED_BYTES, KV_FALLBACKS, KV_LEASES_OUTSTANDING, KV_LEASES_EXPIRED,
    KV_SERVER_REFUSALS,
    KV_POOL_LOOKUP_BLOCKS, KV_POOL_BLOCKS, KV_POOL_BYTES, KV_POOL_SECONDS, KV_POOL_FAILURES, KV_POOL_UP,
    AUTOSCALER_TARGET, AUTOSCALER_CURRENT, AUTOSCALER_DECISIONS, AUTOSCALER_HOLDING, AUTOSCALER_LAST_DECISION,
)


def exposed_names(metric: MetricDef) -> tuple[str, ...]:
    """The series names a scrape shows for `metric`."""
    if metric.kind is Kind.histogram:
        return tuple(f"{metric.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return (metric.name,)
