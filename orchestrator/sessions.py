"""Session affinity in the frontend: the session id of a request, and the router stage that acts on it.

A client marks the turns of one conversation with a header (`x-session-id` by default): the router's
session-affinity stage (router/plugins/affinity.py) then sends each turn to the worker that served the previous
one while that worker is ready and not overloaded, for `ttl_s` after the last turn; past `max_load_gap` requests
above the least loaded worker, load wins, and the KV cost ranks everything behind the pinned worker. An id is
1 to 256 printable ASCII characters; anything else is a 400 naming the header. Requests without the header are
routed as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.errors import BadRequestError
from router.plugins.affinity import SessionAffinity

__all__ = ["AffinityConfig", "build_affinity", "session_id_of"]

MAX_SESSION_ID = 256


class AffinityConfig(BaseModel):
    """Session affinity (YAML `frontend.affinity`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="route requests carrying a session id back to the session's worker")
    header: str = Field("x-session-id", min_length=1, description="request header that carries the session id")
    ttl_s: float = Field(600.0, gt=0, description="a session forgets its worker this long after its last request")
    max_load_gap: float = Field(4.0, ge=0, description="requests in flight above the least loaded worker past which load wins")
    saturation_kv_usage: float = Field(0.95, gt=0, le=1, description="a worker at this KV usage with requests waiting is overloaded")
    max_sessions: int = Field(100_000, ge=1, description="sessions remembered; the least recently used are dropped first")


def build_affinity(cfg: AffinityConfig) -> SessionAffinity | None:
    if not cfg.enabled:
        return None
    return SessionAffinity(cfg.ttl_s, cfg.max_load_gap, cfg.saturation_kv_usage, cfg.max_sessions)


def session_id_of(value: str | None, header: str) -> str | None:
    """The request's session id (None without one); BadRequestError for an id that is not 1-256 printable ASCII."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_SESSION_ID or not all(" " < c <= "~" for c in value):
        raise BadRequestError(f"the {header} header must be 1 to {MAX_SESSION_ID} printable ASCII characters without spaces",
                              param=header)
    return value
