"""Idle and slow connections: read deadlines and a bound on open connections, in the HTTP protocol itself.

uvicorn bounds only the idle time *between* requests (timeout_keep_alive). A client that opens a connection
and sends nothing, or sends its headers (or body) a byte at a time, holds a socket and a file descriptor
forever, and enough of them exhaust the process (slowloris). The ASGI app cannot see this: it is called only
once the headers are complete. So the frontend serves HTTP with `guarded_protocol(...)`, a subclass of
uvicorn's httptools protocol that adds:

    header_timeout_s   from the connection's start, or a request's first byte, to its last header line
    body_timeout_s     the longest silence between two pieces of a request body (not counted while the
                       frontend itself has paused reading: that is back-pressure, not a slow client)
    max_connections    open connections beyond this are closed as they are accepted

A request past a deadline gets `408 Request Timeout` (if nothing was answered yet) and its connection is
closed; the app sees the client as disconnected. Connections refused or timed out are counted
(`kvyard_connections_closed_total{reason}`). Measured with tests/integration/test_hostile.py (a slowloris
client is cut at the deadline; connections past the bound are closed at once). gRPC keeps its own limits
(grpc.max_connection_idle_ms, set in orchestrator/grpc/server.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.direct_body import EXTENSION, DirectBody

__all__ = ["guarded_protocol"]

log = logging.getLogger("kvyard.frontend")

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_BODY_408 = (b'{"error": {"message": "the request was not received in time", "type": "invalid_request_error", '
             b'"param": null, "code": "request_timeout"}}')


def guarded_protocol(header_timeout_s: float, body_timeout_s: float, max_connections: int,
                     on_closed: Callable[[str], None] | None = None) -> type[HttpToolsProtocol]:
    """The protocol class to hand uvicorn (`uvicorn.Config(http=...)`) with these limits."""
    warned = [0.0]

    def closed(reason: str) -> None:
        if on_closed is not None:
            on_closed(reason)
        now = time.monotonic()
        if now - warned[0] > 30:  # at most one line per 30 s, whatever a flood does
            warned[0] = now
            log.warning("closed a client connection: %s (logged at most every 30 s; counted in kvyard_connections_closed_total)",
                        reason.replace("_", " "))

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _read_timer = None
        _bodies: list[DirectBody] | None = None  # this connection's direct bodies (orchestrator/direct_body.py)

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _expired(self, what: str) -> None:
            self._read_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            if what == "body" and self.flow is not None and self.flow.read_paused:
                self._arm(body_timeout_s, what)  # the app has not read what it has: not the client's fault
                return
            cycle = self.cycle if what == "body" else None
            if cycle is None or not cycle.response_started:
                self.transport.write(_TIMEOUT_408 % (len(_BODY_408), _BODY_408))
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()
            closed(f"{what}_timeout")

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.connections.discard(self)
                transport.abort()
                closed("too_many_connections")
                return
            self._arm(header_timeout_s, "headers")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)
            for body in self._bodies or ():  # requests still at work on this connection: their clients left
                body.gone()
            self._bodies = None

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(header_timeout_s, "headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # a request cycle was made (not an upgrade)
                body = DirectBody(cycle, self.transport)
                self.scope["extensions"] = {**self.scope.get("extensions", {}), EXTENSION: body}
                self._bodies = [b for b in self._bodies or () if not b.done] + [body]
            self._arm(body_timeout_s, "body")

        def pause_writing(self) -> None:
            super().pause_writing()
            for body in self._bodies or ():
                body.paused()

        def resume_writing(self) -> None:
            super().resume_writing()
            for body in self._bodies or ():
                body.resumed()

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._arm(body_timeout_s, "body")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

    return GuardedHttpToolsProtocol
