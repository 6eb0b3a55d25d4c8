"""Replays recorded observations through a policy and returns what it did, as plain dicts: the
regression harness for scaling behaviour (a changed decision shows up as a changed event log).

Event log: one {"at_s", "event": "hold", "reason"} per held decision, and one
{"at_s", "event": "scale", "pool", "from", "to", "reason"} per pool whose target changed.

A recorded case is JSON (a live autoscaler writes one when the manifest sets
autoscaling.record_path): {"config": ControllerConfig fields (budget_units null: none), "limits": [PoolLimits fields],
"steps": [{"at_s": float, "observations": [PoolObservation fields] | null, "serve_sizes": {pool: int}}]},
null observations meaning the metrics source was unreachable at that step. `serve_sizes` (optional)
is each pool's replica target as Serve reported it at that step: a controller that has not
decided a pool yet holds it there, so a replay without them starts from the pools' minimums. Print a case's event log (to review, then store
as the expected one):

    .venv/bin/python -m autoscaler.replay tests/unit/data/autoscaler_replay.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

from autoscaler.observations import ControllerConfig, PoolLimits, PoolObservation, ScalingPolicy



class RecordedStep(NamedTuple):
    at_s: float
    observations: list[PoolObservation] | None
    serve_sizes: dict[str, int] | None = None


Recorded = list[RecordedStep]


def replay(controller: ScalingPolicy, recorded: Recorded) -> list[dict]:
    events: list[dict] = []
    for at_s, observations, serve_sizes in recorded:
        decisions = controller.decide(observations, at_s, serve_sizes=serve_sizes)
        if decisions.held:
            events.append({"at_s": at_s, "event": "hold", "reason": decisions.hold_reason})
            continue
        for decision in decisions.changed():
            events.append({"at_s": at_s, "event": "scale", "pool": decision.pool, "from": decision.current,
                           "to": decision.target, "reason": decision.reason})
    return events


def replay_targets(controller: ScalingPolicy, recorded: Recorded) -> list[dict[str, int]]:
    """Every pool's target at every step: compared with a live recording's "decisions"."""
    return [controller.decide(step.observations, step.at_s, serve_sizes=step.serve_sizes).targets()
            for step in recorded]


def load_case(path: Path) -> tuple[ControllerConfig, list[PoolLimits], Recorded]:
    data = json.loads(Path(path).read_text())
    config = data["config"]  # other top-level keys (e.g. "about") are notes for people
    if config.get("ratio_bounds") is not None:
        config = {**config, "ratio_bounds": tuple(config["ratio_bounds"])}
    if config.get("budget_units", 0) is None:  # JSON has no infinity: null means no budget
        config = {**config, "budget_units": math.inf}
    limits = [PoolLimits(**limit) for limit in data["limits"]]
    recorded: Recorded = []
    for step in data["steps"]:
        observations = step["observations"]
        recorded.append(RecordedStep(
            float(step["at_s"]),
            None if observations is None else [PoolObservation(**obs) for obs in observations],
            step.get("serve_sizes")))
    return ControllerConfig(**config), limits, recorded


def main(argv: list[str] | None = None) -> int:
    from autoscaler.controller import CoordinatedController

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m autoscaler.replay CASE.json", file=sys.stderr)
        return 2
    config, limits, recorded = load_case(Path(args[0]))
    print(json.dumps(replay(CoordinatedController(config, limits), recorded), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
