"""Session affinity: a conversation goes back to the worker that served its previous turn. A router stage.

    pin(session)      = (worker, expires_at), set each time a request of the session is booked on a worker
                        (the first-ranked one, or a failover target); the TTL slides with every turn
    rerank(request)   = the policy's ranking, with the pinned worker moved to the front when
                          - the session has a live pin (now < expires_at), and
                          - its worker is among the candidates (ready, circuit breaker closed), and
                          - it is not overloaded:   load(pinned) - min over candidates of load(w) <= max_load_gap
                            and not (engine KV usage >= saturation_kv_usage with requests waiting)
                        else the ranking unchanged (the policy's cost decides, and the session is re-pinned to
                        wherever it lands)
    load(w)           = requests in flight on w (the router's own count) + requests waiting in w's engine

Defaults: ttl_s 600, max_load_gap 4 requests, saturation_kv_usage 0.95, max_sessions 100,000 (least recently
used pins dropped first). The policy's order is kept for everything but the pinned worker, so the KV cost is
still the tie-break behind it and the failover order after it. Pins live in this process: several frontends
each keep their own (a client that sticks to one frontend, e.g. by the same header at the load balancer, keeps
its session's affinity). Pure and synchronous; the clock is injected.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from router.types import Endpoint, RouteRequest

__all__ = ["SessionAffinity", "request_load"]


def request_load(ep: Endpoint) -> float:
    """Requests in flight on the endpoint (router bookkeeping) plus those waiting in its engine (last scrape)."""
    return ep.load.inflight_requests + ep.load.engine_waiting


class SessionAffinity:
    name = "session-affinity"

    def __init__(self, ttl_s: float = 600.0, max_load_gap: float = 4.0, saturation_kv_usage: float = 0.95,
                 max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_sessions < 1 or max_load_gap < 0:
            raise ValueError("ttl_s must be > 0, max_sessions >= 1 and max_load_gap >= 0")
        self.ttl_s = ttl_s
        self.max_load_gap = max_load_gap
        self.saturation_kv_usage = saturation_kv_usage
        self.max_sessions = max_sessions
        self.clock = clock
        self._pins: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (worker, expires_at), LRU first
        # outcomes of requests that carried a session id: hit (sent to its worker), new (no live pin), gone (the
        # worker is not a candidate), overloaded (load won), kept (the policy ranked it first anyway)
        self.outcomes: Counter[str] = Counter()

    def pinned_worker(self, session_id: str) -> str | None:
        """The session's worker while its pin is live, else None."""
        pin = self._pins.get(session_id)
        if pin is None or pin[1] <= self.clock():
            return None
        return pin[0]

    def overloaded(self, ep: Endpoint, ranked: list[Endpoint]) -> bool:
        ld = ep.load
        if ld.engine_kv_usage >= self.saturation_kv_usage and ld.engine_waiting > 0:
            return True
        return request_load(ep) - min(request_load(e) for e in ranked) > self.max_load_gap

    def rerank(self, request: RouteRequest, ranked: list[Endpoint]) -> list[Endpoint]:
        sid = request.session_id
        if not sid:
            return ranked
        wid = self.pinned_worker(sid)
        if wid is None:
            self.outcomes["new"] += 1
            return ranked
        for i, ep in enumerate(ranked):
            if ep.worker_id == wid:
                break
        else:
            self.outcomes["gone"] += 1
            return ranked
        if self.overloaded(ep, ranked):
            self.outcomes["overloaded"] += 1
            return ranked
        if i == 0:
            self.outcomes["kept"] += 1
            return ranked
        self.outcomes["hit"] += 1
        return [ep, *ranked[:i], *ranked[i + 1:]]

    def on_booked(self, request: RouteRequest, endpoint: Endpoint) -> None:
        sid = request.session_id
        if not sid:
            return
        pins = self._pins
        pins[sid] = (endpoint.worker_id, self.clock() + self.ttl_s)
        pins.move_to_end(sid)
        while len(pins) > self.max_sessions:
            pins.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        for sid in [s for s, (w, _) in self._pins.items() if w == worker_id]:
            del self._pins[sid]

    def expire(self) -> int:
        """Drop pins past their TTL; returns how many went. Cheap to call every few seconds."""
        now = self.clock()
        gone = [s for s, (_, exp) in self._pins.items() if exp <= now]
        for s in gone:
            del self._pins[s]
        return len(gone)

    def pinned_per_worker(self) -> dict[str, int]:
        """Live pins by worker (what the dashboard shows)."""
        now = self.clock()
        return dict(Counter(w for w, exp in self._pins.values() if exp > now))

    def __len__(self) -> int:
        return len(self._pins)
