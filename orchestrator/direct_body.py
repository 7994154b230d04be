"""Streamed response bodies written straight to the client's connection, past the ASGI send chain.

Through ASGI each piece of a body is an `await send(...)`: every middleware's wrapper, Starlette's response, then
uvicorn's protocol; for a token stream that is a coroutine chain per token. The frontend's HTTP protocol
(orchestrator/security/connections.py) offers each request a `DirectBody` in `scope["extensions"]` under
EXTENSION. A response starts through ASGI as usual (status and headers pass every middleware), may then hand body
pieces to `write()`, and ends through ASGI (`more_body: False`: uvicorn writes the last chunk and keeps the
connection's books). The SSE relay writes each engine chunk from the engine socket's read callback this way
(orchestrator/service.py); with any other server, or over gRPC, it sends through ASGI as before.

`write()` frames an HTTP/1.1 chunk exactly as uvicorn would for the same piece, and only while `usable()`: the
response started, chunked, not complete, the client connected. Back-pressure: `on_pause()` / `on_resume()` are
called when the client's socket buffer passes the transport's high / low water marks (uvicorn's own flow control
sees the same calls), so a slow client slows the engine read instead of growing a buffer. The client leaving:
`on_gone()` is called when the connection is lost (orchestrator/client_gone.py cancels the request's work with it,
without a task of its own waiting on ASGI's receive).
"""

from __future__ import annotations

from collections.abc import Callable

try:  # the same write in C (setup.py builds it)
    from orchestrator._relaycore import ChunkWriter
except ImportError:  # pragma: no cover - depends on the build
    ChunkWriter = None

__all__ = ["EXTENSION", "DirectBody"]

EXTENSION = "kvyard.direct_body"


class DirectBody:
    __slots__ = ("_cycle", "_transport", "on_pause", "on_resume", "on_gone")

    def __init__(self, cycle, transport) -> None:
        self._cycle = cycle  # uvicorn's RequestResponseCycle of this request
        self._transport = transport
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        self.on_gone: Callable[[], None] | None = None

    def usable(self) -> bool:
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete and not c.disconnected
                    and c.scope.get("method") != "HEAD")

    @property
    def client_gone(self) -> bool:
        return bool(self._cycle.disconnected)

    @property
    def done(self) -> bool:
        return self._cycle.response_complete or self._cycle.disconnected

    @property
    def write_paused(self) -> bool:
        return self._cycle.flow.write_paused

    def write(self, data: bytes) -> None:
        # not after the client left: uvicorn marks that in connection_lost, but the transport is closing (and uvloop's
        # write raises) from the client's EOF on
        if data and not self._cycle.disconnected and not self._transport.is_closing():
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def writer(self) -> Callable[[bytes], None]:
        """`write` as a callable for the token path: the C ChunkWriter (orchestrator/_relaycore.c: the same checks and
        bytes, no Python frame) when it is built, else `write` itself."""
        return ChunkWriter(self._transport, self._cycle) if ChunkWriter is not None else self.write

    def paused(self) -> None:
        if self.on_pause is not None:
            self.on_pause()

    def resumed(self) -> None:
        if self.on_resume is not None:
            self.on_resume()

    def gone(self) -> None:
        """The client's connection was lost (the protocol's connection_lost)."""
        if self.on_gone is not None:
            self.on_gone()
