"""Mid-stream migration: continue a broken stream on another worker so the client sees ONE answer.

When an engine dies (SIGKILL, connection reset, a hung socket past the idle deadline, a stream that
ends without `[DONE]`) after some tokens already reached the client, the frontend sends a
*continuation* to another worker: the original prompt's token ids followed by the tokens generated
so far, with max_tokens (and min_tokens) reduced by that many. The continuation's chunks are
rewritten so the client keeps seeing the original `id`, `created`, `model` (and
`system_fingerprint`), and a single final usage chunk (if it asked for one) carries the totals:
prompt_tokens of the original prompt, completion_tokens of everything generated on all workers.

Design choices (and their trade-offs)

* Continuation = a /v1/completions request with a token-id prompt, for chat too. Chat cannot be
  continued through /v1/chat/completions without engine support for an open assistant turn
  (`continue_final_message` is vLLM-only and re-renders the text, which re-tokenizes it); a token-id
  prompt is accepted by every OpenAI-compatible engine and reproduces the exact sequence the first
  engine was decoding: the frontend already renders the chat template (the same loader as the
  engines, workers/chat_template.py) to route by prefix. The continuation's text-completion chunks
  are rewritten into chat.completion.chunk objects. Chat features that depend on the chat endpoint
  (tools, structured output, reasoning parsers) cannot be continued this way, so such requests are
  not migrated (see `migration_blocker`).
* Which tokens were generated. Best: the engine says. vLLM (>= 0.10.2, and 0.32 here) returns the
  delta token ids of every chunk with `return_token_ids: true`; the frontend asks for them on vLLM
  workers and strips them from what the client sees (unless the client asked for them itself), so
  the continuation prompt is exact even when a chunk carries several tokens (speculative decoding,
  or an engine coalescing a slow reader's tokens). The sim (vLLM flavor) answers them the same way.
  Tokens whose text the engine was still holding back when it died (half a UTF-8 character, a
  possible stop string) are left out and regenerated, so the text stays whole and a stop string is
  still seen whole by the continuing engine (a client that asked for token ids sees those ids twice;
  vLLM resumed right after half a character re-emits the whole prompt text, seen with 0.32). Fallback (engines that do not return ids: SGLang,
  TRT-LLM): re-tokenize the text relayed so far with the model's tokenizer, *chunk by chunk*.
  Engines stream one token per chunk by default, so each chunk's text encodes back to the token that
  produced it, where re-tokenizing the whole text merges across chunk boundaries (the sim's "." "."
  becomes ".."; measured: 399 ids for 400 tokens). It is still inexact when a chunk's text is not
  what its token encodes to on its own (a multi-token chunk, a partial UTF-8 character, a token the
  tokenizer would never produce alone); then the answer stays coherent and max_tokens is right to
  within those few tokens.
* No tokenizer reachable: a completions request with a string prompt is continued as prompt text +
  generated text (re-tokenized by the engine; the same caveat); chat is not migrated.
* Not migrated (a clean error event instead): n > 1 / best_of, logprobs, echo/suffix, tools,
  response_format / guided decoding, multi-modal or tool messages, reasoning or tool-call deltas seen
  in the stream, several prompts. A stop string that straddles the break is not detected (the
  continuation's engine never saw its first half).
* The sampling state is not carried: a seeded request continues with a different random stream
  (the text is a valid sample, not the one the first engine would have produced).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = [
    "StreamTracker",
    "ChunkRewriter",
    "migration_blocker",
    "continuation_body",
    "strip_token_ids",
    "usage_event",
    "CONTINUATION_PATH",
]

log = logging.getLogger("kvyard.migration")

CONTINUATION_PATH = "/v1/completions"

# Sampling fields a chat request carries over to its /v1/completions continuation (vLLM, SGLang and
# TRT-LLM share these names); everything else is chat-only (messages, tools, templates...).
_CHAT_CARRY = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
    "spaces_between_special_tokens", "user", "priority", "bad_words", "allowed_token_ids", "length_penalty",
    "min_tokens", "cache_salt", "request_id", "vllm_xargs", "return_token_ids",
})
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "structured_outputs", "regex", "json_schema", "ebnf")


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def migration_blocker(kind: str, body: dict, have_prompt_ids: bool) -> str | None:
    """Why this request cannot be migrated mid-stream, or None if it can."""
    if not body.get("stream"):
        return "not streamed"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "n > 1"
    for k in ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "tools", "functions", "continue_final_message"):
        if _truthy(body.get(k)):
            return k
    if body.get("tool_choice") not in (None, "none"):
        return "tool_choice"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return "response_format"
    for k in _GUIDED:
        if _truthy(body.get(k)):
            return k
    if kind == "chat":
        if not have_prompt_ids:
            return "no tokenizer for the chat template"
        for m in body.get("messages") or ():
            if not isinstance(m, dict) or set(m) - {"role", "content"}:
                return "tool or named messages"
            c = m.get("content")
            if isinstance(c, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in c):
                return "multi-modal content"
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) > 1:
                return "several prompts"
            if isinstance(p[0], str) and not have_prompt_ids:
                return "no tokenizer"
        if isinstance(p, str) and not p and not have_prompt_ids:
            return "empty prompt"
    return None


# ---- what reached the client -------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    id: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    choices: list[_Choice] = []
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


PENDING_BYTES = 1 << 16  # raw events a tracker holds before decoding them (~300 chat chunks of ~200 bytes)
_BIG_EVENT = 4096  # a token's chunk is a few hundred bytes; past this, an event may hold the prompt's ids
_PROMPT_IDS = b'"prompt_token_ids":['


def without_prompt_ids(ev: bytes) -> bytes:
    """`ev` with each `"prompt_token_ids":[...]` written `"prompt_token_ids":null`.

    With `return_token_ids` (which the frontend asks for, for the generated ids) vLLM puts the whole prompt's ids on
    the role chunk: ~125 KB for an 18k-token prompt, past PENDING_BYTES, so a tracker decoded it at once, for a field
    no migration reads (the frontend has the prompt's ids itself). Cut, the long multi-turn workload of
    benchmarks/frontend_cpu.py spent 0.96-0.99x the CPU a request (docs/benchmarks.md)."""
    return _null_arrays(ev, _PROMPT_IDS)


def _null_arrays(ev: bytes, opener: bytes) -> bytes:
    """Each int array that `opener` (a key, its colon and `[`) opens, written null. The key's quotes cannot occur
    inside a JSON string (they would be escaped there) and the arrays hold only ints, so the first `]` ends each."""
    i = ev.find(opener)
    if i < 0:
        return ev
    out, start, keep = [], 0, len(opener) - 1  # up to and including the key's colon
    while i >= 0:
        j = ev.find(b"]", i)
        if j < 0:
            break
        out.append(ev[start : i + keep])
        out.append(b"null")
        start = j + 1
        i = ev.find(opener, start)
    out.append(ev[start:])
    return b"".join(out)


_U32_ARRAY = re.compile(rb"[ \t\n\r]*[0-9]{1,10}[ \t\n\r]*(?:,[ \t\n\r]*[0-9]{1,10}[ \t\n\r]*)*")


def parse_u32_array(inner: bytes) -> bytes | None:
    """The bytes between an int array's brackets as native uint32s, or None when they are not exactly that:
    non-negative decimal ints under 2**32 (no sign, fraction or exponent), comma-separated, JSON whitespace around
    them. An empty array gives None too."""
    if _U32_ARRAY.fullmatch(inner) is None:
        return None
    try:
        return array("I", map(int, inner.split(b","))).tobytes()
    except OverflowError:
        return None


def _offer_prompt_ids(ev: bytes, on_prompt_ids: Callable[[bytes], None]) -> bool:
    """Hands the first parsable `"prompt_token_ids":[...]` of ev to on_prompt_ids; True if it was called."""
    i = ev.find(_PROMPT_IDS)
    while i >= 0:
        start = i + len(_PROMPT_IDS)
        j = ev.find(b"]", start)
        if j < 0:
            return False
        ids = parse_u32_array(ev[start:j])
        if ids is not None:
            try:
                on_prompt_ids(ids)
            except Exception:  # reported, never raised into the relay (the C twin: as unraisable)
                log.exception("on_prompt_ids failed")
            return True
        i = ev.find(_PROMPT_IDS, j + 1)
    return False


class _EventBuffer:
    """Raw events kept for a tracker: `feed(ev)` keeps `ev` (its prompt's ids cut when it is over `big` bytes, see
    `without_prompt_ids`) and calls `on_full()` once the bytes kept pass `limit`; `take()` hands them over, oldest
    first, and empties the buffer. With `on_prompt_ids`, the first cut array that parses (parse_u32_array) is handed
    to it, once, before its event is kept (the frontend learns a long prompt's ids from the engine that tokenized it:
    orchestrator/token_cache.py, `ChunkedTokenizer.learn`). The C twin (orchestrator._relaycore.EventBuffer, used
    when built) does the same with no Python frame per event (tests/unit/orchestrator/test_migration.py runs both)."""

    __slots__ = ("_events", "nbytes", "_limit", "_on_full", "_big", "_on_prompt_ids")

    def __init__(self, limit: int, on_full: Callable[[], None], big: int = _BIG_EVENT,
                 on_prompt_ids: Callable[[bytes], None] | None = None) -> None:
        self._events: list[bytes] = []
        self.nbytes = 0
        self._limit, self._on_full, self._big = limit, on_full, big
        self._on_prompt_ids = on_prompt_ids

    def feed(self, ev: bytes) -> None:
        if len(ev) > self._big:
            if self._on_prompt_ids is not None and _PROMPT_IDS in ev and _offer_prompt_ids(ev, self._on_prompt_ids):
                self._on_prompt_ids = None
            ev = without_prompt_ids(ev)
        self._events.append(ev)
        self.nbytes += len(ev)
        if self.nbytes > self._limit:
            self._on_full()

    def take(self) -> list[bytes]:
        events, self._events, self.nbytes = self._events, [], 0
        return events

    def __len__(self) -> int:
        return len(self._events)


try:  # the same buffer in C (setup.py builds it; without a compiler the twin above serves)
    from orchestrator._relaycore import EventBuffer
except ImportError:  # pragma: no cover - depends on the build
    EventBuffer = _EventBuffer  # type: ignore[misc,assignment]


class StreamTracker:
    """Follows the content events the client received: identity, text, token ids, finish.

    Only a migration reads it, so `feed` just keeps the event as the engine wrote it (in an EventBuffer: the relay
    calls it for every token), and the events are decoded (msgspec, into these few typed fields) when a field is read,
    or in batches of PENDING_BYTES of raw events to bound what a long stream holds. A stream that ends before
    PENDING_BYTES is never decoded; the relayed bytes themselves are never re-encoded. Reading a field gives what an
    eager decode of every event fed so far would have given.
    """

    def __init__(self, buffer: Callable[..., EventBuffer] = EventBuffer,
                 on_prompt_ids: Callable[[bytes], None] | None = None) -> None:
        # on_prompt_ids: handed the prompt's ids (native uint32s) the engine put on its first chunk, once (_EventBuffer)
        self._pending = buffer(PENDING_BYTES, self._absorb, _BIG_EVENT, on_prompt_ids)
        # "one SSE event (b"data: {...}") that was relayed to the client": the buffer's own feed, no frame of ours
        self.feed: Callable[[bytes], None] = self._pending.feed
        self._id: str | None = None
        self._created: int | None = None
        self._model: str | None = None
        self._system_fingerprint: str | None = None
        self._parts: list[str] = []
        self._token_ids: list[int] | None = []  # None once a chunk came without ids
        self._held = 0  # ids at the end whose text the engine held back (partial character, possible stop string)
        self._finish_reason: str | None = None
        self._events = 0
        self._blocked: str | None = None  # set when something seen makes the stream unmigratable

    def _absorb(self) -> None:
        if not self._pending:
            return
        for ev in self._pending.take():  # each on its own: a malformed event must not run into its neighbours
            try:
                c = _decode_chunk(memoryview(ev)[6:])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("unreadable engine chunk, the stream can no longer be migrated: %s", exc)
                self._blocked = "unreadable chunk"
                continue
            self._take(c)

    def _take(self, c: _Chunk) -> None:
        if c.error is not None:
            self._blocked = "engine error event"
            return
        if self._id is None and c.id is not None:
            self._id, self._created, self._model, self._system_fingerprint = c.id, c.created, c.model, c.system_fingerprint
        for ch in c.choices:
            if ch.index != 0:
                self._blocked = "n > 1"
                continue
            text = ch.text
            if ch.delta is not None:
                d = ch.delta
                if d.reasoning_content or d.reasoning or d.tool_calls:
                    self._blocked = "reasoning or tool-call output"
                text = d.content
            if text:
                self._parts.append(text)
            if self._token_ids is not None:
                if ch.token_ids is None:
                    if text:  # output without ids (the role chunk and a bare finish chunk carry none)
                        self._token_ids = None
                else:
                    self._token_ids.extend(ch.token_ids)
                    self._held = 0 if text else self._held + len(ch.token_ids)
            if ch.finish_reason is not None:
                self._finish_reason = ch.finish_reason
        self._events += 1

    def _field(name: str):  # noqa: N805 - a property factory, used in the class body only
        attr = "_" + name

        def get(self):
            if self._pending:
                self._absorb()
            return getattr(self, attr)

        return property(get)

    id = _field("id")
    created = _field("created")
    model = _field("model")
    system_fingerprint = _field("system_fingerprint")
    parts = _field("parts")
    token_ids = _field("token_ids")
    held = _field("held")
    finish_reason = _field("finish_reason")
    events = _field("events")
    blocked = _field("blocked")
    del _field

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def generated_ids(self, encode) -> tuple[list[int] | None, bool]:
        """(token ids generated so far, exact?); ids re-tokenized from the text when the engine gave none.
        `encode(text) -> ids` (no special tokens) or None when no tokenizer is available."""
        if self.token_ids is not None and (self.token_ids or not self.parts):
            # without the held-back tail: the continuation regenerates it, so the text stays whole (an engine
            # resumed after half a UTF-8 character re-emits its whole prefix, seen with vLLM 0.32)
            return self.token_ids[: len(self.token_ids) - self.held], True
        if encode is None:
            return None, False
        # chunk by chunk: engines stream one token per chunk (vLLM's default stream interval, the sim), so
        # encoding each chunk's text on its own gives back the generated ids where re-tokenizing the whole
        # text would merge across chunk boundaries (". ." -> "..")
        return [i for part in self.parts for i in encode(part)], False


def continuation_body(kind: str, body: dict, prompt_ids: list[int], gen_ids: list[int] | None, gen_text: str,
                      n_generated: int, requested_max_tokens: int | None, return_token_ids: bool) -> dict:
    """The /v1/completions body that continues `body` after `n_generated` tokens.

    With `prompt_ids`, the prompt is `prompt_ids + gen_ids` (exact); without (no tokenizer, completions
    with a text prompt only), it is the prompt text + the generated text.
    """
    if kind == "chat":
        out = {k: v for k, v in body.items() if k in _CHAT_CARRY}
    else:
        out = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens", "stream", "stream_options", "echo")}
    if prompt_ids and gen_ids is not None:
        out["prompt"] = list(prompt_ids) + list(gen_ids)
    else:
        p = body["prompt"]
        out["prompt"] = (p if isinstance(p, str) else p[0]) + gen_text
    if requested_max_tokens is not None:
        out["max_tokens"] = max(1, requested_max_tokens - n_generated)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        out["min_tokens"] = max(0, body["min_tokens"] - n_generated)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    if return_token_ids:
        out["return_token_ids"] = True
    return out


# ---- what the client sees after a migration ----------------------------------------------------

_IDS_OPEN = b'token_ids":['


def strip_token_ids(ev: bytes) -> bytes:
    """Hide the token ids the frontend asked the engine for (vLLM's default output shows null):
    every `..token_ids":[1,2]` (token_ids, prompt_token_ids) becomes `..token_ids":null`."""
    return _null_arrays(ev, _IDS_OPEN)


def _dumps(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def usage_event(kind: str, tracker: StreamTracker, prompt_tokens: int, completion_tokens: int) -> bytes:
    obj = {"id": tracker.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": tracker.created, "model": tracker.model, "choices": [],
           "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                     "completion_tokens": completion_tokens}}
    if tracker.system_fingerprint is not None:
        obj["system_fingerprint"] = tracker.system_fingerprint
    return _dumps(obj)


class ChunkRewriter:
    """Turns a continuation's text-completion chunks into the client's stream (its id, created, model;
    chat chunks for a chat request; usage totals offset by what earlier workers generated)."""

    def __init__(self, kind: str, tracker: StreamTracker, prompt_tokens: int, generated_before: int, keep_token_ids: bool) -> None:
        self.kind = kind
        self.t = tracker
        self.prompt_tokens = prompt_tokens
        self.before = generated_before
        self.keep_token_ids = keep_token_ids

    def _usage(self, u: dict) -> dict:
        done = int(u.get("completion_tokens") or 0) + self.before
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + done, "completion_tokens": done}

    def __call__(self, ev: bytes) -> bytes | None:
        try:
            obj = json.loads(ev[6:])
        except ValueError:
            log.warning("unreadable continuation chunk skipped: %r", ev[:200])
            return None
        if not isinstance(obj, dict) or "error" in obj:
            return ev  # the engine's own error event, as it wrote it
        t = self.t
        out: dict[str, Any] = {"id": t.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                               "created": t.created, "model": t.model}
        choices = []
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            if self.kind == "chat":
                text = ch.get("text") or ""
                c = {"index": ch.get("index", 0), "delta": {"content": text} if text else {}, "logprobs": None,
                     "finish_reason": ch.get("finish_reason")}
                if "stop_reason" in ch:
                    c["stop_reason"] = ch["stop_reason"]
                if self.keep_token_ids:
                    c["token_ids"] = ch.get("token_ids")
            else:
                c = dict(ch)
                if not self.keep_token_ids:
                    if c.get("token_ids") is not None:
                        c["token_ids"] = None
                    if c.get("prompt_token_ids") is not None:
                        c["prompt_token_ids"] = None
            choices.append(c)
        out["choices"] = choices
        if t.system_fingerprint is not None:
            out["system_fingerprint"] = t.system_fingerprint
        if isinstance(obj.get("usage"), dict):  # continuous_usage_stats
            out["usage"] = self._usage(obj["usage"])
        return _dumps(out)
