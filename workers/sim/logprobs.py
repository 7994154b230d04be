"""Sampled-token log probabilities in vLLM 0.32's shapes, for the sim (which samples no distribution).

The values are made up but stable: the same token gets the same logprob, the sampled token ranks first and its
`k - 1` alternatives (the next ids in the vocabulary) follow with lower ones. What a client can rely on is the
shape, which is vLLM's:
    completions  {"text_offset": [...], "token_logprobs": [...], "tokens": [...], "top_logprobs": [{token: lp}, ...]}
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
(streamed: the same per chunk, over the chunk's tokens; completions' text_offset runs on across chunks).
vLLM's default `max_logprobs` (20) bounds `logprobs` / `top_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_LOGPROBS", "Logprobs"]

MAX_LOGPROBS = 20


def _lp(token_id: int, rank: int) -> float:
    return -(1.0 + (token_id * 2654435761 % 1000) / 1000.0) - 0.05 * rank


class Logprobs:
    """Builds one choice's logprobs; `k`: alternatives per position (completions' `logprobs`, chat's `top_logprobs`)."""

    def __init__(self, decode, vocab_size: int, k: int, chat: bool) -> None:
        self.decode, self.vocab, self.k, self.chat = decode, vocab_size, k, chat
        self.offset = 0  # completions: where the next token's text starts

    def _tops(self, tid: int) -> list[tuple[int, float]]:
        alts = [(tid + r) % self.vocab for r in range(1, self.k)] if self.k > 1 else []
        return [(tid, _lp(tid, 0))] + [(a, _lp(tid, r + 1)) for r, a in enumerate(alts)]

    def of(self, ids: Sequence[int]) -> dict[str, Any]:
        if self.chat:
            content = []
            for tid in ids:
                tok = self.decode(tid)
                content.append({"token": tok, "logprob": _lp(tid, 0), "bytes": list(tok.encode()),
                                "top_logprobs": [{"token": (t := self.decode(a)), "logprob": lp, "bytes": list(t.encode())}
                                                 for a, lp in self._tops(tid)[:max(self.k, 0)]]})
            return {"content": content}
        offsets, lps, toks, tops = [], [], [], []
        for tid in ids:
            tok = self.decode(tid)
            offsets.append(self.offset)
            self.offset += len(tok)
            lps.append(_lp(tid, 0))
            toks.append(tok)
            tops.append({self.decode(a): lp for a, lp in self._tops(tid)})
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}
