"""Reading JSON a client sent: every way it can be bad becomes a BadRequestError (400), never a 500.

    value = load_json(raw, "request body")

    not JSON, not UTF-8         -> 400 "... is not valid JSON: ..."
    nested deeper than 64       -> 400 "... is nested too deeply" (Python's own parser gives up near
                                   1000 levels with a RecursionError; everything downstream that
                                   walks the value, json.dumps of the engine payload included, needs
                                   a bound well below that)
    a lone UTF-16 surrogate     -> 400 "... contains invalid Unicode" ("\\ud800" is valid JSON but
                                   no valid text: tokenizers, UTF-8 encoders and engines fail on it)

Used by every door that takes JSON: the OpenAI routes (orchestrator/protocol.py), the admin writes
(orchestrator/admin.py) and gRPC's sampling_parameters (orchestrator/grpc/llm.py). The checks past
the parse cost nothing on ordinary bodies: the depth walk runs only when the body holds more than
MAX_JSON_DEPTH brackets, the Unicode check only when it holds a surrogate escape.

Speed (a long chat body is ~100 KB, parsed once per request): msgspec parses first (~2.5x faster than
`json`); it is stricter than `json.loads`, never looser, so whatever it refuses (NaN and Infinity,
numbers out of float range, a UTF-8 BOM, UTF-16/32 bodies, surrogate escapes, invalid UTF-8) is parsed
again by `json.loads` and checked as before: the values accepted, and every error and its message,
are `json.loads`'s (tests/unit/orchestrator/test_json_io.py). A body msgspec accepted holds no lone
surrogate (it refuses them), so the Unicode check is skipped for it. Brackets are counted with numpy
(~6x faster than two bytes.count).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

from orchestrator.errors import BadRequestError

__all__ = ["MAX_JSON_DEPTH", "load_json", "json_depth_over", "check_text", "dump_json"]

MAX_JSON_DEPTH = 64  # OpenAI bodies nest 5-6 levels; a JSON schema for structured output rarely passes 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


_fast_encode = msgspec.json.encode


def dump_json(value: Any) -> bytes:
    """A body for an engine, as bytes: what `json.dumps(value).encode()` gives, in meaning.

    msgspec writes it several times faster than `json` (a long chat body is ~100 KB, a continuation's prompt a list
    of ~20k ids; the long multi-turn workload of benchmarks/frontend_cpu.py spent 0.93-0.98x the CPU a request with
    it, docs/benchmarks.md), compact and in UTF-8 rather than \\u-escaped, which every JSON parser reads the same.
    It writes NaN and the infinities as null, where `json` writes NaN / Infinity (a body `json.loads` accepted may
    hold them): any output with a null in it is written again by `json`, as is anything msgspec cannot encode."""
    try:
        out = _fast_encode(value)
    except (TypeError, ValueError, OverflowError):
        return json.dumps(value).encode()
    return json.dumps(value).encode() if b"null" in out else out


def json_depth_over(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when containers nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, (dict, list)):
                stack.append((c, depth + 1))
    return False


def check_text(text: str, what: str, param: str | None = None) -> None:
    """400 unless `text` is valid Unicode (no lone surrogate: it could not be sent on as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequestError(f"{what} contains invalid Unicode (a lone surrogate at position {exc.start})", param=param) from None


def _brackets(data: bytes) -> int:
    """How many `[` and `{` bytes `data` holds (0x5B | 0x20 == 0x7B, and no other byte ORs to 0x7B). numpy's one pass
    pays off past ~4 KiB: below, two `bytes.count` (~0.6 ns a byte) beat its ~2 us of call overhead."""
    return int(np.count_nonzero(np.frombuffer(data, np.uint8) | 0x20 == 0x7B)) if len(data) > 4096 else data.count(b"[") + data.count(b"{")


_fast_decode = msgspec.json.decode


def load_json(raw: bytes | str, what: str = "request body") -> Any:
    """Parse client JSON or raise BadRequestError (see the module header)."""
    try:
        value = _fast_decode(raw)
    except Exception:  # anything msgspec refuses: json.loads decides, and words any error, exactly as before
        return _load_json_slow(raw, what)
    _check_depth(value, raw.encode("utf-8") if isinstance(raw, str) else raw, what)  # msgspec took it: no lone surrogate
    return value


def _check_depth(value: Any, data: bytes, what: str) -> None:
    if isinstance(value, (dict, list)) and _brackets(data) > MAX_JSON_DEPTH and json_depth_over(value):
        raise BadRequestError(f"{what} is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)")


def _load_json_slow(raw: bytes | str, what: str) -> Any:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadRequestError(f"{what} is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequestError(f"{what} is not valid JSON: {exc}") from None
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    _check_depth(value, data, what)
    if _SURROGATE_ESCAPE.search(data) or (isinstance(raw, str) and not raw.isascii()):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequestError(f"{what} contains invalid Unicode (a lone UTF-16 surrogate escape such as \\ud800)") from None
    return value
