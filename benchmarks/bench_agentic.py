"""An agentic trace, side by side: the plain vLLM server, moe-serve with the pool off, with a
DRAM pool, and with DRAM + a disk tier (both pools keeping sessions: kv_pool.sessions).

    .venv/bin/python -m benchmarks.bench_agentic                  # 14 sessions x 8 turns, one round each
    .venv/bin/python -m benchmarks.bench_agentic --rounds 3 --configs vllm,dram-disk

The trace is what an agent sends: sessions sharing one long system prompt and tool schema
(--system-tokens), each turn appending a tool result or message (--message-tokens, 0.75x-1.25x)
and the model's short answer to the history, with think time between turns, every turn sent
whole (token ids) with the session's X-Session-Id. Histories grow to ~13k tokens.

Sized so that memory, not compute, decides: each engine's KV cache is capped (vLLM's
num_gpu_blocks_override) at --engine-blocks blocks of 128 tokens, so the sessions' working set is
10x or more what an engine holds; the DRAM pool (--segment-mib) holds about a third of it, the
disk tier the rest. Everything else is the colocated manifest's engine (one engine on one node),
the same for all four. The configurations run one after another on one local cluster, each on
the same trace (a fresh one per round); the plain server's engine gets the same flags.

Reported per configuration: TTFT p50/p90 of turns 2+, requests and output tokens per second,
prompt tokens sent and reusable (the history each turn repeats), prompt tokens loaded from the
pool and from its disk tier, the pool's pins and renewals, and TTFT ratios against the plain
server and the pool off. Writes benchmarks/results/agentic.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.rounds import write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VOCAB = (3, 600)  # ordinary token ids of the tiny checkpoints' tokenizer
BLOCK_TOKENS = 128  # vLLM's CPU attention block
CONFIGS = ("vllm", "pool-off", "dram", "dram-disk")
DISK_PATH = "/var/tmp/moe-serve-bench-agentic"


def _log(message: str) -> None:
    print(f"[agentic] {message}", file=sys.stderr, flush=True)


def app_manifest(config: str, args) -> dict:
    """The colocated manifest with the trace's context length, the capped engine and this
    configuration's pool."""
    data = yaml.safe_load((REPO / "manifests" / "local-colocated.yaml").read_text())
    data["name"] = config
    data["model"]["max_model_len"] = args.max_model_len
    data["http"]["route_prefix"] = f"/{config}"
    engine = data["pools"][0]["engine"]
    engine["extra_args"] = {"num_gpu_blocks_override": args.engine_blocks}
    engine["max_num_batched_tokens"] = 4096  # chunked prefill: long prompts never hold the others' streams long
    if config in ("dram", "dram-disk"):
        data["kv_pool"] = {"enabled": True, "segment_mib": args.segment_mib,
                           "sessions": {"idle_s": args.session_idle_s}}
        if config == "dram-disk":
            data["kv_pool"]["disk"] = {"path": DISK_PATH, "capacity_gib": args.disk_gib}
    return data


def make_sessions(args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(*VOCAB) for _ in range(args.system_tokens)]

    def message() -> list[int]:
        length = rng.randint(args.message_tokens * 3 // 4, args.message_tokens * 5 // 4)
        return [rng.randrange(*VOCAB) for _ in range(length)]

    return [{"id": f"agent-{seed}-{i}", "system": system, "messages": [message() for _ in range(args.turns)]}
            for i in range(args.sessions)]


async def run_session(client, url: str, model: str, session: dict, args, start_delay_s: float) -> list[dict]:
    await asyncio.sleep(start_delay_s)
    history = list(session["system"])
    turns = []
    for index, message in enumerate(session["messages"]):
        prompt = history + message
        started = time.perf_counter()
        first_s, answer = None, []
        async with client.stream("POST", f"{url}/v1/completions", headers={"X-Session-Id": session["id"]}, json={
                "model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url}: turn {index} of {session['id']} answered {response.status_code}: "
                                   f"{(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("token_ids"):
                        first_s = first_s if first_s is not None else time.perf_counter() - started
                        answer += choice["token_ids"]
        turns.append({"turn": index, "prompt_tokens": len(prompt), "ttft_s": first_s,
                      "e2e_s": time.perf_counter() - started, "output_tokens": len(answer),
                      # computed before this turn: the history but the last answer's last token
                      "reusable_tokens": len(history) - 1 if index else 0})
        history = prompt + answer
        await asyncio.sleep(args.think_s)
    return turns


async def run_round(url: str, model: str, sessions: list[dict], args) -> tuple[list[dict], float]:
    import httpx

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800) as client:
        per_session = await asyncio.gather(*(run_session(client, url, model, s, args, i * args.stagger_s)
                                             for i, s in enumerate(sessions)))
    return [t for turns in per_session for t in turns], time.perf_counter() - started


def engine_counters(app: str) -> dict:
    from ray import serve

    kv = serve.get_deployment_handle("engine", app_name=app).stats.remote().result(timeout_s=30).kv_transfer or {}
    return {k: v for k, v in kv.items() if isinstance(v, (int, float))}


def summarize(turns: list[dict], seconds: float, delta: dict) -> dict:
    later = sorted(t["ttft_s"] * 1e3 for t in turns if t["turn"] > 0 and t["ttft_s"] is not None)
    reusable = sum((t["reusable_tokens"] // BLOCK_TOKENS) * BLOCK_TOKENS for t in turns)
    loaded = delta.get("pool_blocks_loaded_total", 0) * BLOCK_TOKENS
    from_disk = delta.get("pool_disk_blocks_loaded_total", 0) * BLOCK_TOKENS
    return {"ttft_p50_ms": statistics.median(later), "ttft_p90_ms": later[int(0.9 * (len(later) - 1))],
            "requests_per_s": len(turns) / seconds, "output_tokens_per_s": sum(t["output_tokens"] for t in turns) / seconds,
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns), "reusable_tokens": reusable,
            "tokens_loaded_from_pool": loaded, "tokens_loaded_from_disk": from_disk,
            "share_of_reusable_loaded": loaded / reusable if reusable else 0.0,
            "pool_load_mib_per_s": (delta.get("pool_bytes_loaded_total", 0) / 2**20 / delta["pool_load_seconds_total"]
                                    if delta.get("pool_load_seconds_total") else None),
            "disk_load_mib_per_s": (delta.get("pool_disk_bytes_loaded_total", 0) / 2**20
                                    / delta["pool_disk_load_seconds_total"]
                                    if delta.get("pool_disk_load_seconds_total") else None),
            "blocks_pinned": delta.get("pool_blocks_pinned_total", 0),
            "blocks_renewed": delta.get("pool_blocks_renewed_total", 0),
            "seconds": seconds, "counters": delta}


def run_moe_serve(config: str, args, rounds: list[list[dict]]) -> list[dict]:
    from cluster.kv_pool_service import stop_pool
    from cluster.manifest import parse_manifest
    from cluster.serve_control import deploy
    from ray import serve

    manifest = parse_manifest(app_manifest(config, args), config)
    started = time.monotonic()
    url = deploy(manifest, progress=_log).url
    _log(f"{config} up in {time.monotonic() - started:.0f}s at {url}")
    out = []
    try:
        for index, sessions in enumerate(rounds):
            before = engine_counters(config)
            turns, seconds = asyncio.run(run_round(url, manifest.model.name, sessions, args))
            time.sleep(3)  # the last stores land
            after = engine_counters(config)
            delta = {k: after[k] - before.get(k, 0) for k in after}
            out.append(summarize(turns, seconds, delta) | {"turns": turns})
            _log(f"{config} round {index + 1}: TTFT p50 {out[-1]['ttft_p50_ms']:.0f} ms, "
                 f"loaded {out[-1]['share_of_reusable_loaded']:.0%} of reusable from the pool in {seconds:.0f}s")
    finally:
        serve.delete(config)
        stop_pool(config)
    return out


def run_plain_vllm(args, rounds: list[list[dict]]) -> list[dict]:
    """vLLM's own OpenAI server (prefix caching on, its default) with the same engine flags."""
    from benchmarks.serving_baselines import _free_port, _stop_group, _wait_http_ready, plain_server_command
    from benchmarks.serving_client import _offline_env
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import parse_manifest

    manifest = parse_manifest(app_manifest("vllm", args), "vllm")
    model_path = str(resolve_model_path(manifest.model.path))
    port = _free_port()
    cmd, env = plain_server_command(manifest, model_path, port)
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="bench-agentic-vllm-", suffix=".log")[1])
    _log(f"starting the plain vLLM server: {' '.join(cmd)}")
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_offline_env(env), cwd=REPO,
                                start_new_session=True)
    out = []
    try:
        _wait_http_ready(url, proc, 600, log_path)
        for index, sessions in enumerate(rounds):
            turns, seconds = asyncio.run(run_round(url, manifest.model.name, sessions, args))
            out.append(summarize(turns, seconds, {}) | {"turns": turns})
            _log(f"vllm round {index + 1}: TTFT p50 {out[-1]['ttft_p50_ms']:.0f} ms in {seconds:.0f}s")
    finally:
        _stop_group(proc)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per configuration (a fresh trace each)")
    parser.add_argument("--sessions", type=int, default=14)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048, help="system prompt and tool schema, shared")
    parser.add_argument("--message-tokens", type=int, default=1280, help="mean tool result / message per turn")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--think-s", type=float, default=4.0)
    parser.add_argument("--stagger-s", type=float, default=2.0, help="between session starts")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--engine-blocks", type=int, default=132,
                        help="each engine's KV cap (blocks of 128 tokens; vLLM wants one block beyond max_model_len)")
    parser.add_argument("--segment-mib", type=int, default=96, help="the DRAM pool (one engine's segment)")
    parser.add_argument("--disk-gib", type=float, default=2.0)
    parser.add_argument("--session-idle-s", type=float, default=120.0)
    parser.add_argument("--out", default=str(RESULTS / "agentic.json"))
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect

    rounds = [make_sessions(args, seed=index) for index in range(args.rounds)]
    final = args.system_tokens + args.turns * (args.message_tokens + args.output_tokens)
    working_set = args.sessions * final
    engine_tokens = args.engine_blocks * BLOCK_TOKENS
    pool_tokens = (args.segment_mib << 20) // 2048  # the tiny Qwen3-MoE: 2,048 KV bytes per token
    _log(f"working set ~{working_set:,} tokens: {working_set / engine_tokens:.1f}x an engine's KV "
         f"({engine_tokens:,}), {working_set / pool_tokens:.1f}x the DRAM pool ({pool_tokens:,})")
    results: dict[str, list[dict]] = {}
    if "vllm" in configs:
        results["vllm"] = run_plain_vllm(args, rounds)
    moe = [c for c in configs if c != "vllm"]
    if moe:
        base = parse_manifest(app_manifest("pool-off", args), "pool-off")
        cluster = LocalCluster.for_manifest(base).start(progress=_log)
        try:
            connect(cluster.address)
            for config in moe:
                results[config] = run_moe_serve(config, args, rounds)
        finally:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()

    def med(config: str, key: str) -> float:
        values = [r[key] for r in results[config] if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    rows = [("TTFT p50 ms (turns 2+)", "ttft_p50_ms", "{:,.0f}"), ("TTFT p90 ms (turns 2+)", "ttft_p90_ms", "{:,.0f}"),
            ("requests/s", "requests_per_s", "{:.2f}"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
            ("prompt tokens sent", "prompt_tokens", "{:,.0f}"), ("reusable prompt tokens", "reusable_tokens", "{:,.0f}"),
            ("tokens loaded from the pool", "tokens_loaded_from_pool", "{:,.0f}"),
            ("of those from the disk tier", "tokens_loaded_from_disk", "{:,.0f}"),
            ("share of reusable loaded from the pool", "share_of_reusable_loaded", "{:.0%}"),
            ("pool load MiB/s (all, disk)", "pool_load_mib_per_s", "{:.0f}"),
            ("blocks pinned, renewed", "blocks_pinned", "{:,.0f}")]
    print(f"\nagentic trace: {args.sessions} sessions x {args.turns} turns, {args.system_tokens}-token shared system "
          f"prompt, ~{args.message_tokens}-token messages, {args.output_tokens} output tokens, think {args.think_s:g} s; "
          f"working set ~{working_set:,} tokens = {working_set / engine_tokens:.1f}x an engine's KV, "
          f"{working_set / pool_tokens:.1f}x the DRAM pool; median of {args.rounds} round(s)\n")
    print("| metric | " + " | ".join(configs) + " |\n|---|" + "---:|" * len(configs))
    table: dict = {}
    for label, key, fmt in rows:
        values = {c: med(c, key) for c in configs}
        table[label] = values
        cells = []
        for c in configs:
            cell = fmt.format(values[c]) if values[c] == values[c] else "-"
            if key == "pool_load_mib_per_s" and c in results:
                disk = med(c, "disk_load_mib_per_s")
                cell += f", {disk:.0f}" if disk == disk else ""
            if key == "blocks_pinned" and c in results:
                cell += f", {med(c, 'blocks_renewed'):,.0f}"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")
    for base in ("vllm", "pool-off"):
        if base in configs:
            ratios = {c: med(base, "ttft_p50_ms") / med(c, "ttft_p50_ms") for c in configs if c != base}
            table[f"TTFT p50 gain over {base}"] = ratios
            print(f"\nTTFT p50 (turns 2+) gain over {base}: "
                  + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items()))
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
