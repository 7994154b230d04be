"""Prompt tokenization in the frontend: the router needs token ids, the limits need lengths.

Loads a Hugging Face `tokenizer.json` (Rust `tokenizers`) and the folder's chat template through
`workers.chat_template` (the sim engine loads it the same way, so token ids, and block hashes, agree).

Long prompts: `Tokenizer.encode` holds the GIL for the whole call (a 1M-character prompt: ~0.5 s of
a stalled event loop, even from a thread); `encode_batch` releases it while it tokenizes, but freeing
its result (offsets and token strings per token) holds the GIL again (~0.2 s for 4M characters).
`count_or_ids` uses `encode_batch_fast` (no offsets: the same ids, ~6x faster, ~1 ms to free), off the
loop for long prompts (orchestrator/prepare.py), and builds the Python list of ids only for a prompt
that fits the context. Where orchestrator/fast_bpe.py proves tiktoken's BPE core gives the same ids
(tiktoken-style byte-level vocabularies such as the sim's cl100k; checked per file at load), it encodes
instead, for about a fifth of the CPU (benchmarks/results/prompt_prep.md). `max_chars_per_token` bounds how
many characters one token can cover (the longest vocabulary entry; x4 under a Unicode normalizer, which can
fold several characters into one), so `chars > context x max_chars_per_token` proves a prompt too long
without tokenizing it.
"""

from __future__ import annotations

import logging
import threading
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from orchestrator.fast_bpe import FastBpe, fast_encoder
from workers.chat_template import ChatTemplate

__all__ = ["PromptTokenizer", "load_tokenizer"]

log = logging.getLogger("kvyard.tokenizer")

_DEFAULT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


class PromptTokenizer:
    def __init__(self, folder: str | Path, fast_bpe: bool = True) -> None:
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # the exact fast encoder once checked (a second or so, on its own thread: the tokenizer serves with Hugging
        # Face's encoder meanwhile, so it is usable, and requests KV-routed, as soon as it loads), or why not
        self.fast: FastBpe | None = None
        self.fast_reason: str | None = "being checked" if fast_bpe else "fast_bpe is off"
        self._fast_checked = threading.Event()
        self._folder = str(folder)
        if fast_bpe:
            threading.Thread(target=self._check_fast, name="kvyard-fast-bpe", daemon=True).start()
        else:
            self._fast_checked.set()
        self._template = ChatTemplate(folder, fallback=_DEFAULT_TEMPLATE)
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = max(1, longest) * (4 if self._tok.normalizer is not None else 1)
        self._hf_many = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: tokenizers >= 0.21

    def _check_fast(self) -> None:
        fast, why = fast_encoder(self._tok)
        self.fast_reason = why
        self.fast = fast  # one reference store: each encode reads it once
        self._fast_checked.set()
        if fast is None:
            log.info("tokenizer %s keeps Hugging Face's encoder: %s", self._folder, why)

    def wait_fast(self, timeout: float | None = None) -> FastBpe | None:
        """The fast encoder once the check is done (None: not usable for this tokenizer, or not done in time)."""
        self._fast_checked.wait(timeout)
        return self.fast

    @property
    def raw(self) -> Tokenizer:
        """The Rust tokenizer (orchestrator/token_cache.py inspects its pipeline)."""
        return self._tok

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The ids of several texts, with the GIL released while they are tokenized."""
        fast = self.fast
        if fast is not None:
            return [fast.encode(t, add_special_tokens) for t in texts]
        return [e.ids for e in self._hf_many(texts, add_special_tokens=add_special_tokens)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        fast = self.fast
        if fast is not None:
            return fast.encode(text, add_special_tokens)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def count_or_ids(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
        """(token count, ids): the ids only when the count is at most `limit`. Releases the GIL while it tokenizes."""
        fast = self.fast
        if fast is not None:
            return fast.count_or_ids(text, limit, add_special_tokens)
        enc = self._hf_many([text], add_special_tokens=add_special_tokens)[0]
        n = len(enc)
        return n, (enc.ids if n <= limit else None)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template already carries any special tokens, as vLLM does for chat
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def load_tokenizer(folder: str, fast_bpe: bool = True) -> PromptTokenizer:
    """One PromptTokenizer per (folder, fast_bpe) in a process."""
    return _load(folder, fast_bpe)


@lru_cache(maxsize=16)
def _load(folder: str, fast_bpe: bool) -> PromptTokenizer:
    return PromptTokenizer(folder, fast_bpe)
