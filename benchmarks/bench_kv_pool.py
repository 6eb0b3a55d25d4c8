"""The KV pool on a multi-turn trace: pool on vs off, side by side on one cluster.

    .venv/bin/python -m benchmarks.bench_kv_pool --rounds 2                      # P/D, 32 conversations
    .venv/bin/python -m benchmarks.bench_kv_pool --layout colocated --model deepseek --conversations 4 ...

Two applications of one manifest run at once on one local cluster: `pool-off` without its KV
pool (each engine keeps KV only in its own memory: prefill's prefix cache, decode's off),
`pool-on` with it. `--layout pd` is the default manifest (P/D, 2-rank expert-parallel decode),
`--layout colocated` the colocated one. Rounds alternate between them (off, on, off, on, ...),
so both see the same machine. The trace: conversations that share one system prompt, each
turn sending the whole history (system prompt, earlier messages and the model's answers, as
token ids, as a chat front end does) plus a new user message of a random length around
--message-tokens, with think time between turns. The engines that compute prompts (prefill,
colocated) are capped at --engine-blocks blocks, so the trace's working set outgrows engine
memory as it does on a loaded GPU cluster; decode keeps its KV space (its prefix cache is off).

Reported: TTFT p50/p90 of turns 2+, throughput, how many prompt tokens were loaded from the
pool against how many were reusable (what the cluster had already computed), and, under P/D,
decode's KV intake speed: its pool loads (pool on) against its TCP pulls of the same prompts
(pool off), from the connectors' counters. Writes benchmarks/results/kv_pool[-colocated].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

from benchmarks.checkpoint_variants import wide_qwen3_moe
from benchmarks.rounds import write_results

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
HTTP_PORT = 8000
VOCAB = (3, 600)  # token ids the tiny checkpoints' tokenizer has


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


MANIFESTS = {("pd", "qwen"): "local.yaml", ("colocated", "qwen"): "local-colocated.yaml",
             ("pd", "qwen-wide"): "local.yaml", ("colocated", "qwen-wide"): "local-colocated.yaml",
             ("pd", "deepseek"): "local-deepseek.yaml", ("colocated", "deepseek"): "local-colocated.yaml"}
# vLLM's CPU block sizes: 128 tokens for its attention backend, 16 for MLA (forced by the platform).
BLOCK_TOKENS = {"qwen": 128, "qwen-wide": 128, "deepseek": 16}
PROMPT_POOLS = {"pd": "prefill", "colocated": "engine"}  # the pool whose engine computes prompts


def app_manifest(name: str, pool: bool, engine_kv_gib: int, engine_blocks: int, layout: str, model: str,
                 prefill_segment_mib: int | None = None) -> dict:
    data = yaml.safe_load((REPO / "manifests" / MANIFESTS[(layout, model)]).read_text())
    if model == "deepseek":  # the colocated manifest serves Qwen3-MoE: swap the model in
        data["model"] = yaml.safe_load((REPO / "manifests" / "local-deepseek.yaml").read_text())["model"]
    if model == "qwen-wide":  # benchmarks/checkpoint_variants.py: ~10x the tiny model's prefill cost
        data["model"]["path"] = str(wide_qwen3_moe())
    data["name"] = name
    data["model"]["max_model_len"] = 4096
    data["http"]["route_prefix"] = f"/{name}"
    data["http"]["port"] = HTTP_PORT
    for spec in data["pools"]:
        spec["engine"]["cpu_kvcache_space_gib"] = engine_kv_gib
        if engine_blocks and spec["role"] != "decode":
            # Cap each engine's KV cache (vLLM's num_gpu_blocks_override), so that the trace's
            # working set outgrows engine memory as it does on a loaded GPU cluster.
            spec["engine"]["extra_args"] = {"num_gpu_blocks_override": engine_blocks}
    data["kv_pool"] = {"enabled": pool, "segment_mib": 256}
    if prefill_segment_mib is not None:
        data["kv_pool"]["prefill_segment_mib"] = prefill_segment_mib
    return data


def make_conversations(args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(*VOCAB) for _ in range(args.system_tokens)]
    def message() -> list[int]:
        # Lengths vary (half to 1.5x): with every length a multiple of the block size, each
        # answer would end one token short of a full block and decode would never store one.
        length = rng.randint(args.message_tokens // 2, args.message_tokens * 3 // 2)
        return [rng.randrange(*VOCAB) for _ in range(length)]

    return [{"system": system, "messages": [message() for _ in range(args.turns)]}
            for _ in range(args.conversations)]


async def run_conversation(client, url: str, model: str, conv: dict, args, start_delay_s: float,
                           shared_system: bool) -> list[dict]:
    """`shared_system`: an earlier conversation (started before this one) sent the same system prompt."""
    await asyncio.sleep(start_delay_s)
    history = list(conv["system"])
    turns = []
    for index, message in enumerate(conv["messages"]):
        prompt = history + message
        started = time.perf_counter()
        first_s, answer = None, []
        async with client.stream("POST", f"{url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        first_s = first_s if first_s is not None else time.perf_counter() - started
                        answer += choice["token_ids"]
        turns.append({"turn": index, "prompt_tokens": len(prompt), "ttft_s": first_s,
                      "e2e_s": time.perf_counter() - started, "output_tokens": len(answer),
                      # what the cluster computed before this turn: the previous prompt and
                      # answer but the answer's last token (never fed back)
                      "reusable_tokens": len(history) - 1 if index else (len(history) if shared_system else 0)})
        history = prompt + answer
        await asyncio.sleep(args.think_s)
    return turns


async def run_round(url: str, model: str, conversations: list[dict], args) -> tuple[list[dict], float]:
    import httpx

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        per_conv = await asyncio.gather(*(
            run_conversation(client, url, model, conv, args, i * args.stagger_s, i > 0 and args.stagger_s > 0)
            for i, conv in enumerate(conversations)))
    return [t for turns in per_conv for t in turns], time.perf_counter() - started


def pool_counters(app: str, pools: list[str]) -> dict:
    from ray import serve

    out = {}
    for pool in pools:
        kv = serve.get_deployment_handle(pool, app_name=app).stats.remote().result(timeout_s=30).kv_transfer
        out[pool] = {k: v for k, v in kv.items() if isinstance(v, (int, float))}
    return out


def summarize(turns: list[dict], seconds: float, before: dict, after: dict, block_tokens: int, prompt_pool: str) -> dict:
    later = [t for t in turns if t["turn"] > 0]
    ttft = sorted(t["ttft_s"] * 1e3 for t in later if t["ttft_s"] is not None)
    delta = {pool: {k: after[pool].get(k, 0) - before[pool].get(k, 0) for k in after[pool]} for pool in after}
    prompt_tokens = sum(t["prompt_tokens"] for t in turns)
    # Reusable: what the cluster computed before, in whole blocks: in later turns the history
    # (the previous prompt and answer but its last token), in a first turn the system prompt
    # when an earlier conversation sent it. The pool's counters cover every turn.
    reusable = sum((t["reusable_tokens"] // block_tokens) * block_tokens for t in turns)
    loaded = delta[prompt_pool].get("pool_blocks_loaded_total", 0) * block_tokens
    d = delta.get("decode", {})
    pool_bps = d.get("pool_bytes_loaded_total", 0) / d["pool_load_seconds_total"] if d.get("pool_load_seconds_total") else None
    tcp_bps = d.get("bytes_loaded_total", 0) / d["pull_seconds_total"] if d.get("pull_seconds_total") else None
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
            "requests_per_s": len(turns) / seconds, "output_tokens_per_s": sum(t["output_tokens"] for t in turns) / seconds,
            "prompt_tokens": prompt_tokens, "reusable_tokens": reusable,
            "prefill_tokens_loaded_from_pool": loaded, "share_loaded": loaded / reusable if reusable else 0.0,
            "decode_pool_load_bytes_per_s": pool_bps, "decode_tcp_pull_bytes_per_s": tcp_bps, "counters": delta}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per application (alternating)")
    parser.add_argument("--layout", choices=["pd", "colocated"], default="pd")
    parser.add_argument("--model", choices=["qwen", "qwen-wide", "deepseek"], default="qwen",
                        help="tiny Qwen3-MoE (GQA), its wider variant (~10x the prefill cost; "
                             "benchmarks/checkpoint_variants.py) or tiny DeepSeek-V3 (MLA: a slower prefill on CPU, "
                             "4.5x the KV bytes)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--message-tokens", type=int, default=256, help="mean; each message is 0.5x-1.5x")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--think-s", type=float, default=2.0)
    parser.add_argument("--stagger-s", type=float, default=1.0, help="between conversation starts")
    parser.add_argument("--engine-kv-gib", type=int, default=1)
    parser.add_argument("--engine-blocks", type=int, default=256,
                        help="cap the prefill (colocated) engines' KV cache at this many blocks (128 tokens; 16 for "
                             "deepseek) (0: no cap)")
    parser.add_argument("--prefill-segment-mib", type=int, default=None,
                        help="kv_pool.prefill_segment_mib (0: every object in decode's segments)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/kv_pool[-colocated].json")
    args = parser.parse_args()

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from cluster.local_cluster import LocalCluster
    from cluster.manifest import parse_manifest
    from cluster.serve_control import connect, deploy

    suffix = "".join(f"-{part}" for part in (args.layout, args.model) if part not in ("pd", "qwen"))
    args.out = args.out or str(RESULTS / f"kv_pool{suffix}.json")
    apps = {name: parse_manifest(app_manifest(name, name == "pool-on", args.engine_kv_gib, args.engine_blocks,
                                              args.layout, args.model, args.prefill_segment_mib), name)
            for name in ("pool-off", "pool-on")}
    pools = [pool.name for pool in apps["pool-off"].pools]
    prompt_pool = PROMPT_POOLS[args.layout]
    block_tokens = BLOCK_TOKENS[args.model]
    cluster = LocalCluster.for_manifest(apps["pool-off"]).start(progress=_log)
    results: dict[str, list[dict]] = {name: [] for name in apps}
    try:
        connect(cluster.address)
        urls = {name: deploy(manifest, progress=_log).url for name, manifest in apps.items()}  # waits until ready
        for index in range(args.rounds):
            for name, manifest in apps.items():
                # A fresh trace each round (other random ids): nothing of an earlier round is reusable.
                conversations = make_conversations(args, seed=index)
                before = pool_counters(name, pools)
                turns, seconds = asyncio.run(run_round(urls[name], manifest.model.name, conversations, args))
                time.sleep(2)
                summary = summarize(turns, seconds, before, pool_counters(name, pools), block_tokens, prompt_pool)
                results[name].append(summary)
                _log(f"round {index + 1} {name}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
                     f"{summary['requests_per_s']:.2f} req/s, loaded {summary['share_loaded']:.0%} of reusable")
    finally:
        import ray
        from ray import serve

        from cluster.kv_pool_service import stop_pool

        serve.shutdown()
        stop_pool("pool-on")
        ray.shutdown()
        cluster.shutdown()

    def med(name: str, key: str) -> float:
        values = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    rows = [("TTFT p50 ms (turns 2+)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms (turns 2+)", "ttft_p90_ms", "{:.0f}"),
            ("requests/s", "requests_per_s", "{:.2f}"), ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
            ("prompt tokens sent", "prompt_tokens", "{:,.0f}"),
            ("reusable prompt tokens", "reusable_tokens", "{:,.0f}"),
            (f"{prompt_pool} tokens loaded from the pool", "prefill_tokens_loaded_from_pool", "{:,.0f}"),
            ("share of reusable loaded", "share_loaded", "{:.0%}")]
    working_set = args.conversations * (args.system_tokens + args.turns * (args.message_tokens + args.output_tokens))
    print(f"\nlayout {args.layout}, model {args.model}; trace: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} "
          f"tokens, {args.message_tokens}-token messages, {args.output_tokens} output tokens, think {args.think_s:g} s; "
          f"{prompt_pool} KV {args.engine_blocks * block_tokens if args.engine_blocks else 'up to ' + str(args.engine_kv_gib) + ' GiB'} "
          f"tokens each, working set ~{working_set:,} tokens; median of {args.rounds} rounds per side, alternating\n")
    print("| metric | pool off | pool on | on / off |\n|---|---:|---:|---:|")
    table = {}
    for label, key, fmt in rows:
        off, on = med("pool-off", key), med("pool-on", key)
        table[label] = {"pool_off": off, "pool_on": on}
        ratio = on / off if off else float("nan")
        print(f"| {label} | {fmt.format(off)} | {fmt.format(on)} | {ratio:.2f} |")
    if args.layout == "pd":
        # The same prompts' KV reaches decode from the pool (pool on) or over TCP from the
        # prefill's lease (pool off): the fair comparison of the two ways in.
        pool_bps, tcp_bps = med("pool-on", "decode_pool_load_bytes_per_s"), med("pool-off", "decode_tcp_pull_bytes_per_s")
        print(f"\ndecode KV intake: pool loads {pool_bps / 1e6:.0f} MB/s (pool on) vs TCP pulls "
              f"{tcp_bps / 1e6:.0f} MB/s (pool off) = {pool_bps / tcp_bps:.2f}x")
        table["decode pool load (on) vs tcp pull (off), bytes/s"] = {"pool": pool_bps, "tcp": tcp_bps}
    write_results(args.out, args, table, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
