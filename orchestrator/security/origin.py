"""Host and Origin checks against DNS rebinding and cross-site requests (an ASGI middleware).

    app = HostOriginGuard(app, allowed_hosts, allowed_origins, on_refused)

Guarded: every request that changes state (any method but GET, HEAD, OPTIONS: inference included) and
every admin surface (/admin, /api, /dashboard), whatever the method. Probes and scrapes (/live,
/health, /metrics, GET /v1/models) are not: kubelets and Prometheus address pods by IP.

    Host    must name one of `allowed_hosts` (any port). A DNS-rebinding page reaches a frontend on
            127.0.0.1 under the attacker's host name, so this is what stops it reading /api/cluster or
            running inference through a browser. Default (FrontendConfig.allowed_hosts unset): for a
            frontend bound to loopback, localhost / 127.0.0.1 / ::1 and its own host; for one bound to
            a routable address, any host (set the names clients use, e.g. the ingress host).
    Origin  when a browser sends one, it must be the request's own origin (same scheme-less host and
            port as Host) or one of `allowed_origins`; "null" (sandboxed frames, file:) is refused.
            Clients other than browsers send none and are not affected.
Refusals are 403 permission_error (`host_not_allowed`, `origin_not_allowed`) in the OpenAI shape.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from orchestrator.errors import PermissionDeniedError, error_response

__all__ = ["HostOriginGuard", "default_allowed_hosts", "split_host"]

_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_ADMIN_PREFIXES = ("/admin", "/api/", "/dashboard")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def split_host(value: str) -> tuple[str, str]:
    """A Host header (or origin netloc) -> (host lower-cased without brackets, port or "")."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if value.count(":") == 1:
        host, _, port = value.partition(":")
        return host, port
    return value, ""


def default_allowed_hosts(bind_host: str) -> frozenset[str] | None:
    """The hosts a frontend bound to `bind_host` accepts by default; None: any."""
    from orchestrator.security.guards import is_loopback

    if bind_host == "localhost" or is_loopback(bind_host):
        return frozenset({*LOOPBACK_NAMES, split_host(bind_host)[0]})
    return None


class HostOriginGuard:
    def __init__(self, app, allowed_hosts: frozenset[str] | None, allowed_origins: frozenset[str] = frozenset(),
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None or "*" in allowed_hosts else frozenset(h.lower() for h in allowed_hosts)
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.on_refused = on_refused  # (reason) -> None: metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["method"] not in _SAFE or scope["path"].startswith(_ADMIN_PREFIXES)):
            refusal = self.check(scope)
            if refusal is not None:
                if self.on_refused is not None:
                    self.on_refused(refusal.code)
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> PermissionDeniedError | None:
        host_hdr = origin = None
        for k, v in scope["headers"]:
            if k == b"host":
                host_hdr = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
        host, port = split_host(host_hdr or "")
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return PermissionDeniedError(f"the Host header {host_hdr!r} is not one this server answers to for this route "
                                         "(frontend.security.allowed_hosts)", code="host_not_allowed")
        if origin is None:
            return None
        o = origin.strip().rstrip("/").lower()
        if o in self.allowed_origins:
            return None
        u = urlsplit(o)
        if o != "null" and u.scheme in ("http", "https") and u.hostname:
            default = "443" if u.scheme == "https" else "80"
            o_host, o_port = split_host(u.netloc)
            if o_host == host and (o_port or default) == (port or default):
                return None  # same origin (e.g. the dashboard's own scripts)
        return PermissionDeniedError(f"requests from the web origin {origin[:200]!r} are not allowed (frontend.security.allowed_origins)",
                                     code="origin_not_allowed")
