"""Inference API keys: format, hashing, the key file, and the store the frontend checks keys against.

Format: ``kvy_<id>_<secret>``; ``id`` is 12 hex characters (public: it names the key in the key file,
in logs, in metrics and in rate limiting), ``secret`` is 32 random bytes, base64url (256 bits).
Only ``sha256(full key)`` is stored, as ``"sha256:<hex>"``.

Why a plain SHA-256 and not scrypt/argon2: a slow KDF protects *low-entropy* secrets (passwords)
against offline guessing. A kvyard key carries 256 bits from ``secrets``; nobody can enumerate that
space, salted or not, fast hash or slow. A slow KDF would instead cost tens of milliseconds of CPU
and megabytes of memory on *every* request, which turns the auth check into a denial-of-service
lever. GitHub, Stripe and PyPI tokens are stored the same way. (A pepper adds nothing for the same
reason, and a pepper mismatch would lock every client out, so there is none.)

Key file (YAML or JSON; written 0600, atomically)::

    version: 1
    keys:
      - id: 3f9a1c2b7d4e
        name: team-a
        hash: sha256:9b1d...
        created_at: 1764680000.0
        revoked_at: null          # a time once revoked; revoked keys stay listed
        rpm: 600                  # requests per minute, null = unlimited
        tpm: 200000               # tokens per minute, null = unlimited
        priority: normal          # admission class: high | normal | low (resilience/fairshare.py)
        weight: 1.0               # share of admission slots against other keys of its class

`KeyStore` re-reads the file when it changes (checked at most once a second, so `kvyard keys revoke`
and a rotated Kubernetes Secret take effect within a second or two, without a restart). A file that
becomes unreadable or invalid is logged and the last good set stays in force.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

__all__ = ["KEY_PREFIX", "KeyFileError", "KeyRecord", "KeyFile", "KeyStore", "Principal", "generate_key", "hash_key",
           "key_id_of", "load_key_file", "save_key_file"]

log = logging.getLogger("kvyard.auth")

KEY_PREFIX = "kvy_"
_ID_HEX = 12
_HASH_PREFIX = "sha256:"
_DUMMY = _HASH_PREFIX + "0" * 64  # compared against when the id is unknown, so both paths cost the same


class KeyFileError(ValueError):
    """The key file is missing, unreadable or invalid (the message names the file and the field)."""


class KeyRecord(BaseModel):
    id: str = Field(pattern=rf"^[0-9a-f]{{{_ID_HEX}}}$")
    name: str = Field("", max_length=200)
    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    created_at: float = 0.0
    revoked_at: float | None = None
    rpm: int | None = Field(None, gt=0)  # requests per minute
    tpm: int | None = Field(None, gt=0)  # tokens per minute (prompt estimate + max_tokens, see ratelimit.py)
    priority: Literal["high", "normal", "low"] = "normal"  # admission class, served high first (resilience/fairshare.py)
    weight: float = Field(1.0, gt=0, le=1000)  # share of admission slots against the other keys of its class

    model_config = {"extra": "forbid"}


class KeyFile(BaseModel):
    version: int = 1
    keys: list[KeyRecord] = Field(default_factory=list)

    model_config = {"extra": "forbid"}

    @field_validator("keys")
    @classmethod
    def _unique_ids(cls, keys: list[KeyRecord]) -> list[KeyRecord]:
        seen: set[str] = set()
        for k in keys:
            if k.id in seen:
                raise ValueError(f"key id {k.id} appears twice")
            seen.add(k.id)
        return keys


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: a key's public id and name, and its limits."""

    key_id: str
    name: str
    rpm: int | None = None
    tpm: int | None = None
    priority: str = "normal"
    weight: float = 1.0


def hash_key(key: str) -> str:
    return _HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id_of(key: str) -> str | None:
    """The public id inside a presented key, or None if it is not in kvyard's format."""
    if not key.startswith(KEY_PREFIX):
        return None
    kid, sep, secret = key[len(KEY_PREFIX):].partition("_")
    if not sep or len(kid) != _ID_HEX or not secret or any(c not in "0123456789abcdef" for c in kid):
        return None
    return kid


def generate_key(name: str = "", rpm: int | None = None, tpm: int | None = None, existing: set[str] = frozenset(),
                 priority: str = "normal", weight: float = 1.0) -> tuple[str, KeyRecord]:
    """A new random key and its record (the key itself is returned once and stored nowhere)."""
    while True:
        kid = secrets.token_hex(_ID_HEX // 2)
        if kid not in existing:
            break
    key = f"{KEY_PREFIX}{kid}_{secrets.token_urlsafe(32)}"
    return key, KeyRecord(id=kid, name=name, hash=hash_key(key), created_at=round(time.time(), 3), rpm=rpm, tpm=tpm,
                          priority=priority, weight=weight)


def load_key_file(path: str | Path) -> KeyFile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the API key file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{path}: not valid YAML/JSON: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KeyFileError(f"{path}: the top level must be a mapping with a `keys` list")
    try:
        return KeyFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise KeyFileError(f"{path}: {where}: {err['msg']}") from exc


def save_key_file(path: str | Path, kf: KeyFile) -> None:
    """Write atomically (temp file + rename in the same folder), mode 0600 from the first byte."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = kf.model_dump(mode="json")
    text = json.dumps(doc, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(doc, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class KeyStore:
    """The accepted keys, from a key file, re-read when the file changes."""

    def __init__(self, path: str | Path, *, check_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._by_id: dict[str, KeyRecord] = {}
        self._stamp: tuple | None = None
        self._checked_at = 0.0
        self._load(self._file_stamp())  # raises KeyFileError: a frontend must not start on a bad file

    @classmethod
    def from_records(cls, records: list[KeyRecord]) -> "KeyStore":
        """An in-memory store (tests; no file behind it)."""
        self = cls.__new__(cls)
        self.path, self.check_interval_s, self._stamp, self._checked_at = None, float("inf"), None, time.monotonic()
        self._by_id = {r.id: r for r in records}
        return self

    def __len__(self) -> int:
        return sum(1 for r in self._by_id.values() if r.revoked_at is None)

    def _file_stamp(self) -> tuple | None:
        try:
            st = self.path.stat()  # follows symlinks: a Kubernetes Secret update swaps the ..data link
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self, stamp: tuple | None) -> None:
        kf = load_key_file(self.path)
        self._by_id = {r.id: r for r in kf.keys}
        self._stamp = stamp
        log.info("API keys loaded from %s: %d active, %d revoked", self.path, len(self), len(kf.keys) - len(self))

    def maybe_reload(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.path is None or now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        if stamp is None:
            log.error("API key file %s has gone; keeping the %d keys loaded before", self.path, len(self))
            self._stamp = None
            return
        try:
            self._load(stamp)
        except KeyFileError as exc:
            self._stamp = stamp  # do not retry a bad version every second; the next change is re-read
            log.error("API key file changed but cannot be used (%s); keeping the %d keys loaded before", exc, len(self))

    def verify(self, presented: str) -> tuple[Principal | None, str]:
        """(principal, "") for a valid key, else (None, reason). The hash comparison is constant-time."""
        self.maybe_reload()
        kid = key_id_of(presented)
        rec = self._by_id.get(kid) if kid else None
        ok = hmac.compare_digest(hash_key(presented), rec.hash if rec else _DUMMY)
        if not ok or rec is None:
            return None, "invalid"
        if rec.revoked_at is not None:
            return None, "revoked"
        return Principal(rec.id, rec.name, rec.rpm, rec.tpm, rec.priority, rec.weight), ""
