"""Prompt tokenization in the frontend: the router needs token ids, the limits need lengths.

Loads a Hugging Face `tokenizer.json` (Rust `tokenizers`) and the chat template from
`tokenizer_config.json["chat_template"]` or `chat_template.jinja`, rendered with a sandboxed Jinja2.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["PromptTokenizer", "load_tokenizer"]

_DEFAULT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


class PromptTokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template or _DEFAULT_TEMPLATE)
        self._specials = {k: v for k, v in cfg.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._specials)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template already carries any special tokens, as vLLM does for chat
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


@lru_cache(maxsize=16)
def load_tokenizer(folder: str) -> PromptTokenizer:
    return PromptTokenizer(folder)
