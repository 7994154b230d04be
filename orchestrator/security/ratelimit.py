"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

Each limited key has up to two buckets, each holding at most one minute's allowance and refilled
continuously at ``limit / 60`` per second:

    requests  a request takes 1; refused (429) while fewer than 1 is left;
              Retry-After = (1 - level) / rate
    tokens    a request is admitted while the level is above 0, then takes its *estimated* tokens
              (the level may go negative: a large request borrows from the next minute, and the
              key waits until the debt is repaid); Retry-After = -level / rate

The token estimate is OpenAI's own admission rule: the prompt's estimated tokens (UTF-8 bytes / 4,
or the count of a token-id prompt) plus what the request may generate (``max_tokens`` or
``max_completion_tokens``, times ``n``; unset: the rest of the model's context for chat, OpenAI's
default of 16 for completions). Counting at admission bounds what a key can put on the GPUs before
the work is done, which is what a limit is for.

Where the buckets live:
    RateLimiter        in this process (no Redis): with N frontends a key can get up to N times its limit
    RedisRateLimiter   in Redis (ratelimit_redis.py), shared by every frontend of the cluster, one atomic
                       script per request; if Redis cannot be reached it falls back to an in-process
                       RateLimiter (logged), so an outage never stops serving
Both checks happen before either bucket is charged (all or nothing).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.errors import RateLimitError
from orchestrator.security.keys import Principal

__all__ = ["TokenBucket", "RateLimiter", "Grant", "estimate_tokens", "refusal", "COMPLETIONS_DEFAULT_MAX_TOKENS"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class TokenBucket:
    __slots__ = ("limit", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.limit = per_minute
        self.rate = per_minute / 60.0
        self.level = float(per_minute)
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(float(self.limit), self.level + (now - self.stamp) * self.rate)
            self.stamp = now


@dataclass(frozen=True, slots=True)
class Grant:
    """An admitted request's view of its key's limits (for the x-ratelimit-* response headers)."""

    rpm: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    tpm: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    @classmethod
    def of(cls, rpm: int | None, r_level: float | None, tpm: int | None, t_level: float | None) -> "Grant":
        """From the buckets' limits and levels after the request was charged (or refused)."""
        def reset(limit, level):
            return max(0.0, (limit - level) / (limit / 60.0))
        return cls(rpm=rpm, remaining_requests=max(0, math.floor(r_level)) if rpm else None,
                   reset_requests_s=reset(rpm, r_level) if rpm else None,
                   tpm=tpm, remaining_tokens=max(0, math.floor(t_level)) if tpm else None,
                   reset_tokens_s=reset(tpm, t_level) if tpm else None)

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.rpm is not None:
            h.update({"x-ratelimit-limit-requests": str(self.rpm), "x-ratelimit-remaining-requests": str(self.remaining_requests),
                      "x-ratelimit-reset-requests": f"{self.reset_requests_s:.3f}s"})
        if self.tpm is not None:
            h.update({"x-ratelimit-limit-tokens": str(self.tpm), "x-ratelimit-remaining-tokens": str(self.remaining_tokens),
                      "x-ratelimit-reset-tokens": f"{self.reset_tokens_s:.3f}s"})
        return h


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    @staticmethod
    def _bucket(table: dict[str, TokenBucket], key_id: str, limit: int | None, now: float) -> TokenBucket | None:
        if limit is None:
            table.pop(key_id, None)
            return None
        b = table.get(key_id)
        if b is None or b.limit != limit:  # new key, or its limit changed in the key file
            fresh = TokenBucket(limit, now)
            if b is not None:
                b.refill(now)
                fresh.level = min(fresh.level, b.level)  # a changed limit does not refill the bucket
            table[key_id] = b = fresh
        b.refill(now)
        return b

    def admit(self, p: Principal, tokens: int = 0) -> Grant:
        """Charge one request and `tokens` to the key, or raise RateLimitError (429 + Retry-After)."""
        now = self._clock()
        req = self._bucket(self._requests, p.key_id, p.rpm, now)
        tok = self._bucket(self._tokens, p.key_id, p.tpm, now)
        levels = (p.rpm, req.level if req else None, p.tpm, tok.level if tok else None)
        if req is not None and req.level < 1.0:
            raise refusal(p, "requests", (1.0 - req.level) / req.rate, Grant.of(*levels))
        if tok is not None and tok.level <= 0.0:
            raise refusal(p, "tokens", (-tok.level + 1.0) / tok.rate, Grant.of(*levels))
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= max(0, tokens)
        return Grant.of(p.rpm, req.level if req else None, p.tpm, tok.level if tok else None)

    async def close(self) -> None:
        pass


def refusal(p: Principal, which: str, wait_s: float, grant: Grant) -> RateLimitError:
    """The 429 for key `p` over its `which` ("requests" or "tokens") per minute limit."""
    limit = p.rpm if which == "requests" else p.tpm
    exc = RateLimitError(f"Rate limit reached for {which} per minute (limit {limit}) on API key {p.key_id}. "
                         f"Please try again in {wait_s:.1f}s.", retry_after=max(1.0, math.ceil(wait_s)))
    exc.headers = grant.headers()
    exc.limit = which
    return exc


def _text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4)


def _prompt_tokens(prompt) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return sum(_prompt_tokens(p) for p in prompt)
    return 0


def _message_tokens(messages) -> int:
    total = 0
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            total += sum(_text_tokens(part.get("text", "")) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
        total += 4  # role and separators, as OpenAI's own counting adds per message
    return total


def estimate_tokens(raw: bytes | dict, kind: str, context_len: Callable[[str], int | None] = lambda m: None) -> int:
    """Tokens a request may use (prompt estimate + max generation); 0 when the body is unreadable
    (the request is then refused by validation, which is where the 400 belongs)."""
    try:
        body = json.loads(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    except (ValueError, UnicodeDecodeError):
        return 0
    if not isinstance(body, dict):
        return 0
    if kind in ("embeddings", "tokenize", "detokenize"):  # no generation: the input is the whole cost
        return _prompt_tokens(body.get("input", body.get("prompt"))) + _message_tokens(body.get("messages")) + _prompt_tokens(body.get("tokens"))
    if kind == "responses":  # input: a string or a list of message items; max_output_tokens bounds the generation
        inp = body.get("input")
        prompt = _prompt_tokens(inp) if isinstance(inp, str) else _message_tokens(inp)
        gen = body.get("max_output_tokens")
        return prompt + (gen if isinstance(gen, int) and gen >= 0 else COMPLETIONS_DEFAULT_MAX_TOKENS)
    prompt = _message_tokens(body.get("messages")) if kind == "chat" else _prompt_tokens(body.get("prompt"))
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n") > 0 else 1
    gen = body.get("max_completion_tokens") if kind == "chat" else None
    gen = gen if isinstance(gen, int) else body.get("max_tokens")
    if not isinstance(gen, int) or gen < 0:
        if kind == "chat":
            ctx = context_len(str(body.get("model", "")))
            gen = max(0, ctx - prompt) if ctx else COMPLETIONS_DEFAULT_MAX_TOKENS
        else:
            gen = COMPLETIONS_DEFAULT_MAX_TOKENS
    return prompt + n * gen
