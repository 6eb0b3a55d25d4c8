"""Simulated comparison of scaling policies on a 100-node H200 cluster serving DeepSeek-V3
disaggregated (prefill replica = 1 node, decode replica = 2-node EP16 group), one hour per trace.

    .venv/bin/python -m benchmarks.bench_autoscaler_sim            # one hour per trace
    .venv/bin/python -m benchmarks.bench_autoscaler_sim --quick    # 15 minutes per trace

Traces (seeded; prompts ~4000 and outputs ~1000 tokens, +-50%): steady 60 req/s; diurnal
24-96 req/s (one compressed day per hour); bursty 40 req/s with 110 req/s bursts (~90 s every
~7 min); shift 60 req/s with prompts going from ~1000 to ~6000 tokens at half time.

Policies: our CoordinatedController; FixedSplit (38 prefill + 31 decode groups = the whole
100-node budget, split by the steady trace's demand); QueueLengthPerPool (Ray Serve's default
rule per pool, no budget: the cluster places what fits). Numbers come from the simulator and
the H200_DEEPSEEK_V3 calibration (approximations; see autoscaler/service_model.py), not from
hardware. Writes benchmarks/results/autoscaler_sim.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from autoscaler.baselines import FixedSplit, QueueLengthPerPool
from autoscaler.controller import CoordinatedController
from autoscaler.observations import ControllerConfig, PoolLimits, ScalingPolicy
from autoscaler.service_model import H200_DEEPSEEK_V3
from autoscaler.simulator import SimConfig, SimPool, SimReport, simulate
from autoscaler.traces import Lengths, Trace, bursty, diurnal, shift, steady

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CLUSTER_NODES = 100.0
TTFT_SLO_S, ITL_SLO_S = 1.5, 0.050  # manifests/deepseek-v3-h200.yaml
PREFILL_NODES, DECODE_GROUP_NODES = 1.0, 2.0
FIXED_SPLIT = (38, 31)  # 38 + 31 * 2 = 100 nodes, ~ the steady trace's prefill:decode demand
ADAPTIVE_START = (16, 14)  # 44 nodes: what the steady trace needs
PROMPT, OUTPUT = Lengths(4000), Lengths(1000)
DIURNAL_PERIOD_S = 3600.0  # a day compressed into the hour; --quick sees its rising first quarter


def make_traces(duration_s: float, seed: int) -> list[Trace]:
    return [
        steady(duration_s, 60.0, PROMPT, OUTPUT, seed=seed),
        diurnal(duration_s, 60.0, PROMPT, OUTPUT, amplitude=0.6, period_s=DIURNAL_PERIOD_S, seed=seed),
        bursty(duration_s, 40.0, 110.0, PROMPT, OUTPUT, mean_burst_s=90.0, mean_gap_s=420.0, seed=seed),
        shift(duration_s, 60.0, Lengths(1000), Lengths(6000), OUTPUT, seed=seed),
    ]


def limits() -> list[PoolLimits]:
    return [
        PoolLimits.for_group("prefill", ranks_per_replica=8, units_per_rank=PREFILL_NODES / 8, min_replicas=1,
                             max_replicas=int(CLUSTER_NODES), running_capacity_per_replica=1),
        PoolLimits.for_group("decode", ranks_per_replica=16, units_per_rank=DECODE_GROUP_NODES / 16, min_replicas=1,
                             max_replicas=int(CLUSTER_NODES / DECODE_GROUP_NODES),
                             running_capacity_per_replica=H200_DEEPSEEK_V3.max_batch),
    ]


def policies() -> dict[str, tuple[ScalingPolicy, tuple[int, int]]]:
    config = ControllerConfig(ttft_slo_s=TTFT_SLO_S, itl_slo_s=ITL_SLO_S, budget_units=CLUSTER_NODES,
                              ratio_bounds=(0.25, 3.0), scale_out_cooldown_s=60.0, scale_in_cooldown_s=300.0,
                              scale_in_calm_s=300.0, stale_after_s=60.0, hysteresis=0.2, max_step=8,
                              scale_to_zero_idle_s=600.0, forecast_horizon_s=H200_DEEPSEEK_V3.replica_startup_s)
    queue_targets = {"prefill": 0.8, "decode": 0.7 * H200_DEEPSEEK_V3.max_batch}  # tuned: ~80% busy, 70% batch
    return {
        "coordinated": (CoordinatedController(config, limits()), ADAPTIVE_START),
        "fixed-split": (FixedSplit(), FIXED_SPLIT),
        "queue-length": (QueueLengthPerPool(limits(), queue_targets), ADAPTIVE_START),
    }


def sim_config(initial: tuple[int, int]) -> SimConfig:
    return SimConfig(prefill=SimPool("prefill", initial[0], PREFILL_NODES, 8),
                     decode=SimPool("decode", initial[1], DECODE_GROUP_NODES, 16),
                     model=H200_DEEPSEEK_V3, cluster_units=CLUSTER_NODES,
                     ttft_slo_s=TTFT_SLO_S, itl_slo_s=ITL_SLO_S, control_interval_s=15.0, metrics_window_s=60.0)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def markdown(reports: list[SimReport]) -> str:
    lines = ["| trace | policy | SLO attainment | goodput (req/s) | node-seconds (prefill + decode) | "
             "goodput per node-second | TTFT p90 (s) | ITL p90 (ms) | changes | sim wall (s) | sim CPU (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        per_pool = f"{r.unit_seconds['prefill']:,.0f} + {r.unit_seconds['decode']:,.0f}"
        lines.append(f"| {r.trace} | {r.policy} | {r.slo_attainment:.1%} | {r.goodput_rps:.2f} | "
                     f"{r.total_unit_seconds:,.0f} ({per_pool}) | "
                     f"{r.goodput_per_unit_s:.4f} | {r.ttft_p90_s:.2f} | {r.itl_p90_s * 1e3:.1f} | "
                     f"{r.scaling_changes} | {r.wall_s:.1f} | {r.cpu_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=3600.0, help="length of every trace")
    parser.add_argument("--quick", action="store_true", help="15-minute traces (overrides --duration-s)")
    parser.add_argument("--traces", default="steady,diurnal,bursty,shift", help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscaler_sim.json")
    args = parser.parse_args(argv)
    duration_s = 900.0 if args.quick else args.duration_s
    wanted = set(args.traces.split(","))

    reports: list[SimReport] = []
    for trace in make_traces(duration_s, args.seed):
        if trace.name not in wanted:
            continue
        _log(f"trace {trace.name}: {len(trace):,} requests over {duration_s:.0f}s ({trace.mean_rps:.1f} req/s)")
        for name, (policy, initial) in policies().items():
            report = simulate(sim_config(initial), trace, policy, name, progress=_log)
            _log(f"  {name}: SLO {report.slo_attainment:.1%}, goodput {report.goodput_rps:.2f} req/s, "
                 f"{report.total_unit_seconds:,.0f} node-s, wall {report.wall_s:.1f}s")
            reports.append(report)

    table = markdown(reports)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "duration_s": duration_s,
        "cluster_nodes": CLUSTER_NODES,
        "slo": {"ttft_s": TTFT_SLO_S, "itl_s": ITL_SLO_S},
        "model": H200_DEEPSEEK_V3.__dict__,
        "table": table,
        "reports": [{**r.summary(), "timeline": r.timeline} for r in reports],
    }, indent=1))
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
