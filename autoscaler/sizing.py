"""How many replicas a pool needs, from its pressure: pure arithmetic, one rule per signal kind.

All sizes aim at the middle of the hysteresis band, m = 1 - h/2, so that after the change
the pool is neither over a threshold nor calm enough to scale straight back.

    utilisation   ceil(ready * u / m)              linear in traffic: trusted as is
    latency       ceil(ready * min(l, 2) / m)      not linear (queueing): at most doubles per step
    backlog       while the queue is over its threshold and the previous decision's queue is
                  known: the rate the pool really serves is arrivals - d(queue)/dt, so
                      per_replica_rps = served_rps / ready        (saturated: all ready are busy)
                      queue_then = queue + (arrivals - served_rps) * forecast_horizon_s
                      ceil((arrivals * growth + queue_then / backlog_drain_s)
                           / (per_replica_rps * running_high * m))
                  i.e. serve the arrivals at the target utilisation and drain, in
                  backlog_drain_s, the queue as it will be once new replicas serve; otherwise
                  (no history) like latency, at most doubling.
Each rule is non-decreasing in its signal, so their maximum is monotone in load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.observations import ControllerConfig, PoolObservation
from autoscaler.signals import PoolPressure

BLIND_GROWTH_CAP = 2.0  # latency or queue length alone never ask for more than 2x ready per step
MIN_SERVED_FRACTION = 0.1  # a served-rate estimate below this share of arrivals is noise


@dataclass(frozen=True)
class QueueSample:
    at_s: float
    queue_depth: float


def _middle(config: ControllerConfig) -> float:
    return 1.0 - config.hysteresis / 2.0


def scale_out_size(obs: PoolObservation, pressure: PoolPressure, config: ControllerConfig,
                   previous_queue: QueueSample | None, now_s: float) -> int:
    ready, middle = obs.ready_replicas, _middle(config)
    sizes = [0]
    utilisation = pressure.largest("utilisation")
    if utilisation is not None:
        sizes.append(math.ceil(ready * utilisation / middle - 1e-9))
    latency = pressure.largest("latency")
    if latency is not None:
        sizes.append(math.ceil(ready * min(latency, BLIND_GROWTH_CAP) / middle - 1e-9))
    queue = pressure.largest("backlog") or 0.0
    sizes.append(math.ceil(ready * min(queue, 1.0) / middle - 1e-9))
    if queue > 1.0:
        from_rate = _backlog_size(obs, pressure.growth, config, previous_queue, now_s)
        sizes.append(from_rate if from_rate is not None
                     else math.ceil(ready * min(queue, BLIND_GROWTH_CAP) / middle - 1e-9))
    return max(sizes)


def scale_in_size(obs: PoolObservation, pressure: PoolPressure, config: ControllerConfig) -> int | None:
    """Replicas enough for the current utilisation; None when the pool reports none."""
    utilisation = pressure.largest("utilisation")
    if utilisation is None:
        return None
    return max(1, math.ceil(obs.ready_replicas * utilisation / _middle(config) - 1e-9))


def _backlog_size(obs: PoolObservation, growth: float, config: ControllerConfig,
                  previous: QueueSample | None, now_s: float) -> int | None:
    arrivals = obs.arrival_rps
    if previous is None or arrivals is None or arrivals <= 0 or now_s <= previous.at_s:
        return None
    served_rps = max(arrivals - (obs.queue_depth - previous.queue_depth) / (now_s - previous.at_s),
                     MIN_SERVED_FRACTION * arrivals)
    per_replica_rps = served_rps / obs.ready_replicas
    # The queue keeps growing until new replicas serve: drain what it will be by then.
    queue_then = obs.queue_depth + max(arrivals - served_rps, 0.0) * config.forecast_horizon_s
    wanted_rps = arrivals * growth + queue_then / config.backlog_drain_s
    return math.ceil(wanted_rps / (per_replica_rps * config.running_high_fraction * _middle(config)) - 1e-9)
