"""The one adapter to vLLM: start an AsyncLLM from manifest settings and stream token deltas.

Everything above this module sees only our records (EngineRequest, TokenDelta).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from deployments.records import EngineRequest, EngineTiming, TokenDelta
from kv_transfer.params import LoadTiming

logger = logging.getLogger(__name__)

POOL_HASH_ALGO = "sha256"  # cryptographic: vLLM derives its seed from a fixed default, so hashes agree


def engine_args_dict(model: dict, engine: dict, model_path: str) -> dict[str, Any]:
    """AsyncEngineArgs fields for one replica (pure, so `plan` and tests can inspect it)."""
    args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "served_model_name": model["name"],
        "max_model_len": model["max_model_len"],
        "dtype": model["dtype"],
        "enforce_eager": engine["enforce_eager"],
        "max_num_seqs": engine["max_num_seqs"],
        "enable_prefix_caching": engine["enable_prefix_caching"],
        "gpu_memory_utilization": engine["gpu_memory_utilization"],
        "tensor_parallel_size": engine["tensor_parallel_size"],
    }
    for optional in ("max_num_batched_tokens", "block_size"):
        if engine.get(optional) is not None:
            args[optional] = engine[optional]
    if model.get("quantization"):
        args["quantization"] = model["quantization"]
    args.update(engine.get("extra_args") or {})
    return args


def cpu_attention_backend(hf_config: dict, dtype: str) -> str | None:
    """The attention backend to ask vLLM for on CPU, or None for its own choice.

    vLLM 0.32 picks its AMX MLA backend on any x86 CPU with AMX tiles, but that backend packs the
    MLA weights only as bf16/fp16/int8: a float32 MLA model (our tiny DeepSeek-V3) fails to load
    on AMX machines and runs on the others. Asking for the reference CPU MLA backend when the
    dtype is float32 makes the same manifest run, with the same kernels and block size, on every
    machine of this kind."""
    if dtype == "float32" and hf_config.get("kv_lora_rank"):
        return "CPU_MLA"
    return None


def _hf_config(model_path: str) -> dict:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):  # a hub id or an unreadable config: let vLLM decide
        return {}


def kv_transfer_config(connector_settings: dict, failure_policy: str):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="MoeServeConnector",
        kv_connector_module_path="kv_transfer.connector",
        kv_role="kv_both",
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config=connector_settings,
    )


def engine_transfer_params(request: EngineRequest) -> dict | None:
    """vLLM's kv_transfer_params for a request: the one place our typed transfer records become
    the engine's dict (read by kv_transfer/connector_scheduler.py inside the engine)."""
    from kv_transfer.params import SESSION_KEY, prefill_request_params

    if request.pull is not None:
        params = request.pull.to_engine()
    else:
        params = prefill_request_params() if request.produce_kv else None
    if request.session_id:  # the pool pins a session's KV in DRAM (kv_pool.sessions; else ignored)
        params = {**(params or {}), SESSION_KEY: True}
    return params


def to_sampling_params(spec: Any, kv_transfer_params: dict | None = None):
    """vLLM SamplingParams streaming deltas: the ingress's rendered params (a copy), or ours mapped."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if isinstance(spec, SamplingParams):
        params = spec.clone()
        params.output_kind = RequestOutputKind.DELTA
        # vLLM's Request reads its kv_transfer_params from extra_args, where its request models
        # copy a client's `kv_transfer_params` and `vllm_xargs`. The ingress refuses both, and
        # here, at the last step before the engine, extra_args are ours alone: our transfer
        # parameters or nothing, whatever the params arrived with.
        params.extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        return params
    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,  # 0 = all tokens, as in vLLM
        min_tokens=spec.min_tokens,
        seed=spec.seed,
        stop=list(spec.stop) or None,
        ignore_eos=spec.ignore_eos,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def _clamp(logprob: float) -> float:
    # The OpenAI shapes' floor, as vLLM's servers apply it: -inf and NaN become -9999.0.
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


def token_logprobs(token_ids: list[int], logprobs: list | None, top: int | None) -> list | None:
    """vLLM's per-token Logprob maps as plain tuples (see TokenDelta.logprobs); `top`: the
    request's logprobs count (None: none asked for)."""
    if logprobs is None or top is None:
        return None
    entries = []
    for token_id, step in zip(token_ids, logprobs):
        chosen = step.get(token_id) if step else None
        if chosen is None:
            entries.append((token_id, -9999.0, None, []))
            continue
        # Every entry vLLM returned (the sampled token and the top-k): the ingress cuts them the
        # way vLLM's server does for each API (chat: k; completions: all).
        ranked = [(t, _clamp(lp.logprob), lp.rank or None) for t, lp in step.items()]
        entries.append((token_id, _clamp(chosen.logprob), chosen.rank or None, ranked))
    return entries


def engine_timing(output: Any) -> EngineTiming | None:
    """Queue and first-token time from vLLM's per-request stats (None when stats are off)."""
    stats = getattr(output, "metrics", None)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    first_token = getattr(stats, "first_token_ts", 0.0)
    if not scheduled or not first_token:
        return None
    return EngineTiming(queue_s=max(scheduled - stats.queued_ts, 0.0), first_token_s=max(first_token - scheduled, 0.0))


class VLLMEngine:
    """A running vLLM AsyncLLM."""

    def __init__(self, llm: Any, max_model_len: int, scheduler: Any = None):
        self._llm = llm
        self.max_model_len = max_model_len
        self.scheduler = scheduler  # SchedulerSnapshot: the latest waiting/running/KV usage (None: not kept)

    @classmethod
    def start(cls, model: dict, engine: dict, model_path: str, *, stat_loggers: list | None = None,
              kv_connector: dict | None = None, ray_metrics: bool = False,
              kv_events: dict | None = None) -> "VLLMEngine":
        """`ray_metrics`: also record vLLM's own metrics (vllm:*) through Ray's metrics pipeline;
        `kv_events`: vLLM's kv_events_config (publish the prefix cache's stores and evictions)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        fields = engine_args_dict(model, engine, model_path)
        from vllm.platforms import current_platform

        from deployments.engine.cpu_priority import engine_niceness, set_process_niceness

        # Before AsyncLLM starts the engine-core and worker processes: they inherit it.
        set_process_niceness(engine_niceness(engine.get("nice"), current_platform.is_cpu()))
        backend = cpu_attention_backend(_hf_config(model_path), model["dtype"]) if current_platform.is_cpu() else None
        if backend and "attention_backend" not in fields and "attention_config" not in fields:
            fields["attention_backend"] = backend
        if kv_connector is not None:
            fields["kv_transfer_config"] = kv_transfer_config(kv_connector, kv_connector["failure_policy"])
            if kv_connector.get("pool"):
                # Pool keys are vLLM's block hashes: every engine must hash alike (see pool/keys.py).
                fields.setdefault("prefix_caching_hash_algo", POOL_HASH_ALGO)
        if kv_events is not None:
            from vllm.config import KVEventsConfig

            fields["kv_events_config"] = KVEventsConfig(**kv_events)
        args = AsyncEngineArgs(**fields)
        scheduler = None
        if ray_metrics:
            from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

            from deployments.engine.vllm_scheduler_snapshot import SchedulerSnapshot, snapshot_logger

            scheduler = SchedulerSnapshot()
            stat_loggers = [*(stat_loggers or []), RayPrometheusStatLogger, snapshot_logger(scheduler)]
        llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=stat_loggers)
        return cls(llm, model["max_model_len"], scheduler)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        from vllm.inputs import TokensPrompt

        prompt_tokens = len(request.prompt_token_ids)
        completion_tokens = 0
        params = to_sampling_params(request.sampling, engine_transfer_params(request))
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        stream = self._llm.generate(prompt, params, request.request_id)
        first = True
        async for output in stream:
            completion = output.outputs[0]
            completion_tokens += len(completion.token_ids)
            yield TokenDelta(
                text=completion.text,
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason if output.finished else None,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                kv_transfer_params=output.kv_transfer_params if output.finished else None,
                engine_timing=engine_timing(output) if first else None,
                kv_load=LoadTiming.from_engine(output.kv_transfer_params) if output.finished else None,
                cached_tokens=(output.num_cached_tokens or 0) if first else None,
                logprobs=token_logprobs(completion.token_ids, completion.logprobs, params.logprobs),
                stop_reason=completion.stop_reason if output.finished else None,
            )
            first = False

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self) -> None:
        await self._llm.check_health()

    async def collective_rpc(self, method: str) -> list:
        """Call a worker-extension method on every worker of this engine (one result each)."""
        return await self._llm.collective_rpc(method)

    def unfinished_requests(self) -> int:
        """Requests the engine front-end still tracks (0 once every request finished or aborted)."""
        return self._llm.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        self._llm.shutdown()
