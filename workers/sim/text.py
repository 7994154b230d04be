"""The sim's tokenizer (bundled cl100k as a Hugging Face tokenizer.json) and its deterministic output text.

Prompts are tokenized for real, so prompt lengths, prefix-cache hits and KV-event token ids are what a
cl100k model would see. Output tokens come from a fixed sequence of `TEXT_LENGTH` ids drawn (seeded)
from "word" tokens (a space + 2..10 lowercase letters) with a `,` or `.` now and then:

    offset(prompt) = (crc32(prompt token ids as uint32 LE) + seed) mod TEXT_LENGTH
    output[k]      = sequence[(offset + k) mod TEXT_LENGTH]

so the same request always yields the same text, different prompts usually differ, and each output
token decodes on its own (its string is precomputed), which makes streaming cheap and re-tokenizing the
text (a later chat turn) gives back the same ids.
"""

from __future__ import annotations

import re
import zlib
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from workers.chat_template import ChatTemplate, read_tokenizer_config

__all__ = ["TOKENIZER_DIR", "TEXT_LENGTH", "SimTokenizer", "TextSource"]

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
TEXT_LENGTH = 4096
SAMPLE_STRIDE = 1031  # offset between the n samples of one request (prime: no short cycles mod TEXT_LENGTH)
_WORD = re.compile(r"^\u0120[a-z]{2,10}$")  # byte-level BPE: U+0120 'Ġ' is the leading space


class SimTokenizer:
    def __init__(self, path: str | Path = TOKENIZER_DIR) -> None:
        path = Path(path)
        self.path = path
        self._tk = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._encode_many = getattr(self._tk, "encode_batch_fast", self._tk.encode_batch)
        self.config: dict[str, Any] = read_tokenizer_config(path)
        self._template = ChatTemplate(path, self.config)
        eos = self.config.get("eos_token")
        self.eos_token_id = self._tk.token_to_id(eos) if isinstance(eos, str) else None
        self.vocab_size = self._tk.get_vocab_size()
        self._max_chars: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast (tokenizers >= 0.21): the same ids without computing offsets, and the GIL released
        # while it runs; the sim's CPU is not its timing (that comes from the profile), but 8-64 sims
        # share the benchmark machine with the component under test
        return self._encode_many([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(i)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._template.render(messages, add_generation_prompt, **kwargs)

    @property
    def max_chars_per_token(self) -> int:
        """Longest token in characters (vLLM's bound for rejecting over-long text before tokenizing)."""
        if self._max_chars is None:
            self._max_chars = max((len(t) for t in self._tk.get_vocab()), default=1)
        return self._max_chars


class TextSource:
    """Deterministic output tokens with precomputed strings."""

    def __init__(self, tokenizer: SimTokenizer, seed: int = 0, length: int = TEXT_LENGTH) -> None:
        words = [i for t, i in tokenizer._tk.get_vocab().items() if _WORD.match(t)]
        words.sort()
        punct = [i for i in (tokenizer._tk.token_to_id(","), tokenizer._tk.token_to_id(".")) if i is not None]
        rng = np.random.default_rng(seed)
        seq = rng.choice(np.asarray(words), size=length)
        if punct:
            marks = rng.random(length) < 0.08
            seq[marks] = rng.choice(np.asarray(punct), size=int(marks.sum()))
        self.sequence: tuple[int, ...] = tuple(int(v) for v in seq)
        self.seed = seed
        self.length = length
        self.strings: dict[int, str] = {i: tokenizer.decode([i]) for i in set(self.sequence)}

    def offset(self, prompt_token_ids: Sequence[int]) -> int:
        try:
            raw = array("I", prompt_token_ids).tobytes()
        except (OverflowError, TypeError):  # out-of-range ids: vLLM would reject them; stay deterministic
            raw = array("I", (int(t) & 0xFFFFFFFF for t in prompt_token_ids)).tobytes()
        return (zlib.crc32(raw) + self.seed) % self.length

    def source(self, prompt_token_ids: Sequence[int], sample: int = 0) -> Callable[[int], int]:
        """Output token k of the request; `sample` i > 0 (the i-th of `n` sampled sequences) starts
        elsewhere in the sequence, so the n choices differ like independent samples."""
        seq, n = self.sequence, self.length
        off = (self.offset(prompt_token_ids) + sample * SAMPLE_STRIDE) % n
        return lambda k: seq[(off + k) % n]

    def text(self, token_ids: Sequence[int]) -> str:
        s = self.strings
        return "".join(s[t] for t in token_ids)
