"""Reading a Hugging Face tokenizer folder's chat template, the one way both sides do it.

The frontend tokenizes chat prompts to route them, and the sim engine tokenizes them to serve them; if
the two rendered the template differently, the frontend's block hashes would not match the engine's
cache. Both therefore load it here, as Hugging Face does: `chat_template.jinja` if present, else
`tokenizer_config.json["chat_template"]` (a string, or a list of named templates: "default"), rendered
in a sandboxed Jinja2 with the folder's special tokens (bos_token, eos_token, ...) in scope.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "read_tokenizer_config"]

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


def read_tokenizer_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


class ChatTemplate:
    def __init__(self, folder: str | Path, config: dict[str, Any] | None = None, fallback: str | None = None) -> None:
        folder = Path(folder)
        config = read_tokenizer_config(folder) if config is None else config
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        template = template or fallback
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if template else None
        self._specials = {k: config[k] for k in _SPECIALS if isinstance(config.get(k), str)}

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("the tokenizer has no chat template")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **{**self._specials, **kwargs})
