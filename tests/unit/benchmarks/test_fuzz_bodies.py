"""The differential fuzz's body generator (benchmarks/fuzz_bodies.py) and its verdicts
(benchmarks/fuzz_vs_vllm.py), without servers: same seed, same bytes; every route, source and
vLLM request field is reached; lone surrogates are sent as escapes; bodies that could generate
stay cheap; a difference is excused only by a listed reason, a 5xx of ours never."""

import json

import pytest

from benchmarks import fuzz_bodies as fb
from benchmarks.fuzz_vs_vllm import Answer, answer_of, verdict

BODIES = fb.generate(3000, seed=11)


def _generation_dicts(route: str) -> list[dict]:
    return [b.decoded for b in BODIES if b.path == route and isinstance(b.decoded, dict)]


def test_the_same_seed_gives_the_same_bytes_and_another_seed_others():
    again = fb.generate(3000, seed=11)
    assert [(b.path, b.raw) for b in again] == [(b.path, b.raw) for b in BODIES]
    assert [b.raw for b in fb.generate(200, seed=12)] != [b.raw for b in BODIES[:200]]


def test_every_route_and_source_is_reached():
    paths = {b.path for b in BODIES}
    assert {fb.COMPLETIONS, fb.CHAT, fb.TOKENIZE, fb.DETOKENIZE, fb.MODELS, f"{fb.MODELS}/tiny-qwen3-moe"} <= paths
    sources = {(b.path, b.source) for b in BODIES}
    for route in fb.GENERATION_ROUTES:
        assert {(route, s) for s in ("grammar", "mutation", "raw", "fanout")} <= sources
    assert {b.method for b in BODIES} == {"GET", "POST"}


@pytest.mark.parametrize("route", fb.GENERATION_ROUTES)
def test_every_field_of_vllms_request_model_is_sent(route):
    sent = set().union(*(set(body) for body in _generation_dicts(route)))
    assert fb.known_fields(route) <= sent
    assert sent - fb.known_fields(route), "no unknown field was sent"


def test_the_field_tables_are_exactly_vllms_request_fields():
    # A field vLLM adds in a release is then fuzzed only once a table names it.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for route, model in ((fb.CHAT, ChatCompletionRequest), (fb.COMPLETIONS, CompletionRequest)):
        declared = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        assert fb.known_fields(route) == declared, route


def test_boundary_logprob_counts_are_sent():
    chat = _generation_dicts(fb.CHAT)
    assert {5, 20, 21, 100} <= {b.get("top_logprobs") for b in chat if b.get("logprobs") is True}
    completions = {b.get("logprobs") for b in _generation_dicts(fb.COMPLETIONS)}
    assert {0, 1, 5, 20, 21, 25, -1} <= completions
    assert any(isinstance(n, int) and n > 25 for n in completions)


def test_lone_surrogates_go_out_as_json_escapes_in_ascii_bytes():
    surrogate = [b for b in BODIES if b"\\ud800" in b.raw]
    for body in surrogate:
        body.raw.decode("ascii")  # never a UTF-8 encoding (impossible) nor a lossy replacement
    # What the servers decode holds the lone surrogate (unless a duplicate key overrode it).
    decoded = [b for b in surrogate if "\ud800" in json.dumps(b.decoded, ensure_ascii=False)]
    assert len(decoded) > 10 and {b.path for b in decoded} >= {fb.COMPLETIONS, fb.CHAT, fb.TOKENIZE}


def test_raw_bodies_include_non_json_arrays_strings_and_deep_nesting():
    raw = [b for b in BODIES if b.source == "raw"]
    assert any(b.decoded is fb.NOT_JSON for b in raw)
    assert any(isinstance(b.decoded, list) for b in raw) and any(isinstance(b.decoded, str) for b in raw)
    assert any(b.raw.startswith(b"[[[[") for b in raw)


def test_bodies_that_could_generate_ask_for_little():
    for body in BODIES:  # raw bodies are the hand-written RAW_BODIES
        if body.path not in fb.GENERATION_ROUTES or not isinstance(body.decoded, dict) or body.source == "raw":
            continue
        fields = body.decoded
        if body.path == fb.CHAT and fields.get("max_completion_tokens") is not None:
            limit = fields["max_completion_tokens"]
        else:
            limit = fields.get("max_tokens")
        assert limit is not None and (fb.lax_int(limit) or 0) <= fb.MAX_OUTPUT_TOKENS, body
        n = fb.lax_int(fields.get("n", 1)) or 1
        if body.source != "fanout":
            assert n <= fb.MAX_SEQUENCES, body
        assert len(body.raw) < 16 * 1024


def test_lax_int_follows_pydantics_lax_coercion():
    assert [fb.lax_int(v) for v in (True, 7, 8.0, " 9 ", "3.0")] == [1, 7, 8, 9, 3]
    assert [fb.lax_int(v) for v in (1.5, float("nan"), "x", None, [])] == [None] * 5


def _body(path: str, fields: object) -> fb.FuzzBody:
    return fb.FuzzBody(0, "POST", path, fb.encode(fields).encode(), "grammar", "test")


OK, BAD, BROKEN = Answer(200, "2xx", ""), Answer(400, "4xx", "no"), Answer(500, "5xx", "boom")


def test_an_unknown_field_refused_by_us_alone_is_a_listed_difference():
    body = _body(fb.COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "max_token": 3})
    assert verdict(body, BAD, OK) == ("deliberate", "unknown_field")


def test_an_unlisted_refusal_and_every_5xx_of_ours_are_failures():
    plain = _body(fb.COMPLETIONS, {"prompt": "hi", "max_tokens": 2})
    assert verdict(plain, BAD, OK) == ("failure", None)
    assert verdict(plain, BROKEN, BROKEN) == ("failure", None)
    assert verdict(plain, Answer(None, "no-answer", "timeout"), OK) == ("failure", None)
    assert verdict(plain, OK, BROKEN) == ("failure", None)  # vLLM's 5xx is no excuse for a 2xx either
    assert verdict(plain, BAD, BAD) == ("agree", None)


def test_a_listed_difference_excuses_only_our_refusal():
    fanout = _body(fb.COMPLETIONS, {"prompt": ["a"] * 40, "n": 4, "max_tokens": 1})
    assert verdict(fanout, BAD, OK) == ("deliberate", "fan_out")
    assert verdict(fanout, OK, BAD) == ("failure", None)


def test_info_route_bodies_outside_our_strict_models_are_listed():
    assert verdict(_body(fb.TOKENIZE, {"prompt": "hi", "return_token_strs": True}), BAD, OK)[1] == "strict_info_route"
    assert verdict(_body(fb.TOKENIZE, {"prompt": "hi", "add_special_tokens": "yes"}), BAD, OK)[1] == "strict_info_route"
    assert verdict(_body(fb.TOKENIZE, {"prompt": "hi"}), BAD, OK) == ("failure", None)


def test_a_stream_error_event_counts_in_its_class():
    event = 'data: {"error": {"message": "too many", "type": "BadRequestError", "code": 400}}\n\ndata: [DONE]\n\n'
    assert answer_of(200, "text/event-stream", event) == Answer(200, "4xx", "too many", stream_error=True)
    ours = 'data: {"error": {"message": "retry", "type": "service_unavailable", "code": "retry"}}\n\n'
    assert answer_of(200, "text/event-stream; charset=utf-8", ours).outcome == "5xx"
    assert answer_of(200, "text/event-stream", 'data: {"choices": []}\n\ndata: [DONE]\n\n').outcome == "2xx"
    assert answer_of(404, "application/json", '{"error": {"message": "nope"}}') == Answer(404, "4xx", "nope")
