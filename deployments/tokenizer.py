"""Prompt rendering and tokenization, done once at the ingress so every engine gets token ids.

Mirrors vLLM's own OpenAI server: completions encode the prompt with special tokens added;
chat renders the checkpoint's chat template (with the generation prompt) and encodes the result
without adding special tokens again.
"""

from __future__ import annotations

from typing import Any


class PromptTokenizer:
    def __init__(self, hf_tokenizer: Any):
        self._tok = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_path(cls, path: str) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(text, add_special_tokens=False))
