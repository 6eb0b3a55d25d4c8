"""Property-based fuzzing of both generation routes (hypothesis): thousands of hostile or
malformed bodies through the real ingress and vLLM's real render layer (fake engine). None may
get a 5xx or crash the ingress, and a valid request is still served afterwards."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.ingress_fakes import HELLO, FakeEngine, make_client

# 400 bodies per endpoint here (~15 s each); benchmarks/fuzz_bodies.py runs the long campaign.
EXAMPLES = 400
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias", "stream", "stream_options", "tools",
          "tool_choice", "response_format", "min_tokens", "echo", "suffix", "user", "presence_penalty",
          "frequency_penalty", "min_p", "ignore_eos", "return_token_ids", "best_of", "structured_outputs", "bogus"]
scalars = (st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": json_values}), max_size=3)
completion_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 10 ** 6), max_size=8)},
    optional={f: json_values for f in FIELDS if f not in ("model", "prompt")})
# `messages` of any JSON type too: vLLM's validators once iterated whatever it was (a 500).
chat_bodies = st.fixed_dictionaries({"model": st.just("m"), "messages": messages | json_values},
                                    optional={f: json_values for f in FIELDS if f not in ("model", "messages")})

CLIENT, _ = make_client(FakeEngine(script=list(HELLO)), http={"max_request_bytes": 1 << 20})
CHECK = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def _post(path: str, body) -> int:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = CLIENT.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    return response.status_code


@CHECK
@given(completion_bodies)
def test_completions_never_answer_5xx(body):
    _post("/v1/completions", body)


@CHECK
@given(chat_bodies)
def test_chat_completions_never_answer_5xx(body):
    _post("/v1/chat/completions", body)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_never_answer_5xx(raw):
    _post("/v1/chat/completions", raw)
    _post("/v1/completions", raw)


def test_the_ingress_still_serves_after_the_fuzzing():
    assert _post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}) == 200
