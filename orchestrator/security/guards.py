"""The checks at the frontend's doors: API keys (+ rate limits) for inference, the admin token for
the operator surfaces. Transport-neutral: HTTP passes request headers, gRPC its invocation metadata.

Inference (`InferenceGuard`), when a key file is configured:
    Authorization: Bearer kvy_...   or   x-api-key: kvy_...
    none -> 401 invalid_api_key "You didn't provide an API key..."; wrong or revoked -> 401
    invalid_api_key; over a limit -> 429 rate_limit_exceeded + Retry-After + x-ratelimit-* headers.
    Without a key file every request is admitted (the embedded default; the app logs a warning).

Admin (`AdminGuard`): /admin/*, /dashboard, /api/pools, /api/cluster.
    admin token configured  -> every admin call, from anywhere (loopback included), needs
                               `Authorization: Bearer <token>` (401 otherwise)
    no admin token          -> reads allowed when `loopback_reads` is on and the client is on this
                               machine (127/8, ::1); everything else 403 admin_disabled
`loopback_reads` is meant for a frontend bound to loopback only (`kvyard frontend` on 127.0.0.1
without a token). Keep it off behind a reverse proxy on the same host: the proxy's connections come
from 127.0.0.1. A web page cannot use it through DNS rebinding: the Host check of
orchestrator/security/origin.py refuses a request that names another host.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Mapping

from orchestrator.errors import AuthenticationError, PermissionDeniedError, RateLimitError
from orchestrator.security.keys import KeyStore, Principal, key_id_of
from orchestrator.security.ratelimit import Grant, RateLimiter
from orchestrator.security.ratelimit_redis import RedisRateLimiter

__all__ = ["InferenceGuard", "AdminGuard", "presented_key", "bearer_token", "is_loopback"]

log = logging.getLogger("kvyard.auth")

NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
          "auth (i.e. Authorization: Bearer YOUR_KEY), or as the x-api-key header.")
BAD_KEY = "Incorrect API key provided. You can create a new key with `kvyard keys create`."
REVOKED_KEY = "This API key has been revoked."


def bearer_token(value: str | None) -> str | None:
    scheme, _, token = (value or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client presented: `authorization: Bearer ...`, else `x-api-key` (header names lower-case)."""
    return bearer_token(headers.get("authorization")) or (headers.get("x-api-key") or "").strip() or None


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class InferenceGuard:
    def __init__(self, keys: KeyStore | None, limiter: RateLimiter | RedisRateLimiter | None = None, metrics=None) -> None:
        self.keys = keys
        self.limiter = limiter or RateLimiter()
        self.metrics = metrics  # FrontendMetrics (auth_failures, rate_limited) or None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, headers: Mapping[str, str], surface: str = "http") -> Principal | None:
        """The caller's Principal; None when keys are off. Raises AuthenticationError (401)."""
        if self.keys is None:
            return None
        key = presented_key(headers)
        if key is None:
            self._failed(surface, "missing")
            raise AuthenticationError(NO_KEY)
        principal, why = self.keys.verify(key)
        if principal is None:
            self._failed(surface, why)
            log.warning("%s: refused an API key (%s; key id %s)", surface, why, key_id_of(key) or "not a kvyard key")
            raise AuthenticationError(REVOKED_KEY if why == "revoked" else BAD_KEY)
        return principal

    def needs_token_estimate(self, principal: Principal | None) -> bool:
        return principal is not None and principal.tpm is not None

    async def admit(self, principal: Principal | None, tokens: int = 0) -> Grant | None:
        """Charge the key's rate limits; raises RateLimitError (429). None when nothing is limited."""
        if principal is None or (principal.rpm is None and principal.tpm is None):
            return None
        try:
            grant = self.limiter.admit(principal, tokens)
            return await grant if not isinstance(grant, Grant) else grant
        except RateLimitError as exc:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(principal.key_id, getattr(exc, "limit", "requests")).inc()
            raise

    async def close(self) -> None:
        await self.limiter.close()

    def _failed(self, surface: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(surface, reason).inc()


class AdminGuard:
    def __init__(self, token: str | None, loopback_reads: bool = False, metrics=None) -> None:
        self.token = token or None
        self.loopback_reads = loopback_reads
        self.metrics = metrics

    def describe(self) -> str:
        if self.token:
            return "admin surfaces (/admin, /dashboard, /api/*) need the admin bearer token, from every client"
        if self.loopback_reads:
            return ("no admin token: /dashboard and /api/* are readable from this machine only (loopback clients); "
                    "/admin writes are disabled (set KVYARD_ADMIN_TOKEN to enable them)")
        return "no admin token: the admin surfaces (/admin, /dashboard, /api/*) are disabled (set KVYARD_ADMIN_TOKEN)"

    def check(self, headers: Mapping[str, str], client_host: str | None, *, write: bool) -> str:
        """The actor ("admin" or "loopback") or raise 401/403."""
        if not write and self.loopback_reads and self.token is None and is_loopback(client_host):
            return "loopback"
        if self.token is None:
            self._failed("disabled")
            raise PermissionDeniedError(
                "the admin API is disabled: no admin token is configured (set KVYARD_ADMIN_TOKEN)"
                + ("; without one, reads are allowed from this machine only" if self.loopback_reads and not write else ""),
                code="admin_disabled")
        token = bearer_token(headers.get("authorization"))
        if token is None or not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.token.encode()):
            self._failed("missing" if token is None else "invalid")
            raise AuthenticationError("missing or invalid admin bearer token", code="invalid_admin_token")
        return "admin"

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels("admin", reason).inc()
