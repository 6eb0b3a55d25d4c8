"""One application's decision loop: observe every pool, decide for all together, publish targets.

It runs in the Serve controller process, on its own thread, because Serve calls autoscaling
policies inside its control loop: a slow or unreachable Prometheus must never stall Serve.
Serve's per-deployment policy calls (autoscaler/serve_policy.py) report each pool's replica
counts here and read back the latest target, so the pools of an application share one
CoordinatedController, even though Serve asks about them one deployment at a time.

Every decision is logged with its reason, exported as metrics (`moe_serve_autoscaler_*`),
kept in a bounded history and, when `record_path` is set, written as a replay case
(autoscaler/replay.py format) so that a real run can become a regression test.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from autoscaler.controller import CoordinatedController
from autoscaler.observations import PoolObservation, ScalingDecisions
from autoscaler.settings import AutoscalerSettings

# Under "ray.serve" so that, inside the Serve controller, lines go to its log file
# (/tmp/ray/session_latest/logs/serve/controller_*.log).
logger = logging.getLogger("ray.serve.moe_serve_autoscaler")

HISTORY = 2000  # decision rounds kept in memory and in the recording


class Round(NamedTuple):
    """One decision round: what the policy was given (observations, Serve's sizes) and decided."""
    at_s: float
    observations: list[PoolObservation] | None
    serve_sizes: dict[str, int]
    decisions: ScalingDecisions

_LOOPS: dict[str, "DecisionLoop"] = {}
_LOOPS_LOCK = threading.Lock()


def shared_loop(key: str, build: Callable[[], "DecisionLoop"]) -> "DecisionLoop":
    """The running loop for `key` (an application's serialized settings), built and started on
    first use. Loops of the same application under other settings (a redeploy) are stopped:
    one application, one controller."""
    with _LOOPS_LOCK:
        loop = _LOOPS.get(key)
        if loop is not None and loop.running:
            return loop
        loop = build()
        for other_key, other in list(_LOOPS.items()):
            if other.settings.app == loop.settings.app or not other.running:
                other.stop()
                del _LOOPS[other_key]
        _LOOPS[key] = loop
        loop.start()
        return loop


@dataclass(frozen=True)
class ReplicaReport:
    """What Serve told the policy about one pool on its latest call."""

    target: int  # Serve's current target (running plus starting)
    running: int
    at_s: float


class DecisionLoop:
    def __init__(self, settings: AutoscalerSettings, source: Any, *, metrics: Any = None,
                 clock: Callable[[], float] = time.time, record_path: str | None = None,
                 orphan_after_s: float | None = None):
        """`source`: has observe(replicas, starting) -> list[PoolObservation] | None
        (autoscaler.prometheus_source.PrometheusSource); `metrics`: an AutoscalerMetrics or None;
        `orphan_after_s`: the thread ends when Serve has not called for this long (the app was
        deleted or redeployed with another policy)."""
        self.settings = settings
        self.controller = CoordinatedController(settings.controller, [p.limits for p in settings.pools])
        self._source = source
        self._metrics = metrics
        self._clock = clock
        self._record_path = Path(record_path) if record_path else None
        self._orphan_after_s = orphan_after_s or max(60.0, 10 * settings.decision_interval_s)
        self._lock = threading.Lock()
        self._reports: dict[str, ReplicaReport] = {}
        self._targets: dict[str, int] = {}
        self.history: collections.deque[Round] = collections.deque(maxlen=HISTORY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hold_logged: tuple[str | None, float] = (None, 0.0)  # (kind, when) of the last HOLD line

    # -- called by Serve's policy (any thread) ------------------------------------------------------
    def report(self, pool: str, target: int, running: int) -> int:
        """Record Serve's view of `pool`; return the replicas the autoscaler wants for it now."""
        with self._lock:
            self._reports[pool] = ReplicaReport(target, running, self._clock())
            return self._targets.get(pool, target)

    # -- the loop ----------------------------------------------------------------------------------
    def step(self) -> ScalingDecisions | None:
        """One decision for every pool; None until Serve has reported every pool once."""
        with self._lock:
            reports = dict(self._reports)
        if any(p.ref.pool not in reports for p in self.settings.pools):
            return None
        replicas = {pool: report.target for pool, report in reports.items()}
        starting = {pool: max(report.target - report.running, 0) for pool, report in reports.items()}
        observations = self._source.observe(replicas, starting)
        now = self._clock()
        decisions = self.controller.decide(observations, now, serve_sizes=replicas)
        with self._lock:
            self._targets.update(decisions.targets())
        self.history.append(Round(now, observations, replicas, decisions))
        self._publish(observations, decisions)
        return decisions

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"moe-serve-autoscaler-{self.settings.app}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        logger.info("autoscaler for application %s: deciding every %.1fs from %s", self.settings.app,
                    self.settings.decision_interval_s, self.settings.prometheus_url)
        while not self._stop.wait(self.settings.decision_interval_s):
            if self._orphaned():
                logger.info("autoscaler for application %s: Serve stopped asking; ending", self.settings.app)
                return
            try:
                self.step()
            except Exception:  # a bug must not end the loop silently: log it and keep holding
                logger.exception("autoscaler for application %s: decision failed", self.settings.app)

    def _orphaned(self) -> bool:
        with self._lock:
            latest = max((report.at_s for report in self._reports.values()), default=None)
        return latest is not None and self._clock() - latest > self._orphan_after_s

    # -- telling people ----------------------------------------------------------------------------
    def _publish(self, observations: list[PoolObservation] | None, decisions: ScalingDecisions) -> None:
        summary = ", ".join(f"{d.pool} {d.current}->{d.target}" for d in decisions.decisions)
        if decisions.held:
            # Once when a hold starts or changes kind, then once a minute: holds can last long.
            kind = hold_kind(observations, decisions)
            if kind != self._hold_logged[0] or decisions.at_s - self._hold_logged[1] >= 60.0:
                logger.warning("autoscaler %s: HOLD (%s): %s", self.settings.app, decisions.hold_reason, summary)
                self._hold_logged = (kind, decisions.at_s)
        else:
            if self._hold_logged[0] is not None:
                logger.info("autoscaler %s: metrics usable again, deciding", self.settings.app)
            self._hold_logged = (None, 0.0)
            for decision in decisions.decisions:
                log = logger.info if decision.delta else logger.debug
                log("autoscaler %s: %s %d -> %d: %s", self.settings.app, decision.pool, decision.current,
                    decision.target, decision.reason)
        if self._metrics is not None:
            self._metrics.record(decisions, hold_kind(observations, decisions))
        if self._record_path is not None:
            self._write_recording()

    def recording(self) -> dict[str, Any]:
        """History as a replay case (autoscaler/replay.py) plus the decisions actually taken."""
        config = self.settings.to_json()["controller"]
        steps, decided = [], []
        for at_s, observations, serve_sizes, decisions in list(self.history):
            steps.append({"at_s": at_s, "observations": None if observations is None else
                          [dataclasses.asdict(obs) for obs in observations], "serve_sizes": serve_sizes})
            decided.append({"at_s": at_s, "held": decisions.held, "targets": decisions.targets(),
                            "reasons": {d.pool: d.reason for d in decisions.decisions}})
        return {"about": f"recorded live by the autoscaler of application {self.settings.app}",
                "config": config, "limits": [dataclasses.asdict(p.limits) for p in self.settings.pools],
                "steps": steps, "decisions": decided}

    def _write_recording(self) -> None:
        try:
            tmp = self._record_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.recording()))
            tmp.replace(self._record_path)  # readers never see half a file
        except OSError as exc:
            logger.warning("autoscaler %s: cannot write %s: %s", self.settings.app, self._record_path, exc)


def hold_kind(observations: list[PoolObservation] | None, decisions: ScalingDecisions) -> str | None:
    """Why every pool is held, as a bounded label: unreachable, stale; None when not held."""
    if not decisions.held:
        return None
    return "unreachable" if not observations else "stale"


class AutoscalerMetrics:
    """The loop's metrics, through monitoring's exporter (Ray's pipeline in the controller)."""

    def __init__(self, exporter: Any):
        self._exporter = exporter

    def record(self, decisions: ScalingDecisions, holding: str | None) -> None:
        from monitoring import metrics as m

        exporter = self._exporter
        for decision in decisions.decisions:
            exporter.set(m.AUTOSCALER_TARGET, decision.target, pool=decision.pool)
            exporter.set(m.AUTOSCALER_CURRENT, decision.current, pool=decision.pool)
            action = "scale_out" if decision.delta > 0 else "scale_in" if decision.delta < 0 else "hold"
            exporter.inc(m.AUTOSCALER_DECISIONS, 1, pool=decision.pool, action=action)
        for reason in ("unreachable", "stale"):
            exporter.set(m.AUTOSCALER_HOLDING, 1 if holding == reason else 0, reason=reason)
        exporter.set(m.AUTOSCALER_LAST_DECISION, decisions.at_s)
