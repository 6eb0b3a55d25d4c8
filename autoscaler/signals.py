"""How loaded one pool is, from its observation alone: pure, one number per signal.

Every signal is normalised so that 1.0 is its scale-out threshold, and has a kind:

    ttft      ttft_p90 / ttft_slo                            prefill, colocated   latency
    itl       itl_p90 / itl_slo                              decode, colocated    latency
    running   running / (ready * capacity * running_high)    capacity known       utilisation
    kv        kv_cache_usage / kv_usage_high                 decode, colocated    utilisation
    queue     queue / (ready * queue_per_replica_high)                            backlog

`out` (the largest signal) says how much the pool is over its targets; the controller scales
out when it exceeds 1 and scales in only when it is below 1 - hysteresis (`calm`). Sizing uses
the kinds differently (see sizing.py): utilisation grows linearly with traffic, latency and
backlog do not.

Prefill's TTFT counts only while prompts wait for a prefill replica (>= prefill_queue_gate per
ready replica): without a queue, first tokens are late for reasons more prefill replicas cannot
fix (long prompts, the KV hop, decode admission), and the decode pool's own signals react.
A rising arrival trend multiplies every signal by `growth` (>= 1): the load expected by the time
a new replica could serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autoscaler.observations import ControllerConfig, PoolLimits, PoolObservation

Kind = Literal["latency", "utilisation", "backlog"]


@dataclass(frozen=True)
class Signal:
    name: str
    kind: Kind
    value: float  # 1.0 = scale-out threshold
    text: str  # what was measured, for reasons


@dataclass(frozen=True)
class PoolPressure:
    signals: tuple[Signal, ...]
    growth: float  # arrival trend factor already applied to every value
    calm_below: float  # 1 - hysteresis

    def largest(self, kind: Kind | None = None) -> float | None:
        values = [s.value for s in self.signals if kind is None or s.kind == kind]
        return max(values) if values else None

    @property
    def out(self) -> float:
        """Largest signal: > 1 means over a threshold."""
        return self.largest() or 0.0

    @property
    def calm(self) -> bool:
        return self.out < self.calm_below

    def summary(self, only_over: float | None = None) -> str:
        """Signals as text, largest first; `only_over` keeps those above that value."""
        ranked = sorted(self.signals, key=lambda signal: -signal.value)
        chosen = [s for s in ranked if only_over is None or s.value > only_over] or ranked[:1]
        text = ", ".join(signal.text for signal in chosen) if chosen else "no signals"
        if self.growth > 1.0:
            text += f", arrivals rising (load x{self.growth:.2f} by the time replicas start)"
        return text


def pool_pressure(obs: PoolObservation, limits: PoolLimits, config: ControllerConfig,
                  growth: float = 1.0) -> PoolPressure:
    """Requires ready replicas (the controller handles pools that are all starting or at zero)."""
    ready = obs.ready_replicas
    assert ready > 0, "pool_pressure needs at least one ready replica"
    signals: list[Signal] = []
    queue_per_replica = obs.queue_depth / ready

    if obs.role in ("prefill", "colocated") and obs.ttft_p90_s is not None:
        value = obs.ttft_p90_s / config.ttft_slo_s
        text = f"ttft p90 {obs.ttft_p90_s:.2f}s {_vs(value)} SLO {config.ttft_slo_s:.2f}s"
        if obs.kv_transfer_s is not None:
            text += f" (kv hop {obs.kv_transfer_s:.3f}s)"
        if obs.role == "prefill" and queue_per_replica < config.prefill_queue_gate and value > 1.0:
            text += " not counted: no prefill queue"
            value = 1.0 - 1e-9  # not over, but not calm either
        signals.append(Signal("ttft", "latency", value, text))
    if obs.role in ("decode", "colocated") and obs.itl_p90_s is not None:
        value = obs.itl_p90_s / config.itl_slo_s
        signals.append(Signal("itl", "latency", value, f"itl p90 {obs.itl_p90_s * 1e3:.1f}ms {_vs(value)} "
                                                       f"SLO {config.itl_slo_s * 1e3:.1f}ms"))
    capacity = limits.running_capacity_per_replica
    if capacity is not None:
        running = obs.running / ready
        signals.append(Signal("running", "utilisation", running / (capacity * config.running_high_fraction),
                              f"running {running:.1f}/replica of {capacity:g}"))
    if obs.role in ("decode", "colocated") and obs.kv_cache_usage is not None:
        signals.append(Signal("kv", "utilisation", obs.kv_cache_usage / config.kv_usage_high,
                              f"kv cache {obs.kv_cache_usage:.0%}"))
    signals.append(Signal("queue", "backlog", queue_per_replica / config.queue_per_replica_high,
                          f"queue {obs.queue_depth:.1f} ({queue_per_replica:.2f}/replica)"))

    if growth > 1.0:
        signals = [Signal(s.name, s.kind, s.value * growth, s.text) for s in signals]
    return PoolPressure(tuple(signals), growth, 1.0 - config.hysteresis)


def _vs(ratio: float) -> str:
    return ">" if ratio > 1.0 else "<="
