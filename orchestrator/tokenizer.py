"""Prompt tokenization in the frontend: the router needs token ids, the limits need lengths.

Loads a Hugging Face `tokenizer.json` (Rust `tokenizers`) and the folder's chat template through
`workers.chat_template` (the sim engine loads it the same way, so token ids, and block hashes, agree).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from workers.chat_template import ChatTemplate

__all__ = ["PromptTokenizer", "load_tokenizer"]

_DEFAULT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


class PromptTokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._template = ChatTemplate(folder, fallback=_DEFAULT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template already carries any special tokens, as vLLM does for chat
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


@lru_cache(maxsize=16)
def load_tokenizer(folder: str) -> PromptTokenizer:
    return PromptTokenizer(folder)
