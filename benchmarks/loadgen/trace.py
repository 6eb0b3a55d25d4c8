"""Deterministic request traces: when each request arrives and what it asks for.

Pure: no I/O, no clock. The same `TraceSpec` (seed included) always yields the same
trace, so two server configurations can be compared on identical requests.

Rules:
- Arrivals are a Poisson process: inter-arrival gaps are exponential with mean
  1 / rate_rps, the first request arrives at 0 s. rate_rps <= 0 or inf puts every
  request at 0 s (a burst).
- Lengths are uniform integers in [mean * (1 - spread), mean * (1 + spread)],
  clamped to >= 1, so the mean stays `mean_tokens` and spread=0 gives fixed lengths.
- Prompts are space-separated words from a fixed English word list. Lengths are
  counted in words and only approximate tokens: the server's tiny byte-level BPE
  spends roughly one to two tokens per common word.
- Exactly round(shared_prefix_fraction * num_requests) requests, chosen at random,
  start with one common prefix of shared_prefix_tokens words followed by a unique
  tail; their total length is max(sampled length, prefix + 1) words.
- Arrivals, lengths, prefix membership and words use separate random streams
  derived from the seed, so changing the rate keeps the very same prompts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Plain lowercase English words: each is a handful of ASCII bytes, so byte-level BPE
# token counts stay close to word counts and no word splits into odd byte pieces.
WORDS: tuple[str, ...] = tuple(
    """
    time year people way day man thing woman life child world school state family
    student group country problem hand part place case week company system program
    question work government number night point home water room mother area money
    story fact month lot right study book eye job word business issue side kind head
    house service friend father power hour game line end member law car city
    community name president team minute idea kid body information back parent face
    others level office door health person art war history party result change
    morning reason research girl guy moment air teacher force education foot boy age
    policy music market sense nation plan college interest death experience effect
    class control care field development role effort rate heart drug show leader
    light voice wife police mind price report decision son view relationship town
    road arm difference value building action model season society tax director
    position player record paper space ground form event official matter center
    couple site project activity star table need court oil situation cost industry
    figure street image phone data picture practice piece land product doctor wall
    patient worker news test movie north love support technology step baby computer
    type attention film tree source organization hair window evidence population
    harbor river garden bridge stone cloud summer winter island valley forest engine
    """.split()
)


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution: uniform integers around a mean (see module rules)."""

    mean_tokens: int
    spread: float = 0.0  # half-width as a fraction of the mean, in [0, 1]

    def __post_init__(self) -> None:
        if self.mean_tokens < 1:
            raise ValueError(f"mean_tokens={self.mean_tokens}: must be >= 1")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"spread={self.spread}: must be in [0, 1] (0 = fixed length)")

    @property
    def min_tokens(self) -> int:
        return max(1, round(self.mean_tokens * (1.0 - self.spread)))

    @property
    def max_tokens(self) -> int:
        return max(1, round(self.mean_tokens * (1.0 + self.spread)))

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.min_tokens, self.max_tokens)


@dataclass(frozen=True)
class TraceSpec:
    """What load to generate. Token counts here are word counts (see module docstring)."""

    num_requests: int
    rate_rps: float  # Poisson arrival rate; <= 0 or inf means all requests at 0 s
    prompt_tokens: LengthSpec
    output_tokens: LengthSpec
    shared_prefix_fraction: float = 0.0
    shared_prefix_tokens: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 0:
            raise ValueError(f"num_requests={self.num_requests}: must be >= 0")
        if math.isnan(self.rate_rps):
            raise ValueError("rate_rps is NaN: pass a positive rate, or 0 / inf for a burst")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(
                f"shared_prefix_fraction={self.shared_prefix_fraction}: must be in [0, 1]"
            )
        if self.shared_prefix_tokens < 0:
            raise ValueError(f"shared_prefix_tokens={self.shared_prefix_tokens}: must be >= 0")
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens == 0:
            raise ValueError(
                "shared_prefix_fraction > 0 needs shared_prefix_tokens >= 1; "
                "set the prefix length or set the fraction to 0"
            )

    @property
    def is_burst(self) -> bool:
        return self.rate_rps <= 0 or math.isinf(self.rate_rps)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, in arrival order."""

    request_id: int
    arrival_s: float  # offset from the start of the run
    prompt: str
    prompt_words: int  # approximate prompt length in tokens
    max_tokens: int  # output length to ask for (sent with ignore_eos)
    has_shared_prefix: bool


def arrival_times_s(num_requests: int, rate_rps: float, rng: random.Random) -> list[float]:
    """Poisson arrivals starting at 0 s; a burst when rate_rps <= 0 or inf."""
    if num_requests == 0:
        return []
    if rate_rps <= 0 or math.isinf(rate_rps):
        return [0.0] * num_requests
    times_s = [0.0]
    for _ in range(num_requests - 1):
        times_s.append(times_s[-1] + rng.expovariate(rate_rps))
    return times_s


def _words(rng: random.Random, count: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(count)]


def make_trace(spec: TraceSpec) -> list[TraceRequest]:
    """Build the trace for `spec`; deterministic in spec (seed included)."""
    n = spec.num_requests
    # Independent streams per aspect: see "separate random streams" in the module rules.
    arrival_rng = random.Random(f"{spec.seed}:arrivals")
    length_rng = random.Random(f"{spec.seed}:lengths")
    prefix_rng = random.Random(f"{spec.seed}:prefix")
    word_rng = random.Random(f"{spec.seed}:words")

    arrivals_s = arrival_times_s(n, spec.rate_rps, arrival_rng)
    prompt_lens = [spec.prompt_tokens.sample(length_rng) for _ in range(n)]
    output_lens = [spec.output_tokens.sample(length_rng) for _ in range(n)]

    num_shared = round(spec.shared_prefix_fraction * n)
    shared_ids = set(prefix_rng.sample(range(n), num_shared))
    prefix_words = _words(word_rng, spec.shared_prefix_tokens) if num_shared else []

    trace = []
    for i in range(n):
        if i in shared_ids:
            # At least one unique word after the prefix, so requests are not identical.
            tail_len = max(1, prompt_lens[i] - len(prefix_words))
            words = prefix_words + _words(word_rng, tail_len)
        else:
            words = _words(word_rng, prompt_lens[i])
        trace.append(
            TraceRequest(
                request_id=i,
                arrival_s=arrivals_s[i],
                prompt=" ".join(words),
                prompt_words=len(words),
                max_tokens=output_lens[i],
                has_shared_prefix=i in shared_ids,
            )
        )
    return trace
