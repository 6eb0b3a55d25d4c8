"""The tokenizer behind the ingress's `/tokenize` and `/detokenize` routes (`info_routes`).

Generation requests are rendered and tokenized by vLLM's own renderer (`render.py`); this is the
checkpoint's tokenizer for those two utility routes, answering as vLLM's server does.
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
        # The longest token's text: n tokens never cover more than n times this many characters,
        # the bound vLLM puts on prompt text before it tokenizes (vLLM's tokenizers know it).
        self.max_chars_per_token: int = (getattr(hf_tokenizer, "max_chars_per_token", None)
                                         or max(len(token) for token in hf_tokenizer.get_vocab()))

    @classmethod
    def from_path(cls, path: str) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)
