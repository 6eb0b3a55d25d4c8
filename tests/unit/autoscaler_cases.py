"""Shared cases for the controller's unit tests: a config, two pools' limits, and observations
that sit inside the band by default (`prefill()`, `decode()`), grow with a load level
(`load_at`) or read as idle (`idle`)."""

from dataclasses import replace
from pathlib import Path

from autoscaler.controller import CoordinatedController
from autoscaler.observations import ControllerConfig, PoolLimits, PoolObservation

DATA = Path(__file__).resolve().parent / "data"


def config(**overrides) -> ControllerConfig:
    base = dict(ttft_slo_s=2.0, itl_slo_s=0.1, budget_units=100.0, scale_out_cooldown_s=60.0,
                scale_in_cooldown_s=300.0, scale_in_calm_s=0.0, stale_after_s=60.0, hysteresis=0.2, max_step=4,
                scale_to_zero_idle_s=600.0)
    base.update(overrides)
    return ControllerConfig(**base)


PREFILL = PoolLimits("prefill", min_replicas=1, max_replicas=20, units_per_replica=1.0, running_capacity_per_replica=1)
DECODE = PoolLimits("decode", min_replicas=1, max_replicas=20, units_per_replica=2.0, running_capacity_per_replica=64)


def prefill(replicas=4, ttft=1.0, queue=0.5, running=3.0, **extra) -> PoolObservation:
    """Defaults sit inside the band: busy 3/4 of 1 (83% of the 0.9 threshold), TTFT half the SLO."""
    return PoolObservation("prefill", "prefill", replicas, ttft_p90_s=ttft, queue_depth=queue, running=running,
                           arrival_rps=extra.pop("arrival_rps", 5.0), **extra)


def decode(replicas=4, itl=0.085, running=200.0, kv=0.5, **extra) -> PoolObservation:
    """Defaults sit inside the band: ITL 85% of the SLO, 50 of 64 sequences per replica."""
    return PoolObservation("decode", "decode", replicas, ranks_per_replica=extra.pop("ranks_per_replica", 1),
                           itl_p90_s=itl, running=running, kv_cache_usage=kv,
                           arrival_rps=extra.pop("arrival_rps", 5.0), **extra)


def controller(limits=(PREFILL, DECODE), **overrides) -> CoordinatedController:
    return CoordinatedController(config(**overrides), list(limits))


def by_pool(decisions):
    return {d.pool: d for d in decisions.decisions}


def decide_twice(policy, observations):
    """Signals barely over a threshold need a second look (15 s later) before a scale-out."""
    first = policy.decide(observations, 0.0)
    return first if first.changed() else policy.decide(observations, 15.0)


def load_at(level: float) -> list[PoolObservation]:
    """Everything a pool reports grows with the offered load `level` (1.0 = inside the band)."""
    return [prefill(ttft=1.2 * level, queue=0.6 * level ** 2, running=min(3.2 * level, 4.0), arrival_rps=5 * level),
            decode(itl=0.07 * level, running=min(190.0 * level, 256.0), kv=min(0.5 * level, 1.0),
                   queue_depth=max(0.0, 190.0 * level - 256.0), arrival_rps=5 * level)]


def idle(pool_obs, replicas):
    return replace(pool_obs, replicas=replicas, ttft_p90_s=None, itl_p90_s=None, queue_depth=0.0, running=0.0,
                   arrival_rps=0.0, kv_cache_usage=0.0)
