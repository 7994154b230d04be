"""API keys, key file, rate limiter and token estimate (orchestrator/security), without a server."""

from __future__ import annotations

import os
import stat

import pytest

from orchestrator.cli import main as cli_main
from orchestrator.errors import RateLimitError
from orchestrator.security import (
    KeyFile,
    KeyFileError,
    KeyStore,
    Principal,
    RateLimiter,
    estimate_tokens,
    generate_key,
    hash_key,
    key_id_of,
    load_key_file,
    save_key_file,
)


def test_generated_key_shape_and_hash():
    key, rec = generate_key("team-a", rpm=10)
    assert key.startswith("kvy_") and key_id_of(key) == rec.id and len(rec.id) == 12
    assert len(key.split("_", 2)[2]) >= 43  # 32 random bytes, base64url
    assert rec.hash == hash_key(key) and key not in rec.model_dump_json()
    other, _ = generate_key()
    assert other != key


@pytest.mark.parametrize("presented", ["", "sk-abc", "kvy_", "kvy_nothex12345_x", "kvy_0123456789ab", "kvy_0123456789ab_"])
def test_key_id_of_rejects_malformed(presented):
    assert key_id_of(presented) is None


def test_store_verifies_and_refuses():
    good, rec = generate_key("a", rpm=5, tpm=100)
    revoked_key, revoked = generate_key("b")
    revoked.revoked_at = 1.0
    store = KeyStore.from_records([rec, revoked])
    assert store.verify(good) == (Principal(rec.id, "a", 5, 100), "")
    kid = rec.id
    wrong_secret = f"kvy_{kid}_" + "A" * 43  # right id, wrong secret
    for bad in (wrong_secret, good + "x", good[:-1], "kvy_ffffffffffff_" + "A" * 43, "Bearer " + good, "garbage"):
        assert store.verify(bad) == (None, "invalid"), bad
    assert store.verify(revoked_key) == (None, "revoked")
    assert len(store) == 1


def test_key_file_roundtrip_is_private_and_atomic(tmp_path):
    path = tmp_path / "sub" / "keys.yaml"
    _, rec = generate_key("x", tpm=1000)
    save_key_file(path, KeyFile(keys=[rec]))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key_file(path).keys == [rec]
    assert [p.name for p in path.parent.iterdir()] == ["keys.yaml"]  # no temp file left behind
    jpath = tmp_path / "keys.json"
    save_key_file(jpath, KeyFile(keys=[rec]))
    assert jpath.read_text().lstrip().startswith("{") and load_key_file(jpath).keys == [rec]


@pytest.mark.parametrize("text,fragment", [
    ("keys: [1, 2", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("keys:\n  - {id: 0123456789ab, hash: 'sha256:" + "0" * 64 + "', rpm: -1}\n", "keys.0.rpm"),
    ("keys:\n  - {id: XYZ, hash: 'sha256:" + "0" * 64 + "'}\n", "keys.0.id"),
    ("keys:\n  - {id: 0123456789ab, hash: 'md5:00'}\n", "keys.0.hash"),
    ("keys:\n  - {id: 0123456789ab, hash: 'sha256:" + "0" * 64 + "', secret: x}\n", "keys.0.secret"),
    ("keys:\n  - {id: 0123456789ab, hash: 'sha256:" + "0" * 64 + "'}\n  - {id: 0123456789ab, hash: 'sha256:" + "1" * 64 + "'}\n", "appears twice"),
])
def test_bad_key_files_name_the_problem(tmp_path, text, fragment):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeyFileError) as info:
        load_key_file(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_store_follows_the_file_and_keeps_the_last_good_set(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    key, rec = generate_key("a")
    save_key_file(path, KeyFile(keys=[rec]))
    store = KeyStore(path, check_interval_s=0)
    assert store.verify(key)[0] is not None
    rec.revoked_at = 5.0
    save_key_file(path, KeyFile(keys=[rec]))
    assert store.verify(key) == (None, "revoked")
    key2, rec2 = generate_key("b")
    save_key_file(path, KeyFile(keys=[rec, rec2]))
    assert store.verify(key2)[0].name == "b"
    path.write_text("keys: [broken")  # a bad edit: logged, the last good set stays
    assert store.verify(key2)[0].name == "b"
    assert "cannot be used" in caplog.text
    path.unlink()
    assert store.verify(key2)[0].name == "b" and "has gone" in caplog.text
    with pytest.raises(KeyFileError):
        KeyStore(tmp_path / "missing.yaml")


def test_cli_create_list_revoke(tmp_path, capsys):
    path = tmp_path / "k.yaml"
    assert cli_main(["keys", "create", "--file", str(path), "--name", "team-a", "--rpm", "60", "--tpm", "5000"]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert key.startswith("kvy_") and "not shown again" in out.err and key not in path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert cli_main(["keys", "list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    kid = key_id_of(key)
    assert kid in listing and "team-a" in listing and "active" in listing and key not in listing and "5000" in listing
    assert cli_main(["keys", "set-limits", kid, "--file", str(path), "--rpm", "none"]) == 0
    capsys.readouterr()
    rec = load_key_file(path).keys[0]
    assert (rec.rpm, rec.tpm) == (None, 5000)
    assert cli_main(["keys", "revoke", kid, "--file", str(path)]) == 0
    assert KeyStore(path).verify(key) == (None, "revoked")
    assert cli_main(["keys", "revoke", "ffffffffffff", "--file", str(path)]) == 1
    assert cli_main(["keys", "list", "--file", str(tmp_path / "none.yaml")]) == 2


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_request_bucket_refills_and_says_when():
    clock = Clock()
    lim = RateLimiter(clock)
    p = Principal("k1", "", rpm=60)  # one per second
    grants = [lim.admit(p) for _ in range(60)]
    assert grants[0].remaining_requests == 59 and grants[-1].remaining_requests == 0
    assert grants[0].headers()["x-ratelimit-limit-requests"] == "60"
    with pytest.raises(RateLimitError) as info:
        lim.admit(p)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded" and info.value.retry_after == 1
    assert info.value.headers["x-ratelimit-remaining-requests"] == "0" and "requests per minute" in info.value.message
    clock.t += 1.0
    lim.admit(p)  # one refilled
    with pytest.raises(RateLimitError):
        lim.admit(p)


def test_token_bucket_lends_then_waits_for_the_debt():
    clock = Clock()
    lim = RateLimiter(clock)
    p = Principal("k2", "", tpm=600)  # 10 tokens per second
    lim.admit(p, 500)
    g = lim.admit(p, 400)  # admitted while above 0, goes 300 into debt
    assert g.remaining_tokens == 0
    with pytest.raises(RateLimitError) as info:
        lim.admit(p, 1)
    assert info.value.retry_after == 31 and "tokens per minute" in info.value.message  # (300 + 1) / 10 per s
    clock.t += 31
    lim.admit(p, 1)
    assert lim.admit(Principal("other", "", tpm=600), 1).remaining_tokens == 599  # keys do not share buckets


def test_a_changed_limit_does_not_refill():
    clock = Clock()
    lim = RateLimiter(clock)
    for _ in range(3):
        lim.admit(Principal("k", "", rpm=3))
    with pytest.raises(RateLimitError):
        lim.admit(Principal("k", "", rpm=100))  # raised limit: refill rate grows, the empty bucket stays empty
    assert lim.admit(Principal("k", "", rpm=None)) is not None  # unlimited now


@pytest.mark.parametrize("body,kind,ctx,expected", [
    ({"model": "m", "prompt": "abcdefgh", "max_tokens": 10}, "completions", None, 2 + 10),
    ({"model": "m", "prompt": "abcdefgh"}, "completions", None, 2 + 16),  # OpenAI's default max_tokens
    ({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "n": 2}, "completions", None, 3 + 2),
    ({"model": "m", "prompt": ["abcd", "abcdefgh"], "max_tokens": 0}, "completions", None, 3),
    ({"model": "m", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 5}, "chat", None, 1 + 4 + 5),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcdabcd"}]}],
      "max_completion_tokens": 7}, "chat", None, 2 + 4 + 7),
    ({"model": "m", "messages": [{"role": "user", "content": "abcd"}]}, "chat", 100, 5 + 95),  # the rest of the context
    (b"not json", "completions", None, 0),
    ([1, 2], "completions", None, 0),
])
def test_token_estimate(body, kind, ctx, expected):
    import json

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert estimate_tokens(raw, kind, lambda m: ctx) == expected
