"""The fixed prompt set every equality test uses (our stack vs one plain vLLM engine)."""

from __future__ import annotations

MAX_TOKENS = 24

_LONG_SENTENCES = [
    "Mixture of experts models route each token to a few experts out of many.",
    "Prefill processes the whole prompt at once and produces the key value cache.",
    "Decode generates one token at a time and reads the key value cache of every previous token.",
    "Serving large language models on many accelerators needs careful scheduling and placement.",
    "Latency targets for time to first token and inter token latency define the service level.",
]


def long_prompt(sentences: int = 60) -> str:
    """~1,000 tokens with the tiny tokenizer (well over the 512 the issue asks for)."""
    return " ".join(_LONG_SENTENCES[i % len(_LONG_SENTENCES)] + f" ({i})" for i in range(sentences))


COMPLETION_PROMPTS: dict[str, str] = {
    "short": "Hello world, tell me a story",
    "question": "What is the capital of France?",
    "long": long_prompt(),
}

CHAT_CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "chat_single": [{"role": "user", "content": "Explain how a transformer attends to earlier tokens."}],
    "chat_multi": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "One two three"},
        {"role": "assistant", "content": "four five six"},
        {"role": "user", "content": "seven eight nine?"},
    ],
}


def concurrent_prompts(n: int = 32) -> dict[str, str]:
    """Distinct prompts (varied lengths) for the concurrency test."""
    return {f"concurrent_{i}": f"Request {i}: " + " ".join(_LONG_SENTENCES[: 1 + i % 5]) for i in range(n)}
