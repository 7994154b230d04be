"""The one way kvyard opens a Redis connection (discovery, telemetry, planner targets, rate limits).

    client = redis_client(url, timeout_s)

The URL carries everything redis-py understands (redis.asyncio.from_url):
    redis://[[user]:password@]host:port/db           an ACL user (Redis 6+) or the default user's password
    rediss://...?ssl_ca_certs=/etc/kvyard/redis-ca.pem&ssl_certfile=...&ssl_keyfile=...
                                                     TLS, verified against that CA (client certificate optional)
    unix:///run/redis.sock?db=0
A password in the URL is registered for log redaction (orchestrator/security/redact.py) by the entry points;
commands kvyard issues, per component, are listed in docs/security.md (the ACL to grant).
"""

from __future__ import annotations

__all__ = ["redis_client"]


def redis_client(url: str, timeout_s: float):
    """A redis.asyncio client for `url` with kvyard's socket timeouts (connections open lazily)."""
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
