"""Request bodies for the differential fuzz against vLLM's own OpenAI server
(benchmarks/fuzz_vs_vllm.py): seeded, pure Python, no vLLM import.

Five sources, mixed by one seeded RNG, so a seed names the same bodies on every machine:
- grammar: a small valid body for the route plus 0-3 fields of vLLM's request models, each with
  a valid, boundary or invalid value from the tables below;
- mutation: a grammar body with one field dropped, written twice (the key twice in the JSON
  text), retyped, or replaced by a hostile value;
- raw: bytes that are not a JSON object (broken JSON, arrays, strings, numbers, deep nesting);
- info: /tokenize, /detokenize and GET /v1/models[/{id}] bodies and paths;
- fanout: n x prompts past our ingress's bound of 128 sequences, one output token each.

Cost rule: a body that could generate asks for at most MAX_OUTPUT_TOKENS tokens per sequence and
at most MAX_SEQUENCES sequences (checked on the decoded JSON after every mutation, since a
dropped or retyped max_tokens means vLLM's default: the whole context), so thousands of bodies
run in minutes on a CPU engine. Bodies stay under 16 KiB (most under 1 KiB).
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
MODELS = "/v1/models"
GENERATION_ROUTES = (COMPLETIONS, CHAT)
POST_ROUTES = (COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)
MAX_OUTPUT_TOKENS = 8
MAX_SEQUENCES = 4  # n x prompts, outside the few bodies that probe the fan-out limit
NOT_JSON = object()  # FuzzBody.decoded for bytes no JSON parser accepts

# Share of each route ("raw": hand-written non-object bodies to any POST route); of a generation
# route's bodies, FANOUT_SHARE probe the fan-out bound and MUTATION_SHARE of the rest are mutated.
ROUTE_WEIGHTS = {COMPLETIONS: 34, CHAT: 34, TOKENIZE: 11, DETOKENIZE: 9, MODELS: 3, "raw": 9}
FANOUT_SHARE = 0.01
MUTATION_SHARE = 0.45
UNKNOWN_FIELD_SHARE = 0.06
FOCUS_WEIGHT = 5
FOCUS_FIELDS = frozenset({"messages", "prompt", "n", "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias",
                          "stop", "seed", "temperature", "top_p", "top_k", "min_p", "min_tokens", "stream",
                          "response_format", "structured_outputs", "tools", "tool_choice", "allowed_token_ids",
                          "stop_token_ids", "bad_words", "echo", "logprob_token_ids", "truncate_prompt_tokens"})
Pairs = list[tuple[str, object]]  # a JSON object as written: a key may appear twice


@dataclass(frozen=True)
class FuzzBody:
    """One request of the fuzz: the exact bytes sent (lone surrogates survive as JSON escapes)."""

    index: int
    method: str
    path: str
    raw: bytes
    source: str  # grammar | mutation | raw | info | fanout
    label: str  # what chose it, e.g. "top_logprobs=invalid"

    @functools.cached_property
    def decoded(self) -> object:
        """The body as both servers' JSON parsers see it (the last of duplicate keys wins)."""
        try:
            return json.loads(self.raw)
        except (ValueError, RecursionError):
            return NOT_JSON


def generate(count: int, seed: int = 0, model: str = "tiny-qwen3-moe", vocab_size: int = 1024,
             tokenizer_size: int | None = None) -> list[FuzzBody]:
    """`count` bodies; the same arguments give the same bodies. `vocab_size`: the model's (token
    ids at and past it are out of vocabulary); `tokenizer_size`: the tokenizer's, which may be
    smaller (the ids /detokenize probes; default: vocab_size)."""
    rng = random.Random(seed)
    routes, weights = zip(*ROUTE_WEIGHTS.items())
    sizes = (vocab_size, tokenizer_size or vocab_size)
    return [_one(index, rng.choices(routes, weights)[0], rng, model, sizes) for index in range(count)]


def _one(index: int, route: str, rng: random.Random, model: str, sizes: tuple[int, int]) -> FuzzBody:
    vocab_size, tokenizer_size = sizes
    if route == "raw":
        label, raw = rng.choice(RAW_BODIES)
        return FuzzBody(index, "POST", rng.choice(POST_ROUTES), raw, "raw", label)
    if route == MODELS:
        path = rng.choice([MODELS, f"{MODELS}/{model}", f"{MODELS}/no-such-model", f"{MODELS}/"])
        return FuzzBody(index, "GET", path, b"", "info", f"GET {path}")
    if route == TOKENIZE:
        pairs, label = _tokenize_pairs(rng, model)
    elif route == DETOKENIZE:
        pairs, label = _detokenize_pairs(rng, model, tokenizer_size)
    elif rng.random() < FANOUT_SHARE:
        pairs, label = _fanout_pairs(route, rng, model)
        return FuzzBody(index, "POST", route, encode_pairs(pairs), "fanout", label)
    else:
        pairs, label = _grammar_pairs(route, rng, model, vocab_size)
        if rng.random() < MUTATION_SHARE:
            pairs, label = _mutate(pairs, rng, label)
        pairs = capped(route, pairs, rng)
    source = "info" if route in (TOKENIZE, DETOKENIZE) else ("mutation" if "|" in label else "grammar")
    return FuzzBody(index, "POST", route, encode_pairs(pairs), source, label)


def _grammar_pairs(route: str, rng: random.Random, model: str, vocab_size: int) -> tuple[Pairs, str]:
    """A valid small body plus up to three fields with values of a chosen kind."""
    pairs: Pairs = [("model", model)]
    if route == CHAT:
        pairs += [("messages", rng.choice(MESSAGE_LISTS[:4])),
                  (rng.choice(["max_completion_tokens", "max_tokens"]), rng.randint(1, MAX_OUTPUT_TOKENS))]
        table = {**COMMON_FIELDS, **CHAT_FIELDS}
    else:
        pairs += [("prompt", rng.choice(PROMPTS[:4])), ("max_tokens", rng.randint(1, MAX_OUTPUT_TOKENS))]
        table = {**COMMON_FIELDS, **COMPLETION_FIELDS}
    labels = []
    for name in _pick_fields(sorted(table), rng.choice([0, 1, 1, 2, 2, 3]), rng):
        kind = rng.choices(["valid", "boundary", "invalid"], [5, 3, 2])[0]
        values = table[name].get(kind) or table[name]["valid"]
        value = rng.choice(values)
        if isinstance(value, With):
            for other, companion in value.also:
                pairs = _set(pairs, other, companion)
            value = value.value
        pairs = _set(pairs, name, value(vocab_size) if callable(value) else value)  # some depend on the vocabulary
        labels.append(f"{name}={kind}")
    if rng.random() < UNKNOWN_FIELD_SHARE:
        name, value = rng.choice(UNKNOWN_FIELDS)
        pairs = _set(pairs, name, value)
        labels.append(f"unknown:{name}")
    return pairs, ",".join(labels) or "base"


def _pick_fields(names: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` distinct fields; those whose checks live in the engine, not in vLLM's request
    model (FOCUS_WEIGHT), are drawn more often: only a real engine can disagree on them."""
    weights = [FOCUS_WEIGHT if name in FOCUS_FIELDS else 1 for name in names]
    picked: list[str] = []
    while len(picked) < count:
        name = rng.choices(names, weights)[0]
        if name not in picked:
            picked.append(name)
    return picked


def known_fields(route: str) -> frozenset[str]:
    """The top-level fields vLLM's request model for a generation route declares (the tables
    cover exactly those; tests/unit/benchmarks/test_fuzz_bodies.py checks it against vLLM)."""
    return frozenset({**COMMON_FIELDS, **(CHAT_FIELDS if route == CHAT else COMPLETION_FIELDS)})


def _mutate(pairs: Pairs, rng: random.Random, label: str) -> tuple[Pairs, str]:
    name, value = rng.choice(pairs)
    how = rng.choice(["drop", "duplicate", "retype", "hostile"])
    if how == "drop":
        pairs = [(k, v) for k, v in pairs if k != name]
    elif how == "duplicate":  # the key twice; which value comes last (and wins) is drawn
        other = rng.choice(HOSTILE)
        pairs = [(name, other)] + pairs if rng.random() < 0.5 else pairs + [(name, other)]
    elif how == "retype":
        pairs = _set(pairs, name, _retyped(value, rng))
    else:
        pairs = _set(pairs, name, rng.choice(HOSTILE))
    return pairs, f"{label}|{how}:{name}"


def _retyped(value: object, rng: random.Random) -> object:
    options = [str(value), [value], {"value": value}, None, not value if isinstance(value, bool) else True]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        options += [float(value) + 0.5, -value - 1]
    if isinstance(value, str):
        options += [len(value), value + SURROGATE]
    if isinstance(value, list):
        options += [value[:1] if value else "", value * 2, deep(12)]
    return rng.choice(options)


def _tokenize_pairs(rng: random.Random, model: str) -> tuple[Pairs, str]:
    pairs: Pairs = [("model", model)] if rng.random() < 0.8 else []
    if rng.random() < 0.5:
        pairs.append(("prompt", rng.choice(PROMPTS[:6] + [1, None, ["a"], SURROGATE])))
        extras = {"add_special_tokens": [True, False, 1, "yes"], "return_token_strs": [True, False]}
    else:
        pairs.append(("messages", rng.choice(MESSAGE_LISTS)))
        extras = {"add_generation_prompt": [True, False, "no"], "continue_final_message": [True, False],
                  "add_special_tokens": [True, False], "return_token_strs": [True]}
    labels = []
    for name in rng.sample(sorted(extras), rng.choice([0, 0, 1, 2])):
        pairs.append((name, rng.choice(extras[name])))
        labels.append(name)
    if rng.random() < 0.1:
        name, value = rng.choice([("bogus_field", 1), ("model", "no-such-model"), ("model", 5)])
        pairs = _set(pairs, name, value)
        labels.append(f"{name}={value!r}")
    return pairs, "tokenize:" + (",".join(labels) or "base")


def _detokenize_pairs(rng: random.Random, model: str, tokenizer_size: int) -> tuple[Pairs, str]:
    tokens = rng.choice([[1, 2, 3], [], [0], [tokenizer_size - 1], [tokenizer_size], [10 ** 6], [-1], [2 ** 63],
                         [1.0], [1.5], ["5"], [True], "1 2", None, [[1]], list(range(40))])
    pairs: Pairs = [("model", model)] if rng.random() < 0.8 else []
    pairs.append(("tokens", tokens))
    if rng.random() < 0.1:
        pairs.append(("bogus_field", True))
    return pairs, f"detokenize:tokens={_short(tokens)}"


def _fanout_pairs(route: str, rng: random.Random, model: str) -> tuple[Pairs, str]:
    """Our ingress answers n x prompts > 128 with 400; one output token each keeps vLLM's side cheap."""
    n = rng.choice([2, 4, 129])
    if route == CHAT:
        return [("model", model), ("messages", MESSAGE_LISTS[0]), ("n", 129), ("temperature", 1.0),
                ("max_completion_tokens", 1)], "fanout:n=129"
    prompts = ["hi"] * (129 // n + 1)
    return [("model", model), ("prompt", prompts), ("n", n), ("temperature", 1.0), ("max_tokens", 1)], \
        f"fanout:n={n},prompts={len(prompts)}"


def capped(route: str, pairs: Pairs, rng: random.Random) -> Pairs:
    """The cost rule: at most MAX_OUTPUT_TOKENS per sequence, at most MAX_SEQUENCES sequences.
    Judged on the decoded body (what the servers see) and repaired in place."""
    body = json.loads(encode_pairs(pairs))
    if not isinstance(body, dict):
        return pairs
    if route == CHAT:
        governing = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        governing = "max_tokens"
    limit = lax_int(body.get(governing))
    if body.get(governing) is None or (limit is not None and limit > MAX_OUTPUT_TOKENS):
        pairs = _set(pairs, governing, rng.randint(1, MAX_OUTPUT_TOKENS))
    n = lax_int(body.get("n"))
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) and body["prompt"] \
        and not all(isinstance(t, int) for t in body["prompt"]) else 1
    if n is not None and n * prompts > MAX_SEQUENCES:
        pairs = _set(pairs, "n", 1)
    return pairs


_INT_TEXT = re.compile(r"\s*[+-]?\d+(\.0*)?\s*")


def lax_int(value: object) -> int | None:
    """The int pydantic's lax mode would make of a JSON value (bool, integral float, digit
    string), or None when it would refuse it."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value == value and abs(value) != float("inf") and value.is_integer() else None
    if isinstance(value, str) and _INT_TEXT.fullmatch(value):
        return int(float(value)) if "." in value else int(value)
    return None


def _set(pairs: Pairs, name: str, value: object) -> Pairs:
    """Replace the last `name` (the one a JSON parser keeps), or append it."""
    for i in range(len(pairs) - 1, -1, -1):
        if pairs[i][0] == name:
            return pairs[:i] + [(name, value)] + pairs[i + 1:]
    return pairs + [(name, value)]


def encode_pairs(pairs: Pairs) -> bytes:
    return ("{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in pairs) + "}").encode()


def encode(value: object) -> str:
    """JSON text; Raw tokens verbatim; lone surrogates as \\udXXX escapes (ASCII output)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def _short(value: object) -> str:
    text = encode(value)
    return text if len(text) <= 24 else text[:21] + "..."


# -- values ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON token written verbatim: NaN and Infinity are not JSON, yet Python's parser (both
    servers') accepts them."""

    text: str


@dataclass(frozen=True)
class With:
    """A field value that needs companions to reach the check it probes (top_logprobs 21 is
    only an engine-side error once `logprobs` is true)."""

    value: object
    also: tuple[tuple[str, object], ...]


def deep(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


SURROGATE = "\ud800"  # a lone UTF-16 surrogate: json.dumps writes it as the escape \ud800
NAN, INF = Raw("NaN"), Raw("Infinity")
HOSTILE = [None, True, False, 0, -1, 2 ** 64, -2 ** 63 - 1, 10 ** 400, 1.5, 1e308, NAN, INF, Raw("-Infinity"),
           "", "NaN", "1", SURROGATE, "x" * 300, [], {}, [None], {"": None}, deep(30)]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS = (("tools", [TOOL]),)
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
BOOL = {"valid": [True, False], "boundary": ["true", 0, 1], "invalid": [None, "x", [], 2]}
OPTIONAL_BOOL = {"valid": [True, False, None], "invalid": ["x", [], 2]}

# The first four of each are valid; grammar bodies start from those.
PROMPTS: list = ["Hello", "The quick brown fox", [1, 2, 3], ["a b", "c d"], "", "hi " + SURROGATE, [], [[]],
                 [[1, 2], [3]], [-1], [10 ** 6], None, 5, {"text": "hi"}, [1.5], ["a", 5], "word " * 2100,
                 ["x"] * 1025]
MESSAGE_LISTS: list = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"}],
    [{"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    [{"role": "user", "content": ""}],
    [{"role": "assistant", "content": "only me"}],
    [], [{"role": "user"}], [{"content": "hi"}], [{"role": "wizard", "content": "hi"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": "hi " + SURROGATE}], [{"role": "user", "content": [{"type": "bogus"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
    [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "not json"}}]}],
    [{"role": "tool", "content": "42"}], [{"role": "user", "content": deep(20)}],
    [{"role": 5, "content": "hi"}], [None], [[]], [5], "hi", 0, None, -1, {"role": "user", "content": "hi"},
]

COMMON_FIELDS: dict[str, dict[str, list]] = {
    "model": {"valid": [None], "invalid": ["no-such-model", 5, "", ["m"]]},
    "frequency_penalty": {"valid": [0, 0.5, -0.5], "boundary": [-2, 2.0, None], "invalid": [2.5, -3, "high", NAN]},
    "presence_penalty": {"valid": [0, 0.5], "boundary": [-2.0, 2, None], "invalid": [-2.5, 3, "x", INF]},
    "logit_bias": {"valid": [{"5": 2}, {"10": -100, "11": 100}],
                   "boundary": [{}, None, {"0": 100}, lambda vocab: {str(vocab - 1): -100}, {"5": -100.0}],
                   "invalid": [lambda vocab: {str(vocab): 5}, {"1000000": 1}, {"-1": 1}, {"abc": 1}, {"5": "x"},
                               {"5": NAN}, {"5": 1e300}, [1, 2], "x"]},
    "max_tokens": {"valid": [1, 8], "boundary": [0, "4", 4.0, True], "invalid": [-1, "many", 1.5, [], {}]},
    "n": {"valid": [1, 2], "boundary": [4, "2", 2.0, With(2, (("temperature", 0),))],
          "invalid": [0, -1, 1.5, "two", None, []]},
    "seed": {"valid": [0, 42], "boundary": [-1, 2 ** 63 - 1, -2 ** 63, None], "invalid": [2 ** 63, -2 ** 63 - 1, 1.5,
                                                                                        "seed"]},
    "stop": {"valid": ["\n", ["the", "."], []], "boundary": [[""], None, ["a"] * 4, "x" * 100],
             "invalid": [["a"] * 5, [1, 2], 5, [None], {"a": 1}, [SURROGATE]]},
    "stream": {"valid": [False, True], "boundary": [None, "true", 1], "invalid": ["yes", [], 2]},
    "stream_options": {"valid": [With({"include_usage": True}, (("stream", True),))],
                       "boundary": [None, {}, {"include_usage": True},
                                    With({"continuous_usage_stats": True}, (("stream", True),))],
                       "invalid": ["x", With({"include_usage": "maybe"}, (("stream", True),))]},
    "temperature": {"valid": [0, 0.7, 1.0], "boundary": [2.0, 0.0001, None, "0.5"],
                    "invalid": [-0.1, -1, NAN, INF, "hot", 1e308]},
    "top_p": {"valid": [1.0, 0.9], "boundary": [0.01, 1, None], "invalid": [0, -0.5, 1.5, NAN]},
    "user": {"valid": ["u1"], "boundary": ["", None], "invalid": [5, ["u"]]},
    "use_beam_search": {"valid": [False], "boundary": [True, With(True, (("n", 2),))], "invalid": ["x", None]},
    "top_k": {"valid": [-1, 1, 40], "boundary": [0, 10 ** 6, None], "invalid": [-2, 1.5, "k"]},
    "min_p": {"valid": [0.0, 0.05], "boundary": [1.0, None], "invalid": [-0.1, 1.5, NAN]},
    "repetition_penalty": {"valid": [1.0, 1.2], "boundary": [0.01, 2.0, None], "invalid": [0, -1, INF]},
    "watermarking": {"valid": [None, False], "boundary": [True], "invalid": ["x", 2]},
    "length_penalty": {"valid": [1.0], "boundary": [0.0, -1.0], "invalid": ["x", None]},
    "stop_token_ids": {"valid": [[1], []], "boundary": [None, lambda vocab: [vocab - 1]],
                       "invalid": [lambda vocab: [vocab], [-1], [10 ** 9], ["a"], 5]},
    "include_stop_str_in_output": BOOL, "ignore_eos": BOOL, "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL, "add_special_tokens": BOOL,
    "min_tokens": {"valid": [0, 1], "boundary": [8, "1"], "invalid": [-1, 9, 1000, 1.5]},
    "truncate_prompt_tokens": {"valid": [None, 2], "boundary": [-1, 0, 1, 10 ** 6], "invalid": [-2, "x", 2 ** 63]},
    "truncation_side": {"valid": ["left", "right"], "boundary": [None], "invalid": ["middle", 1]},
    "allowed_token_ids": {"valid": [[1, 2, 3]], "boundary": [None, lambda vocab: [vocab - 1]],
                          "invalid": [[], lambda vocab: [vocab], [-1], ["a"]]},
    "prompt_logprobs": {"valid": [None, 0, 1], "boundary": [5, 20], "invalid": [21, -1, -2, "x", 1.5]},
    "logprob_token_ids": {"valid": [With([1, 2], (("logprobs", 1),))], "boundary": [None, []],
                          "invalid": [[1, 2], lambda vocab: [vocab], [-1], "x"]},
    "bad_words": {"valid": [["the"]], "boundary": [[], [""]], "invalid": [[1], "the", [SURROGATE]]},
    "response_format": {"valid": [{"type": "text"}, {"type": "json_object"},
                                  {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}],
                        "boundary": [None, {"type": "json_schema", "json_schema": {"name": "a"}},
                                     {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}],
                        "invalid": [{"type": "json_schema"}, {"type": "bogus"}, "json", {"type": "structural_tag"},
                                    {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}},
                                    {}]},
    "structured_outputs": {"valid": [{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,5}"}, {"json": SCHEMA}],
                           "boundary": [None, {}, {"json_object": True}, {"grammar": 'root ::= "a"'}],
                           "invalid": [{"choice": ["a"], "regex": "b"}, {"regex": "("}, {"choice": []},
                                       {"json": "not json"}, "x", {"bogus": 1}]},
    "priority": {"valid": [0], "boundary": [1, -1], "invalid": [2 ** 63, "high", 1.5]},
    "request_id": {"valid": ["fuzz-request"], "boundary": ["", "x" * 200], "invalid": [5, None]},
    "session_id": {"valid": ["s1"], "boundary": [None, ""], "invalid": [5]},
    "return_tokens_as_token_ids": OPTIONAL_BOOL, "return_token_ids": OPTIONAL_BOOL,
    "return_token_offsets": OPTIONAL_BOOL, "return_mm_kwargs": OPTIONAL_BOOL,
    "routed_experts_prompt_start": {"valid": [0], "boundary": [3], "invalid": [-1, "x"]},
    "mm_payload": {"valid": ["tensors"], "boundary": ["none"], "invalid": ["bytes", 5]},
    "cache_salt": {"valid": ["salt-abc"], "boundary": [None, "a" * 128], "invalid": ["", "a/b", "a@b", "a" * 1025, 5]},
    "kv_transfer_params": {"valid": [None], "boundary": [{}],
                           "invalid": [{"do_remote_prefill": True, "remote_host": "127.0.0.1"}, {"x": 1}, "x"]},
    "ec_transfer_params": {"valid": [None], "boundary": [{}], "invalid": [{"x": 1}, "x"]},
    "vllm_xargs": {"valid": [None], "boundary": [{}], "invalid": [{"a": 1}, {"a": [1, "b"]}, {"a": {"b": 1}}]},
    "repetition_detection": {"valid": [None, {"max_pattern_size": 4, "min_count": 3}], "boundary": [{}],
                             "invalid": [{"max_pattern_size": -1}, {"min_pattern_size": 5, "max_pattern_size": 2}, "x"]},
    "thinking_token_budget": {"valid": [None, 4], "boundary": [-1, 0], "invalid": [-2, "x", 1.5]},
    "stream_interval": {"valid": [None, 1, 2], "invalid": [0, -1, "x"]},
}
COMPLETION_FIELDS: dict[str, dict[str, list]] = {
    "prompt": {"valid": PROMPTS[:4], "boundary": PROMPTS[4:9], "invalid": PROMPTS[9:]},
    "echo": {"valid": [False], "boundary": [True, None], "invalid": ["x", 2]},
    "logprobs": {"valid": [None, 0, 1, 5], "boundary": [20, 21, 25, -1, With(21, (("stream", True),))],
                 "invalid": [-2, 26, 100, "x", True, 1.5]},
    "suffix": {"valid": [None], "boundary": [""], "invalid": ["tail", 5]},
    "prompt_embeds": {"valid": [None], "boundary": [[]], "invalid": ["AAAA", ["AAAA"], 5]},
}
CHAT_FIELDS: dict[str, dict[str, list]] = {
    "messages": {"valid": MESSAGE_LISTS[:6], "boundary": MESSAGE_LISTS[6:9], "invalid": MESSAGE_LISTS[9:]},
    "logprobs": {"valid": [False, True], "boundary": [None], "invalid": ["x", 2]},
    "top_logprobs": {"valid": [0, With(5, (("logprobs", True),))],
                     "boundary": [None, With(20, (("logprobs", True),)), With(21, (("logprobs", True),)),
                                  With(-1, (("logprobs", True),)), 3,
                                  With(21, (("logprobs", True), ("stream", True)))],
                     "invalid": [With(100, (("logprobs", True),)), -2, "x", 1.5]},
    "max_completion_tokens": {"valid": [1, 8], "boundary": [0, "3"], "invalid": [-1, "x", 1.5]},
    "tools": {"valid": [[TOOL]], "boundary": [None, [TOOL, TOOL]],
              "invalid": [[], [{"type": "function"}], [{"type": "bogus", "function": {"name": "f"}}], "x",
                          [{"type": "function", "function": {"name": "f", "parameters": "x"}}]]},
    "tool_choice": {"valid": ["none", With("auto", TOOLS), With("required", TOOLS)],
                    "boundary": [None, With(NAMED, TOOLS)],
                    "invalid": ["auto", "bogus", NAMED, With({"type": "function", "function": {"name": "nope"}}, TOOLS),
                                With({"type": "function", "function": {}}, TOOLS), 5]},
    "reasoning_effort": {"valid": [None, "low"], "boundary": ["none", "max"], "invalid": ["ultra", 5]},
    "include_reasoning": BOOL, "parallel_tool_calls": OPTIONAL_BOOL, "add_generation_prompt": BOOL,
    "echo": {"valid": [False], "boundary": [True], "invalid": ["x", None]},
    "continue_final_message": {"valid": [False], "boundary": [With(True, (("add_generation_prompt", False),))],
                               "invalid": [True, "x"]},
    "documents": {"valid": [None, [{"title": "t", "text": "doc"}]], "boundary": [[]], "invalid": [[{"a": 1}], "x", [5]]},
    "chat_template": {"valid": [None], "boundary": ["{% for m in messages %}{{ m.content }}{% endfor %}"],
                      "invalid": ["{% if %}", 5]},
    "chat_template_kwargs": {"valid": [None, {"enable_thinking": False}], "boundary": [{}],
                             "invalid": [{"tokenize": True}, "x", {"add_generation_prompt": "x"}]},
    "media_io_kwargs": {"valid": [None], "boundary": [{}], "invalid": [{"image": 5}, {"image": {"x": 1}}, "x"]},
    "mm_processor_kwargs": {"valid": [None], "boundary": [{}], "invalid": [{"x": 1}, "x"]},
    "return_prompt_text": OPTIONAL_BOOL,
}
# Fields vLLM's request models do not declare: misspelt, removed from vLLM, OpenAI-legacy.
UNKNOWN_FIELDS: list[tuple[str, object]] = [
    ("bogus_field", 1), ("max_token", 4), ("best_of", 2), ("guided_json", SCHEMA), ("Model", "x"), ("", 1),
    ("functions", [TOOL["function"]]), ("logprob", 2),
]
# (label, bytes) of bodies no request model can take; each goes to a random POST route.
RAW_BODIES: list[tuple[str, bytes]] = [
    ("empty", b""), ("truncated", b'{"prompt": "hi"'), ("not json", b"not json"), ("array", b"[]"),
    ("array of objects", b'[{"prompt": "hi", "max_tokens": 2}]'), ("string", b'"a string"'), ("number", b"42"),
    ("null", b"null"), ("true", b"true"), ("trailing comma", b'{"prompt": "hi",}'),
    ("invalid utf-8", b"\xff\xfe{"), ("invalid utf-8 in string", b'{"prompt": "\xff", "max_tokens": 2}'),
    ("utf-16 object", '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16")),
    ("utf-8 bom", b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}'),
    ("nested 5000 deep", b"[" * 5000 + b"]" * 5000), ("nested objects 1000 deep", b'{"a":' * 1000 + b"1" + b"}" * 1000),
    ("5000-digit integer", b'{"max_tokens": ' + b"9" * 5000 + b"}"), ("NaN model", b'{"model": NaN}'),
    ("nul byte", b"\x00"), ("lone surrogate key", b'{"\\ud800": 1}'), ("bare object", b"{}"),
    ("object of objects", b'{"messages": {"role": "user"}}'),
]
