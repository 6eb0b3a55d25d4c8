"""CLI: replay a synthetic trace against an OpenAI-compatible server.

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 --model NAME \\
        --num-requests 64 --rate 8 --prompt-tokens 256 --output-tokens 64 \\
        --shared-prefix-fraction 0.0 --slo-ttft-ms 2000 --slo-itl-ms 200 \\
        --out benchmarks/results/loadgen.json

Prints a summary table to stdout (progress goes to stderr) and writes a JSON file
with the config, the summary and every per-request record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from benchmarks.loadgen.client import run_trace
from benchmarks.loadgen.stats import format_table, summarize
from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server expects")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0,
                   help="Poisson arrival rate in req/s; 0 or inf sends all at once")
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="mean prompt length (in words, ~tokens)")
    p.add_argument("--prompt-spread", type=float, default=0.0,
                   help="uniform half-width as a fraction of the mean, 0 = fixed")
    p.add_argument("--output-tokens", type=int, default=64, help="mean max_tokens")
    p.add_argument("--output-spread", type=float, default=0.0)
    p.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    p.add_argument("--shared-prefix-tokens", type=int, default=None,
                   help="shared prefix length in words (default: half the prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request limit")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--label", default=None, help="column name in the table")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/loadgen.json"))
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefix_tokens = args.shared_prefix_tokens
    if prefix_tokens is None:
        prefix_tokens = max(1, args.prompt_tokens // 2) if args.shared_prefix_fraction > 0 else 0
    try:
        spec = TraceSpec(
            num_requests=args.num_requests,
            rate_rps=args.rate,
            prompt_tokens=LengthSpec(args.prompt_tokens, args.prompt_spread),
            output_tokens=LengthSpec(args.output_tokens, args.output_spread),
            shared_prefix_fraction=args.shared_prefix_fraction,
            shared_prefix_tokens=prefix_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trace = make_trace(spec)
    records, duration_s = asyncio.run(
        run_trace(
            args.base_url,
            args.model,
            trace,
            timeout_s=args.timeout_s,
            max_concurrency=args.max_concurrency,
            show_progress=not args.no_progress,
        )
    )
    summary = summarize(records, duration_s, args.slo_ttft_ms, args.slo_itl_ms)
    label = args.label or f"{args.model} @ {args.rate:g} rps"
    print(format_table([(label, summary)]))
    for error, count in summary.errors.items():
        print(f"failed x{count}: {error}", file=sys.stderr)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "label": label,
        "config": {
            "base_url": args.base_url,
            "model": args.model,
            # inf is not valid JSON; 0 means the same thing (a burst).
            "trace": {**asdict(spec), "rate_rps": 0.0 if spec.is_burst else spec.rate_rps},
            "timeout_s": args.timeout_s,
            "max_concurrency": args.max_concurrency,
        },
        "summary": summary.to_dict(),
        "records": [asdict(r) for r in records],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if summary.num_ok > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
