"""Trace generation: determinism, Poisson arrivals, lengths, shared prefixes."""

import math
import statistics

import pytest

from benchmarks.loadgen.trace import LengthSpec, TraceSpec, make_trace


def spec(**overrides) -> TraceSpec:
    base = dict(
        num_requests=50,
        rate_rps=4.0,
        prompt_tokens=LengthSpec(64, 0.5),
        output_tokens=LengthSpec(16, 0.25),
        seed=7,
    )
    base.update(overrides)
    return TraceSpec(**base)


def test_same_seed_same_trace_and_other_seed_differs():
    assert make_trace(spec()) == make_trace(spec())
    a, b = make_trace(spec(seed=1)), make_trace(spec(seed=2))
    assert [r.prompt for r in a] != [r.prompt for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_changing_rate_keeps_the_same_prompts_and_lengths():
    slow, fast = make_trace(spec(rate_rps=1.0)), make_trace(spec(rate_rps=50.0))
    assert [(r.prompt, r.max_tokens) for r in slow] == [(r.prompt, r.max_tokens) for r in fast]
    assert slow[-1].arrival_s > fast[-1].arrival_s


def test_poisson_inter_arrival_mean_and_spread():
    rate_rps = 5.0
    trace = make_trace(spec(num_requests=20_000, rate_rps=rate_rps))
    arrivals = [r.arrival_s for r in trace]
    assert arrivals[0] == 0.0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert min(gaps) >= 0.0
    mean_gap = statistics.fmean(gaps)
    assert mean_gap == pytest.approx(1.0 / rate_rps, rel=0.04)
    # Exponential gaps have stdev == mean; evenly spaced arrivals would have ~0.
    assert statistics.pstdev(gaps) / mean_gap == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("rate_rps", [0.0, -1.0, math.inf])
def test_burst_puts_every_request_at_zero(rate_rps):
    trace = make_trace(spec(rate_rps=rate_rps))
    assert len(trace) == 50
    assert {r.arrival_s for r in trace} == {0.0}


def test_lengths_fixed_without_spread_and_bounded_with_spread():
    fixed = make_trace(spec(prompt_tokens=LengthSpec(30), output_tokens=LengthSpec(9)))
    assert {r.prompt_words for r in fixed} == {30}
    assert {r.max_tokens for r in fixed} == {9}

    spread = make_trace(spec(num_requests=2000, prompt_tokens=LengthSpec(100, 0.5)))
    words = [r.prompt_words for r in spread]
    assert min(words) >= 50 and max(words) <= 150
    assert max(words) - min(words) > 80  # actually spread, not stuck at the mean
    assert statistics.fmean(words) == pytest.approx(100, rel=0.03)
    for r in spread[:50]:
        assert len(r.prompt.split()) == r.prompt_words
        assert r.prompt.isascii()


def test_shared_prefix_fraction_and_prefix_content():
    prefix_words = 20
    trace = make_trace(
        spec(num_requests=40, shared_prefix_fraction=0.25, shared_prefix_tokens=prefix_words)
    )
    shared = [r for r in trace if r.has_shared_prefix]
    assert len(shared) == 10
    prefix = shared[0].prompt.split()[:prefix_words]
    for r in shared:
        assert r.prompt.split()[:prefix_words] == prefix
    # Unique tails: no two shared-prefix prompts are the same request.
    assert len({r.prompt for r in shared}) == len(shared)
    for r in trace:
        if not r.has_shared_prefix:
            assert r.prompt.split()[:prefix_words] != prefix


def test_no_shared_prefix_by_default_and_prefix_longer_than_prompt():
    assert not any(r.has_shared_prefix for r in make_trace(spec()))
    trace = make_trace(
        spec(
            prompt_tokens=LengthSpec(5),
            shared_prefix_fraction=1.0,
            shared_prefix_tokens=12,
        )
    )
    assert all(r.has_shared_prefix for r in trace)
    assert {r.prompt_words for r in trace} == {13}  # prefix + one unique word


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(shared_prefix_fraction=0.5), "shared_prefix_tokens"),
        (dict(shared_prefix_fraction=1.5, shared_prefix_tokens=4), "shared_prefix_fraction"),
        (dict(num_requests=-1), "num_requests"),
        (dict(rate_rps=math.nan), "rate_rps"),
    ],
)
def test_invalid_specs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        spec(**overrides)


def test_invalid_length_spec():
    with pytest.raises(ValueError, match="spread"):
        LengthSpec(10, 1.5)
    with pytest.raises(ValueError, match="mean_tokens"):
        LengthSpec(0)
