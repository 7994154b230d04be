"""The admin token the integration tests give `kvyard up` (KVYARD_ADMIN_TOKEN): with a token set, /api/* needs it from
every client, this machine's included (docs/security.md), so the tests that poll /api/cluster send it."""

from __future__ import annotations

import os

__all__ = ["ADMIN_TOKEN", "ADMIN_HEADERS", "admin_env"]

ADMIN_TOKEN = "integration-admin-token-0123456789"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def admin_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**(os.environ if env is None else env), "KVYARD_ADMIN_TOKEN": ADMIN_TOKEN}
