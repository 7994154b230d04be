"""Client JSON (orchestrator/json_input.py) is parsed by msgspec first, with exactly `json`'s results: the same
values, and where msgspec refuses, json.loads's own values and errors."""

from __future__ import annotations

import json
import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import BadRequestError
from orchestrator.json_input import MAX_JSON_DEPTH, _brackets, _load_json_slow, load_json


def outcome(fn, raw):
    """(value, its repr) or the error's type and message: repr tells 1 from 1.0 and -0.0 from 0.0, and NaN equals itself."""
    try:
        value = fn(raw)
    except BadRequestError as exc:
        return "error", exc.message
    return "ok", repr(value)


def same_as_json(raw) -> None:
    assert outcome(load_json, raw) == outcome(lambda r: _load_json_slow(r, "request body"), raw)


TRICKY = [
    b'{"a": 123456789012345678901234567890}', b'{"a": -123456789012345678901234567890}', b'{"a": 18446744073709551616}',
    b'{"a": 1e400}', b'{"a": -1e400}', b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": 1.7976931348623157e309}',
    b'{"a": "\\ud800"}', b'{"a": "\\udc00\\ud800"}', b'{"a": "\\ud83d\\ude00"}', b'{"a": "\xed\xa0\x80"}', b'{"a": "\xff"}',
    b'{"a":1,"b":2,"a":3}', b'{"a": "x\x01y"}', b'{"a": "x\ty"}', b'{} x', b'{"a":1}\x00', b'\xef\xbb\xbf{}',
    '{"a":"é"}'.encode("utf-16"), '{"a":"é"}'.encode("utf-32"), b'{"a": -0}', b'{"a": -0.0}', b'{"a": 0.1}', b'{"a": 5e-324}',
    b'{"a": 2.4703282292062328e-324}', b'{"a": 2.2250738585072011e-308}', b'{"a": 1.0e-400}', b'{"a": 9007199254740993}',
    b'{"a": 1E5}', b'{"a": 00}', b'{"a": .5}', b'{"a": tru}', b'{"a": 1' + b'0' * 4299 + b'}', b'{"a": 1' + b'0' * 4300 + b'}',
    b'{"a": 0.' + b'1' * 5000 + b'}', b'{"a": 1' + b'0' * 400 + b'.5}', b' {"a":1}\n ', b'', b'   ', b'"x"', b'5', b'null',
    b'{"\\u00e9": "\\/\\b\\f\\n\\r\\t\\"\\\\"}', b'[' * 64 + b']' * 64, b'[' * 65 + b']' * 65, b'[' * 2000 + b']' * 2000,
    b'{"a": ' * 70 + b'1' + b'}' * 70, b'{"m": [' + b'[1],' * 100 + b'2]}', b'{"p": "' + b'[' * 100 + b'"}',
    '{"a": "\ud800"}', '{"a": "é"}', '{"a": 1}', "[" * 65 + "]" * 65,
]


@pytest.mark.parametrize("raw", TRICKY)
def test_load_json_is_json_loads(raw):
    same_as_json(raw)


def json_values():
    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(alphabet=st.characters(exclude_categories=()), max_size=20))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                        max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(json_values(), st.booleans(), st.booleans(), st.booleans())
def test_load_json_is_json_loads_generated(value, ensure_ascii, compact, as_text):
    raw = json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":") if compact else None)
    same_as_json(raw if as_text else raw.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_brackets_counts_both(data):
    assert _brackets(data) == data.count(b"[") + data.count(b"{")
    padded = data * (MAX_JSON_DEPTH // max(1, len(data)) + 2)
    assert _brackets(padded) == padded.count(b"[") + padded.count(b"{")


# ---- dump_json: engine bodies written by msgspec, meaning what json.dumps wrote ----------------------------------------

def _random_value(rng, depth=0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-2**70, 2**70)
    if kind == 2:
        return rng.choice([0.1, -1e-300, 1e300, 3.0, rng.random() * 10 ** rng.randint(-20, 20)])
    if kind in (3, 4):
        return "".join(rng.choice(['a', 'é', '"', '\\', '\n', '\x00', '€', '😀', ' ', 'null']) for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{i}{rng.choice(['', 'é', ' '])}": _random_value(rng, depth + 1) for i in range(rng.randrange(5))}


def test_dump_json_means_what_json_dumps_wrote():
    from orchestrator.json_input import dump_json

    rng = random.Random(7)
    for _ in range(2000):
        v = {"model": "m", "x": _random_value(rng)}
        assert json.loads(dump_json(v)) == json.loads(json.dumps(v))
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo " * 1000}], "prompt": list(range(20000))}
    out = dump_json(body)
    assert json.loads(out) == body and b"\\u00e9" not in out  # msgspec wrote it (json.dumps escapes non-ASCII)


def test_dump_json_keeps_what_only_json_writes():
    from orchestrator.json_input import dump_json

    # NaN and the infinities (json.loads accepts them in a client's body): json's words, not msgspec's null
    for v in ({"temperature": float("nan")}, {"a": [float("inf"), -float("inf")]}):
        assert dump_json(v) == json.dumps(v).encode()
    assert json.loads(dump_json({1: "a", "b": (1, 2)})) == {"1": "a", "b": [1, 2]}  # as json.dumps writes them
    lone = {"text": "a\ud800b"}  # msgspec refuses to write a lone surrogate; json escapes it
    assert dump_json(lone) == json.dumps(lone).encode()
    with pytest.raises(TypeError):  # what json.dumps cannot write either still fails as before
        dump_json({"x": object()})
