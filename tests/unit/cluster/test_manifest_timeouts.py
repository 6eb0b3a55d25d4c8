"""The manifest's request_timeouts: per-accelerator defaults, the scale-to-zero allowance, and
errors that name the field, the value and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.errors import ManifestError
from cluster.manifest import load_manifest, parse_manifest
from cluster.manifest_timeouts import DEFAULTS, WAKE_UP_S, effective_timeouts
from deployments.stream_deadlines import RequestTimeouts

MANIFESTS = Path(__file__).resolve().parents[3] / "manifests"


def data(name: str, **timeouts) -> dict:
    raw = yaml.safe_load((MANIFESTS / name).read_text())
    raw.pop("request_timeouts", None)
    if timeouts:
        raw["request_timeouts"] = timeouts
    return raw


def issues(raw: dict) -> list:
    with pytest.raises(ManifestError) as info:
        parse_manifest(copy.deepcopy(raw), source="broken.yaml")
    return info.value.issues


def test_defaults_follow_the_accelerator():
    cpu = effective_timeouts(parse_manifest(data("local.yaml")))
    gpu = effective_timeouts(parse_manifest(data("deepseek-v3-h200-disagg-ep.yaml")))
    assert cpu == {**DEFAULTS["cpu"], "total_timeout_s": None}
    assert gpu == {**DEFAULTS["gpu"], "total_timeout_s": None}
    assert gpu["first_token_timeout_s"] < cpu["first_token_timeout_s"]
    # What the deployments build from it.
    assert RequestTimeouts.of(cpu) == RequestTimeouts(120.0, 180.0, 60.0, None, prefill_s_per_1k_tokens=4.0)


def test_the_waits_that_include_a_prefill_grow_with_the_prompt():
    limits = RequestTimeouts.of(effective_timeouts(parse_manifest(data("local.yaml", prefill_s_per_1k_tokens=2))))
    long = limits.for_prompt(32_000)
    assert (long.prefill_timeout_s, long.first_token_timeout_s) == (120.0 + 64, 180.0 + 64)
    # The gap between two tokens is one decode step whatever the prompt; a short prompt keeps
    # about the fixed bounds, and an empty one exactly.
    assert long.inter_token_timeout_s == 60.0 and long.total_timeout_s is None
    assert limits.for_prompt(0) == limits
    assert limits.for_prompt(500).prefill_timeout_s == 121.0
    fixed = RequestTimeouts.of(effective_timeouts(parse_manifest(data("local.yaml", prefill_s_per_1k_tokens=0))))
    assert fixed.for_prompt(32_000) == fixed


@pytest.mark.parametrize("name", ["local.yaml", "deepseek-v3-h200.yaml", "deepseek-v3-h200-disagg-ep.yaml"])
def test_shipped_manifests_spell_out_their_accelerators_defaults(name):
    manifest = load_manifest(MANIFESTS / name)
    explicit = manifest.request_timeouts.model_dump(exclude_none=True)
    assert explicit == DEFAULTS[manifest.accelerator.value]


def test_a_pool_that_may_scale_to_zero_grows_the_waits_that_include_an_engine_start():
    raw = data("local-autoscaling.yaml")
    next(p for p in raw["pools"] if p["role"] == "prefill")["autoscaling"]["min_replicas"] = 0
    limits = effective_timeouts(parse_manifest(raw))
    assert limits["prefill_timeout_s"] == DEFAULTS["cpu"]["prefill_timeout_s"] + WAKE_UP_S["cpu"]
    assert limits["first_token_timeout_s"] == DEFAULTS["cpu"]["first_token_timeout_s"] + WAKE_UP_S["cpu"]
    assert limits["inter_token_timeout_s"] == DEFAULTS["cpu"]["inter_token_timeout_s"]


def test_an_explicit_bound_too_short_for_a_wake_up_is_refused_with_the_fix():
    raw = data("local-autoscaling.yaml", first_token_timeout_s=200)
    next(p for p in raw["pools"] if p["role"] == "decode")["autoscaling"]["min_replicas"] = 0
    (issue,) = issues(raw)
    assert issue.field == "request_timeouts.first_token_timeout_s" and issue.value == 200
    assert "scale to zero" in issue.problem and "600" in issue.fix and "min_replicas: 1" in issue.fix


@pytest.mark.parametrize("field", ["prefill_timeout_s", "first_token_timeout_s", "inter_token_timeout_s",
                                   "total_timeout_s"])
@pytest.mark.parametrize("value", [0, -1])
def test_every_bound_must_be_positive(field, value):
    (issue,) = issues(data("local.yaml", **{field: value}))
    assert issue.field == f"request_timeouts.{field}" and issue.value == value
    assert "greater than 0" in issue.problem


def test_first_token_must_leave_time_after_the_prefill_and_the_kv_pull():
    (issue,) = issues(data("local.yaml", prefill_timeout_s=100, first_token_timeout_s=104))  # transfer 5 s
    assert issue.field == "request_timeouts.first_token_timeout_s" and issue.value == 104
    assert "prefill_timeout_s=100" in issue.problem and "transfer_timeout_s=5" in issue.problem
    assert "longer than both together" in issue.fix
    parse_manifest(data("local.yaml", prefill_timeout_s=100, first_token_timeout_s=106))
    # Colocated: no prefill pool, no such rule.
    parse_manifest(data("local-colocated.yaml", prefill_timeout_s=100, first_token_timeout_s=50))


def test_total_must_exceed_the_first_token_and_inter_token_bounds():
    found = issues(data("local.yaml", total_timeout_s=60))
    assert {i.field for i in found} == {"request_timeouts.total_timeout_s", "request_timeouts.inter_token_timeout_s"}
    total = next(i for i in found if i.field.endswith("total_timeout_s"))
    assert "first_token_timeout_s=180" in total.problem and "or unset it" in total.fix
    assert effective_timeouts(parse_manifest(data("local.yaml", total_timeout_s=900)))["total_timeout_s"] == 900


def test_unknown_key_lists_the_known_ones():
    (issue,) = issues(data("local.yaml", first_token_s=5))
    assert issue.field == "request_timeouts.first_token_s" and "first_token_timeout_s" in issue.fix
