"""Registry entries signed with a shared secret, so that write access to Redis is not enough to register a worker.

Anyone who can write the registry could otherwise point a model at their own server and read every prompt
sent to it. With `registry_secret` set (`KVYARD_REGISTRY_SECRET`, the same value on every frontend, worker
and planner of a cluster), each entry carries

    "_exp": <unix time>   the entry is worthless after this (the worker rewrites it on every renewal, each
                          lease_ttl/3 s), so an entry copied from the registry cannot be replayed later
    "_sig": <hex>         HMAC-SHA256(secret, the entry's canonical JSON without `_sig`)

and a reader with the secret skips (logging once) an entry that is unsigned, badly signed, expired (beyond
`CLOCK_SKEW_S`), or stored under another worker's key. Tokenizer files published by workers carry a
`__sig` over their digest, checked the same way. A reader without a secret ignores the two fields, so
signing can be turned on writers first, then readers.

What signing does not cover (Redis access control does: a password or ACL user, TLS, a NetworkPolicy; see
docs/security.md): planner targets, telemetry, rate-limit buckets, and denial of service (deleting keys).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

__all__ = ["CLOCK_SKEW_S", "sign_entry", "verify_entry", "sign_digest", "digest_signed", "EntryRejected"]

CLOCK_SKEW_S = 30.0  # how far apart the clocks of a worker and a frontend may be


class EntryRejected(ValueError):
    """A registry entry that must not be used; the message says why (for the one log line)."""


def _mac(secret: bytes, data: bytes) -> str:
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_entry(doc: dict[str, Any], secret: bytes | None, valid_s: float, now: float | None = None) -> str:
    """The JSON to store: `doc` as is without a secret, else with `_exp` and `_sig`."""
    if not secret:
        return json.dumps(doc, separators=(",", ":"))
    doc = {**doc, "_exp": round((time.time() if now is None else now) + valid_s, 3)}
    return json.dumps({**doc, "_sig": _mac(secret, _canonical(doc))}, separators=(",", ":"))


def verify_entry(raw: bytes | str, secret: bytes | None, now: float | None = None) -> dict[str, Any]:
    """The entry's fields (without `_sig`/`_exp`); EntryRejected when it must be skipped."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise EntryRejected(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise EntryRejected("not a JSON object")
    sig = doc.pop("_sig", None)
    if secret:
        if not isinstance(sig, str):
            raise EntryRejected("unsigned (this cluster requires signed registry entries: is the worker's registry secret set?)")
        if not hmac.compare_digest(sig, _mac(secret, _canonical(doc))):
            raise EntryRejected("bad signature (signed with another secret, or altered)")
        exp = doc.get("_exp")
        if not isinstance(exp, (int, float)) or exp < (time.time() if now is None else now) - CLOCK_SKEW_S:
            raise EntryRejected("signature expired (a stale or replayed entry)")
    doc.pop("_exp", None)
    return doc


def sign_digest(digest: str, secret: bytes | None) -> str | None:
    return _mac(secret, b"files:" + digest.encode()) if secret else None


def digest_signed(digest: str, sig: bytes | str | None, secret: bytes | None) -> bool:
    if not secret:
        return True
    if isinstance(sig, bytes):
        sig = sig.decode("ascii", "replace")
    return isinstance(sig, str) and hmac.compare_digest(sig, sign_digest(digest, secret) or "")
