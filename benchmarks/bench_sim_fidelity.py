"""The autoscaler simulator's error against a real run on this machine, at small scale.

    .venv/bin/python -m benchmarks.bench_sim_fidelity --rounds 3

Starts the local cluster on the default manifest (manifests/local.yaml: one prefill engine, one
expert-parallel decode group of two ranks, KV over our TCP transport), then:
1. probes: lone requests of three prompt lengths (TTFT) and decode at batch 1 and batch 8
   (inter-token latency) calibrate a ServiceModel (benchmarks/sim_fidelity.py says how);
2. for each arrival rate, the same seeded Poisson trace is sent `--rounds` times through the
   OpenAI endpoint (median per statistic over rounds);
3. the simulator replays exactly those requests (arrival times, server-counted tokens) on one
   prefill and one decode replica under a fixed split, once with the fitted model and once with
   the stock CPU_TINY_MODEL calibration (autoscaler/service_model.py).
Prints, per rate and statistic, real vs simulated and the relative error; writes
benchmarks/results/sim_fidelity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from autoscaler.baselines import FixedSplit
from autoscaler.service_model import CPU_TINY_MODEL
from autoscaler.simulator import SimConfig, SimPool, simulate
from benchmarks.sim_fidelity import (METRICS, DecodeProbe, LatencySummary, PrefillProbe, fit_service_model,
                                     latency_summary, relative_error, sim_summary, trace_from_records)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MANIFEST = REPO / "manifests" / "local.yaml"
PROBE_PROMPT_WORDS = (32, 160, 400)  # words; the tiny tokenizer spends ~4 tokens per word (max_model_len 2048)
DECODE_BATCH, DECODE_TOKENS = 8, 64


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _trace(num: int, rate: float, prompt_words: int, output_tokens: int, spread: float = 0.0, seed: int = 0):
    from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace

    return make_trace(TraceSpec(num_requests=num, rate_rps=rate, prompt_tokens=LengthSpec(prompt_words, spread),
                                output_tokens=LengthSpec(output_tokens, spread), seed=seed))


def _send(url: str, model: str, trace) -> list:
    from benchmarks.loadgen.client import run_trace

    records, _duration = asyncio.run(run_trace(url, model, trace, show_progress=False))
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} requests failed, first: {failed[0]}")
    return records


def probe(url: str, model: str, repeats: int) -> tuple[list[PrefillProbe], list[DecodeProbe]]:
    prefill, decode = [], []
    for words in PROBE_PROMPT_WORDS:
        for seed in range(repeats):
            (record,) = _send(url, model, _trace(1, 0.0, words, 2, seed=seed))
            prefill.append(PrefillProbe(record.prompt_tokens, record.ttft_ms / 1e3))
        _log(f"probe prefill: {record.prompt_tokens} tokens, TTFT "
             f"{statistics.median(p.ttft_s for p in prefill[-repeats:]) * 1e3:.0f} ms")
    for batch in (1, DECODE_BATCH):
        for seed in range(repeats):
            records = _send(url, model, _trace(batch, 0.0, 16, DECODE_TOKENS, seed=seed))
            decode.append(DecodeProbe(batch, statistics.median(r.mean_itl_ms / 1e3 for r in records)))
        _log(f"probe decode: batch {batch}, ITL {statistics.median(p.itl_s for p in decode[-repeats:]) * 1e3:.1f} ms")
    return prefill, decode


def simulated(records: list, model, manifest, label: str) -> LatencySummary:
    trace = trace_from_records(label, records)
    config = SimConfig(prefill=SimPool("prefill", 1), decode=SimPool("decode", 1, 2.0, 2), model=model,
                       cluster_units=3.0, ttft_slo_s=manifest.slo.ttft_ms / 1e3, itl_slo_s=manifest.slo.itl_ms / 1e3)
    return sim_summary(simulate(config, trace, FixedSplit(), "fixed"), trace)


def measure(args) -> dict:
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import load_manifest
    from cluster.serve_control import connect, deploy

    manifest = load_manifest(MANIFEST)
    ttft_slo_s, itl_slo_s = manifest.slo.ttft_ms / 1e3, manifest.slo.itl_ms / 1e3
    cluster = LocalCluster.for_manifest(manifest).start(progress=_log)
    try:
        connect(cluster.address)
        url, model = deploy(manifest, progress=_log).url, manifest.model.name
        _send(url, model, _trace(4, 0.0, 64, 8))  # warm-up
        prefill, decode = probe(url, model, args.probe_repeats)
        decode_seqs = next(p for p in manifest.pools if p.role.value == "decode").engine.max_num_seqs
        fitted = fit_service_model(CPU_TINY_MODEL, prefill, decode, max_batch=decode_seqs)
        _log(f"fitted: prefill {fitted.prefill_base_s * 1e3:.1f} ms + {fitted.prefill_s_per_token * 1e6:.0f} us/token, "
             f"decode step {fitted.decode_base_s * 1e3:.1f} ms + {fitted.decode_per_seq_s * 1e3:.2f} ms/seq")
        per_rate = {}
        for rate in args.rates:
            trace = _trace(args.num_requests, rate, args.prompt_words, args.output_tokens, spread=0.5)
            rounds = []
            for index in range(args.rounds):
                records = _send(url, model, trace)
                rounds.append(records)
                _log(f"rate {rate:g}: round {index + 1}: {latency_summary(records, ttft_slo_s, itl_slo_s)}")
            real = {field: statistics.median(getattr(latency_summary(r, ttft_slo_s, itl_slo_s), field)
                                             for r in rounds) for field, _label, _scale in METRICS}
            per_rate[f"{rate:g}"] = {
                "real": real,
                "sim_fitted": simulated(rounds[0], fitted, manifest, f"poisson-{rate:g}").as_dict(),
                "sim_stock": simulated(rounds[0], CPU_TINY_MODEL, manifest, f"poisson-{rate:g}").as_dict(),
                "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in rounds[0]),
                "output_tokens_mean": statistics.mean(r.output_tokens for r in rounds[0]),
            }
        return {"fitted_model": fitted.__dict__, "stock_model": CPU_TINY_MODEL.__dict__,
                "probes": {"prefill": [p.__dict__ for p in prefill], "decode": [p.__dict__ for p in decode]},
                "rates": per_rate}
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def markdown(results: dict) -> str:
    lines = ["| rate (req/s) | statistic | real (median) | sim, fitted | error | sim, stock | error |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for rate, row in results["rates"].items():
        for field, label, scale in METRICS:
            real, fit, stock = row["real"][field], row["sim_fitted"][field], row["sim_stock"][field]
            lines.append(f"| {rate} | {label} | {real * scale:.1f} | {fit * scale:.1f} | "
                         f"{relative_error(fit, real):+.0%} | {stock * scale:.1f} | {relative_error(stock, real):+.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0],
                        help="comma-separated Poisson arrival rates (req/s)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--prompt-words", type=int, default=64, help="mean prompt length (+-50%%)")
    parser.add_argument("--output-tokens", type=int, default=32, help="mean output length (+-50%%)")
    parser.add_argument("--probe-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "sim_fidelity.json")
    args = parser.parse_args(argv)

    results = measure(args)
    table = markdown(results)
    print(f"\n{args.num_requests} requests per rate, prompts ~{args.prompt_words} words, ~{args.output_tokens} "
          f"output tokens (+-50%); real: median of {args.rounds} rounds\n\n{table}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "cpus": os.cpu_count(), "args": {**vars(args), "out": str(args.out)},
                                    "table": table, **results}, indent=1))
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
