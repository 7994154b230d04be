"""Secrets never reach a log: every log record is redacted as it is created.

`install_redaction()` wraps the process's LogRecord factory (so it applies to every logger and every
handler, uvicorn's, httpx's and pytest's included): the message is formatted once, then

    kvy_<id>_<secret>                      -> kvy_<id>_***      (the public id stays, for debugging)
    Bearer <anything>                      -> Bearer ***
    authorization / x-api-key / api_key / admin_token / password = or : <value>   -> <name>: ***
    scheme://user:<password>@host (e.g. a Redis URL)                               -> scheme://user:***@host
    any literal registered with `register_secret` (the admin token)                -> ***

Only records a logger actually emits are touched (levels are checked before the factory runs).
Tracebacks are not rewritten; kvyard never puts a credential in an exception message.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = ["install_redaction", "register_secret", "redact"]

_KEY = re.compile(r"\b(kvy_[0-9a-f]{12}_)[A-Za-z0-9_\-]+")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+")
_FIELD = re.compile(r"(?i)\b(authorization|x-api-key|api[-_]key|admin[-_]token|password|passwd)(\"?'?\s*[:=]\s*\"?'?)(?!\*\*\*|(?i:bearer)\s)([^\s\"',;}]+)")
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@]*:)([^\s@/]+)(@)")
_MASK = "***"

_secrets: set[str] = set()
_lock = threading.Lock()
_installed = False


def register_secret(value: str | None) -> None:
    """Redact this exact string wherever it appears (for secrets without a recognisable shape)."""
    if value and len(value) >= 6:
        with _lock:
            _secrets.add(value)


def redact(text: str) -> str:
    text = _KEY.sub(r"\1" + _MASK, text)
    text = _BEARER.sub(r"\1 " + _MASK, text)
    text = _FIELD.sub(r"\1\2" + _MASK, text)
    text = _URL_PASSWORD.sub(r"\1" + _MASK + r"\3", text)
    for s in tuple(_secrets):
        if s in text:
            text = text.replace(s, _MASK)
    return text


def install_redaction() -> None:
    """Idempotent: wrap the current LogRecord factory once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        base = logging.getLogRecordFactory()

        def factory(*args, **kwargs) -> logging.LogRecord:
            record = base(*args, **kwargs)
            try:
                message = record.getMessage()
            except Exception:  # a bad format string: leave it to the handler to report, as logging does
                return record
            cleaned = redact(message)
            if cleaned != message or record.args:
                record.msg, record.args = cleaned, None
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
