"""Greedy outputs of ONE plain vLLM engine (vllm.LLM, offline) for the fixed prompt set.

Run as a script (vLLM spawns engine processes, so it needs the __main__ guard):
    python tests/reference_engine.py MODEL_PATH OUT.json [--max-model-len N] [--dtype D]
Writes {name: {"token_ids": [...], "text": "..."}} for every prompt and conversation, or, with
--token-prompts FILE ({name: [token ids]}), for those prompts only, one at a time (long ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.prompt_set import CHAT_CONVERSATIONS, COMPLETION_PROMPTS, MAX_TOKENS, concurrent_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_path")
    parser.add_argument("out")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="run every prompt alone (vLLM 0.32's CPU MLA path is not batch-invariant)")
    parser.add_argument("--prompts", default="",
                        help="comma-separated names of the completion prompts to run (default: all, with the "
                             "concurrency set); the chat conversations always run")
    parser.add_argument("--token-prompts", default="",
                        help="a JSON file of {name: [token ids]}: run only these, one at a time (long prompts)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from deployments.engine.vllm_engine import _hf_config, cpu_attention_backend

    # The attention backend our engines ask for on this machine (AMX machines differ for MLA).
    backend = cpu_attention_backend(_hf_config(args.model_path), args.dtype)
    options = {"attention_backend": backend} if backend else {}
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model_path, enforce_eager=True, max_model_len=args.max_model_len, dtype=args.dtype,
              gpu_memory_utilization=0.15, **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results: dict[str, dict] = {}
    if args.token_prompts:
        from vllm.inputs import TokensPrompt

        for name, token_ids in json.loads(Path(args.token_prompts).read_text()).items():
            output = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], greedy, use_tqdm=False)[0]
            results[name] = {"token_ids": list(output.outputs[0].token_ids), "text": output.outputs[0].text}
            print(f"[reference] {name}: {len(token_ids)} prompt tokens done", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        return

    prompts = {**COMPLETION_PROMPTS, **concurrent_prompts()}
    if args.prompts:  # a caller that needs a few answers does not wait for 39 (one at a time: minutes)
        prompts = {name: prompts[name] for name in args.prompts.split(",")}
    if args.one_at_a_time:
        outputs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in prompts.values()]
    else:
        outputs = llm.generate(list(prompts.values()), greedy, use_tqdm=False)
    for name, output in zip(prompts, outputs):
        results[name] = {"token_ids": list(output.outputs[0].token_ids), "text": output.outputs[0].text,
                         "prompt_token_ids": list(output.prompt_token_ids)}
    for name, messages in CHAT_CONVERSATIONS.items():
        output = llm.chat(messages, greedy, use_tqdm=False)[0]
        results[name] = {"token_ids": list(output.outputs[0].token_ids), "text": output.outputs[0].text,
                         "prompt_token_ids": list(output.prompt_token_ids)}
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
