"""The manifest's request_timeouts section: how long each wait of a request may last.

Every wait in the request path is bounded: the remote prefill, the first token, each next
token and, optionally, the whole response. When one expires the ingress aborts the request in
the engine (its KV blocks and any prefill lease are freed), counts it
(`moe_serve_requests_total{outcome="timeout"}`, `moe_serve_request_timeouts_total{wait}`) and
answers 504 (an SSE error event once tokens have been streamed). Unset fields take the
accelerator's default: CPU engines are tens of times slower than GPU ones. A pool that may scale
to zero makes the next request wait for an engine to start inside its prefill and first-token
waits, so their defaults then grow by a start-up allowance.

Checks across fields (and against kv_transfer and autoscaling) run from the manifest's own
validation, so that errors name the field and the fix.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import ManifestIssue

# Per accelerator: prefill, first token, next token (seconds). CPU: a tiny model on two shared
# cores under the test suite's bursts (TTFT p99 up to ~1 minute, ITL p99 ~2 s, BENCHMARKS.md);
# GPU: DeepSeek-V3-class prefills of long prompts take tens of seconds, steps well under one.
# The last one grows the prefill and first-token bounds per thousand prompt tokens: measured on
# this kind of machine, the tiny Qwen3-MoE prefills 32k tokens in 20-55 s (idle / beside the
# test suite), about 1.7 s per thousand; 4 s leaves a slow machine room. A GPU prefills a
# DeepSeek-V3-class model at thousands of tokens per second per node.
DEFAULTS: dict[str, dict[str, float]] = {
    "cpu": {"prefill_timeout_s": 120.0, "first_token_timeout_s": 180.0, "inter_token_timeout_s": 60.0,
            "prefill_s_per_1k_tokens": 4.0},
    "gpu": {"prefill_timeout_s": 60.0, "first_token_timeout_s": 90.0, "inter_token_timeout_s": 30.0,
            "prefill_s_per_1k_tokens": 0.5},
}
# What a replica of a pool at zero may take to start (weights loaded, engine up), per accelerator.
WAKE_UP_S: dict[str, float] = {"cpu": 600.0, "gpu": 1800.0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RequestTimeoutsSpec(_Strict):
    """Bounds on each wait of a request (seconds); unset: the accelerator's default."""

    prefill_timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    """Disaggregated: the wait for the prefill pool's result (its queue and the prompt's compute).
    Default 120 on cpu, 60 on gpu (+ the start-up allowance when the prefill pool may scale to zero)."""
    first_token_timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    """From the request's dispatch to its first token (prefill, KV transfer and decode's queue
    included). Default 180 on cpu, 90 on gpu (+ the start-up allowance when a pool may scale to zero)."""
    inter_token_timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    """Longest gap between two tokens of a stream. Default 60 on cpu, 30 on gpu."""
    total_timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    """From dispatch to the last token; unset: no cap (long generations are legitimate)."""
    prefill_s_per_1k_tokens: Annotated[float, Field(ge=0, le=3600)] | None = None
    """Added to prefill_timeout_s and first_token_timeout_s for each thousand prompt tokens of a
    request, so that one bound fits short and long prompts (a 32k-token prompt's prefill and KV
    transfer take tens of times a short one's). Default 4 on cpu, 0.5 on gpu; 0: fixed bounds."""


def effective_timeouts(manifest: Any) -> dict[str, float | None]:
    """The bounds the deployments enforce: the manifest's values, else the accelerator's defaults
    (prefill and first token grown by the start-up allowance where a pool may scale to zero)."""
    accelerator = manifest.accelerator.value
    spec = manifest.request_timeouts
    out: dict[str, float | None] = {}
    for name, default in DEFAULTS[accelerator].items():
        value = getattr(spec, name)
        if value is None:
            value = default + (WAKE_UP_S[accelerator] if name in _waking_waits(manifest) else 0.0)
        out[name] = value
    out["total_timeout_s"] = spec.total_timeout_s
    return out


def timeout_issues(manifest: Any) -> list[ManifestIssue]:
    """Checks across fields; `manifest` is a cluster.manifest.Manifest."""
    spec, limits = manifest.request_timeouts, effective_timeouts(manifest)
    first, problems = limits["first_token_timeout_s"], []
    if manifest.disaggregated:
        pull_s = manifest.kv_transfer.transfer_timeout_s
        if first <= limits["prefill_timeout_s"] + pull_s:
            problems.append(ManifestIssue(
                "request_timeouts.first_token_timeout_s", first,
                f"not longer than prefill_timeout_s={limits['prefill_timeout_s']:g} plus "
                f"kv_transfer.transfer_timeout_s={pull_s:g}: a prefill that takes nearly its bound leaves decode "
                "no time to pull the KV and compute the first token",
                "make first_token_timeout_s longer than both together (e.g. prefill 60, first token 90), "
                "or shorten prefill_timeout_s"))
    total = spec.total_timeout_s
    if total is not None and total <= first:
        problems.append(ManifestIssue(
            "request_timeouts.total_timeout_s", total, f"not longer than first_token_timeout_s={first:g}: "
            "a request could time out as a whole before it may time out waiting for its first token",
            "raise total_timeout_s well above first_token_timeout_s (it covers the whole generation), or unset it"))
    if total is not None and total <= limits["inter_token_timeout_s"]:
        problems.append(ManifestIssue(
            "request_timeouts.inter_token_timeout_s", limits["inter_token_timeout_s"],
            f"not shorter than total_timeout_s={total:g}: this bound could never fire",
            "make inter_token_timeout_s shorter than total_timeout_s"))
    wake_s = WAKE_UP_S[manifest.accelerator.value]
    for name in sorted(_waking_waits(manifest)):
        value = getattr(spec, name)
        if value is not None and value < wake_s:
            problems.append(ManifestIssue(
                f"request_timeouts.{name}", value,
                f"a pool may scale to zero (autoscaling.min_replicas: 0), and the next request waits inside this "
                f"bound for an engine to start (allow {wake_s:g} s on {manifest.accelerator.value})",
                f"raise it to at least {wake_s:g}, unset it (the default adds that allowance), or set "
                "min_replicas: 1"))
    return problems


def _waking_waits(manifest: Any) -> set[str]:
    """The waits that include an engine's start when a pool at zero wakes for a request."""
    waits: set[str] = set()
    for pool in manifest.pools:
        if pool.autoscaling is not None and pool.autoscaling.min_replicas == 0:
            waits.add("first_token_timeout_s")
            if pool.role.value == "prefill":
                waits.add("prefill_timeout_s")
    return waits
