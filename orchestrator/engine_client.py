"""HTTP/1.1 client for the token path: frontend -> engine, on asyncio protocols and httptools' C parser.

Every streamed token crosses this hop, so it is built for that: the engine's socket feeds httptools (the parser
uvicorn uses) from the event loop's read callback, and a body is read one of two ways:

    pull   `aiter_raw()` / `aread()`: the chunks as they arrive, awaited (buffered; reading pauses past 1 MiB)
    push   `stream_into(on_data)`: the parser hands each chunk to `on_data` inside the read callback itself, so no
           task wakes up per token. The SSE relay uses it (orchestrator/service.py, with the direct write to the
           client: orchestrator/direct_body.py): CPU per relayed event 57.6 -> 33.8 µs at concurrency 64 against
           aiohttp reads and an ASGI send per token (benchmarks/frontend_cpu.py; docs/benchmarks.md).

Why not aiohttp or httpx: neither has a push interface; a general client's features (redirects, cookies,
proxies, decompression) are not wanted on this hop. What is kept of theirs: keep-alive connections reused per
engine, every wait bounded, errors translated into two of ours:

    EngineUnreachableError  no response arrived (connect refused/timed out, the connection closed or a deadline
                            passed before the status line): safe to send elsewhere
    EngineStreamError       the engine failed after answering (its connection dropped, a deadline passed, a
                            malformed response): the response is partial

Deadlines (`post`): connect (`connect_timeout_s`), the response headers (`headers_timeout_s`), each read
(`read_timeout_s`: the longest silence; time the reader itself paused reading does not count), and the whole
exchange (`total_s`). Idle connections are reused for KEEPALIVE_S (below uvicorn's default 5 s keep-alive, which
vLLM, SGLang and the sim serve with); a request on a reused connection that the engine closes before answering
anything is sent again, once, on a new connection (the engine closed it idle: the request was never read).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

__all__ = ["EngineClient", "EngineResponse", "EngineUnreachableError", "EngineStreamError", "KEEPALIVE_S"]

KEEPALIVE_S = 4.0
_PAUSE_AT = 1 << 20  # pull mode: stop reading the socket with this much buffered unread
_RESUME_AT = 1 << 18


class EngineUnreachableError(ConnectionError):
    pass


class EngineStreamError(ConnectionError):
    pass


class _Conn(asyncio.Protocol):
    """One connection to an engine; one exchange at a time (a request, then its response)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._new_exchange()

    def usable(self) -> bool:
        """Open, and not closing (the engine's EOF closes the transport before connection_lost is called)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def _new_exchange(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.received = False  # a byte of this exchange's response arrived
        self.headers_done: asyncio.Future | None = None
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self._framed = False  # content-length or chunked: the body ends by itself, not by the connection closing
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._end: Callable[[BaseException | None], None] | None = None
        self._paused_for_buffer = False
        self._paused_by_reader = False
        self._read_timeout = 0.0
        self._last_read = 0.0
        self._timers: list[asyncio.TimerHandle] = []

    # ---- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.error is None:  # not a failure of the reader's own callback (that one is kept as it is)
                self._fail("BadResponse", f"the engine's response is not valid HTTP: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete or self.error is not None or self.headers_done is None:
            return
        if self.headers_done.done() and not self._framed:  # a body delimited by the connection's end
            self.on_message_complete()
            return
        why = f": {exc}" if exc else ""
        self._fail("ServerDisconnected", f"the engine closed the connection{why}")

    # ---- httptools callbacks ------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._framed:
            lname = name.lower()
            self._framed = lname == b"content-length" or lname == b"transfer-encoding"

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is not None:
            try:
                sink(body)
            except BaseException as exc:  # the reader's own bug: end its read with it, drop the exchange
                self._fail_with(exc)
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and not self._paused_for_buffer:
            self._paused_for_buffer = True
            self._set_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.complete or self.error is not None:
            return
        self.complete = True
        self.keep_alive = not self.closed and self.parser.should_keep_alive()
        self._cancel_timers()
        end, self._sink, self._end = self._end, None, None
        if end is not None:
            end(None)
        self._wake()

    # ---- one exchange -------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, read_timeout_s: float, headers_timeout_s: float | None,
             total_s: float | None) -> asyncio.Future:
        """Write the request; returns the future of its response headers."""
        self._new_exchange()
        self.headers_done = self.loop.create_future()
        now = self._last_read = self.loop.time()
        if read_timeout_s:
            self._read_timeout = read_timeout_s
            self._timers.append(self.loop.call_at(now + read_timeout_s, self._check_read))
        if headers_timeout_s:
            self._timers.append(self.loop.call_at(now + headers_timeout_s, self._headers_late, headers_timeout_s))
        if total_s:
            self._timers.append(self.loop.call_at(now + total_s, self._fail, "TotalTimeout",
                                                  f"the request's deadline ({total_s:.3g}s) passed"))
        if len(body) < 65536:
            self.transport.write(head + body)
        else:  # no copy of a large prompt
            self.transport.writelines((head, body))
        return self.headers_done

    def _check_read(self) -> None:
        if self.complete or self.error is not None:
            return
        if self._paused_by_reader or self._paused_for_buffer:  # silence we caused is not the engine's
            due = self.loop.time() + self._read_timeout
        else:
            due = self._last_read + self._read_timeout
            if self.loop.time() >= due:
                self._fail("ReadTimeout", f"Timeout on reading data from the engine (silent for {self._read_timeout:g}s)")
                return
        self._timers.append(self.loop.call_at(due, self._check_read))

    def _headers_late(self, seconds: float) -> None:
        if self.headers_done is not None and not self.headers_done.done():
            self._fail("HeadersTimeout", f"Timeout: no response headers within {seconds:g}s")

    def _fail(self, kind: str, message: str) -> None:
        before_headers = self.headers_done is not None and not self.headers_done.done()
        cls = EngineUnreachableError if before_headers else EngineStreamError
        self._fail_with(cls(f"{kind}: {message}"))

    def _fail_with(self, exc: BaseException) -> None:
        """End this exchange with `exc` (once) and drop the connection: it is never reused after a failure."""
        if self.complete or self.error is not None:
            return
        self.error = exc
        self._cancel_timers()
        hd = self.headers_done
        if hd is not None and not hd.done():
            hd.set_exception(exc)
            hd.exception()  # retrieved: nobody may be awaiting it any more
        end, self._sink, self._end = self._end, None, None
        if end is not None:
            end(exc)
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _cancel_timers(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers.clear()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _set_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        if self._paused_by_reader or self._paused_for_buffer:
            self.transport.pause_reading()
        else:
            self._last_read = self.loop.time()
            self.transport.resume_reading()

    # pull
    async def read(self) -> bytes:
        """The next chunk of the body; b"" at its end."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused_for_buffer and self._buffered < _RESUME_AT:
            self._paused_for_buffer = False
            self._set_reading()
        return chunk

    # push
    def set_sink(self, on_data: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]) -> None:
        """From now on each chunk goes to on_data as it arrives; on_end(None | the error) once, at the end."""
        while self._chunks:  # what arrived before
            on_data(self._chunks.popleft())
        self._buffered = 0
        if self._paused_for_buffer:
            self._paused_for_buffer = False
            self._set_reading()
        if self.error is not None:
            on_end(self.error)
        elif self.complete:
            on_end(None)
        else:
            self._sink, self._end = on_data, on_end

    def pause_by_reader(self, paused: bool) -> None:
        if self._paused_by_reader != paused:
            self._paused_by_reader = paused
            self._set_reading()


class EngineResponse:
    """One engine response whose headers have arrived; read it once, then close it."""

    def __init__(self, client: "EngineClient", conn: _Conn) -> None:
        self._client = client
        self._conn = conn
        self._closed = False
        self.status_code = conn.status

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (what is buffered, per read)."""
        return _RawChunks(self._conn)

    async def aread(self) -> bytes:
        parts = []
        while chunk := await self._conn.read():
            parts.append(chunk)
        return b"".join(parts)

    async def stream_into(self, on_data: Callable[[bytes], None]) -> None:
        """Hand each chunk of the body to `on_data` as it arrives (inside the socket's read callback: it must not
        block); returns at the body's end, raises EngineStreamError if it broke (or on_data's own exception)."""
        done = self._conn.loop.create_future()

        def end(exc: BaseException | None) -> None:
            if not done.done():
                done.set_exception(exc) if exc is not None else done.set_result(None)

        self._conn.set_sink(on_data, end)
        try:
            await done
        except BaseException:
            self._conn._sink = self._conn._end = None  # cancelled: nothing more goes to on_data
            raise

    def pause_reading(self) -> None:
        """Stop reading the engine's socket (the client is slow): TCP pushes back on the engine."""
        self._conn.pause_by_reader(True)

    def resume_reading(self) -> None:
        self._conn.pause_by_reader(False)

    def abort(self) -> None:
        """Drop the connection now (the engine stopped answering): a pending read raises EngineStreamError."""
        self._conn._fail("Aborted", "the engine was found unresponsive")

    async def aclose(self) -> None:
        """Close (again: no-op); if the body was not fully read the connection is dropped, which aborts the engine
        request."""
        if not self._closed:
            self._closed = True
            self._client._release(self._conn)


class _RawChunks:
    __slots__ = ("_conn",)

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn

    def __aiter__(self) -> "_RawChunks":
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._conn.read()
        if not chunk:
            raise StopAsyncIteration
        return chunk


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[tuple, str, str]:
    """(connection key (scheme, host, port), request target, Host header) of an http(s) URL."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise EngineUnreachableError(f"InvalidURL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return (u.scheme, u.hostname, port), target, u.netloc.rsplit("@", 1)[-1]


def _head(method: str, target: str, host: str, headers: dict[str, str], length: int) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    for name, value in headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
            raise ValueError(f"bad header for the engine: {name!r}")
        lines.append(f"{name}: {value}\r\n")
    if length or method not in ("GET", "HEAD"):
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class EngineClient:
    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple, deque[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, payload: bytes, headers: dict[str, str], read_timeout_s: float,
                   headers_timeout_s: float | None = None, total_s: float | None = None) -> EngineResponse:
        """POST and wait for the response headers (at most `headers_timeout_s`); the body is read later."""
        return await self._exchange("POST", url, payload, headers, read_timeout_s, headers_timeout_s, total_s)

    def start_post(self, url: str, payload: bytes, headers: dict[str, str], read_timeout_s: float,
                   headers_timeout_s: float | None = None, total_s: float | None = None) -> asyncio.Task:
        """`post` as a task, with the request already written when a kept-alive connection is at hand.

        A task's coroutine starts on the loop's next turn, after whatever else is ready; here the engine has the
        request before this returns (without an idle connection the task connects first). The task is what
        `post` is: its result is the response at its headers, and cancelling it drops the connection."""
        key, target, host = _target(url)
        head = _head("POST", target, host, headers, len(payload))
        loop = asyncio.get_running_loop()
        sent = None
        conn = self._take(key, loop.time())
        if conn is not None:
            try:
                sent = conn, conn.send(head, payload, read_timeout_s, headers_timeout_s, total_s)
            except (RuntimeError, OSError) as exc:  # closed under us: the task starts on a fresh connection
                conn._fail_with(EngineUnreachableError(f"ServerDisconnected: {exc}"))
        task = loop.create_task(self._exchange("POST", url, payload, headers, read_timeout_s, headers_timeout_s,
                                               total_s, sent=sent, head=head))
        if sent is not None:  # cancelled before its first step, the task never reaches its own clean-up
            task.add_done_callback(lambda t, conn=sent[0]: t.cancelled() and conn._fail_with(
                EngineStreamError("Cancelled: the request was cancelled")))
        return task

    async def fetch(self, method: str, url: str, timeout_s: float) -> tuple[int, bytes]:
        """A small bodiless call (GET / POST) read whole within timeout_s: (status, body); raises our two errors."""
        resp = await self._exchange(method, url, b"", {}, timeout_s, None, timeout_s)
        try:
            return resp.status_code, await resp.aread()
        finally:
            await resp.aclose()

    async def request(self, method: str, url: str, timeout_s: float) -> tuple[int | None, bytes]:
        """`fetch`, or (None, b"") if the engine did not answer."""
        try:
            return await self.fetch(method, url, timeout_s)
        except (EngineUnreachableError, EngineStreamError):
            return None, b""

    async def healthy(self, url: str, timeout_s: float) -> bool:
        """GET url (an engine's /health) within timeout_s: True on a 200."""
        status, _ = await self.request("GET", url, timeout_s)
        return status == 200

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()

    # ---- connections --------------------------------------------------------------------------------

    async def _exchange(self, method: str, url: str, payload: bytes, headers: dict[str, str], read_timeout_s: float,
                        headers_timeout_s: float | None, total_s: float | None,
                        sent: tuple[_Conn, asyncio.Future] | None = None, head: bytes | None = None) -> EngineResponse:
        """`sent`: (a kept-alive connection, its headers future) the request was already written on (start_post);
        `head`: the request's head, if the caller built it already."""
        key, target, host = _target(url)
        if head is None:
            head = _head(method, target, host, headers, len(payload))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s if total_s else None
        for attempt in (0, 1):
            if attempt == 0 and sent is not None:
                (conn, headers_done), reused = sent, True
            else:
                conn = self._take(key, loop.time())
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(key, loop, deadline)
                left = deadline - loop.time() if deadline is not None else None
                if left is not None and left <= 0:
                    self._release(conn)
                    raise EngineUnreachableError(f"TotalTimeout: the request's deadline ({total_s:.3g}s) passed")
                try:
                    headers_done = conn.send(head, payload, read_timeout_s, headers_timeout_s, left)
                except (RuntimeError, OSError) as exc:  # the transport closed under us (uvloop raises on a closed handle)
                    conn._fail_with(EngineUnreachableError(f"ServerDisconnected: {exc}"))
                    if reused and attempt == 0:
                        continue
                    raise conn.error from exc
            try:
                await headers_done
            except EngineUnreachableError:
                if reused and attempt == 0 and not conn.received and conn.closed:
                    continue  # the engine had closed this idle connection: the request was never read
                raise
            except BaseException:  # cancelled: drop the connection, which aborts the engine's request
                conn._fail_with(EngineStreamError("Cancelled: the request was cancelled"))
                raise
            return EngineResponse(self, conn)
        raise AssertionError("unreachable")

    def _take(self, key: tuple, now: float) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            if not idle[0].usable() or now - idle[0].idle_since > KEEPALIVE_S:  # the oldest first: stale ones leave
                stale = idle.popleft()
                if stale.transport is not None:
                    stale.transport.close()
                continue
            conn = idle.pop()  # the most recently used
            if conn.usable():
                return conn
        return None

    async def _connect(self, key: tuple, loop: asyncio.AbstractEventLoop, deadline: float | None) -> _Conn:
        scheme, host, port = key
        timeout = self._connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(deadline - loop.time(), 0.001))
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:  # asyncio.timeout, not wait_for: no task of its own, so 2 loop turns to the write instead of 5 (in a
            # burst each turn waits behind the admissions that arrived meanwhile)
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Conn(loop, key), host, port,
                                                       ssl=self._ssl if scheme == "https" else None)
        except TimeoutError as exc:
            raise EngineUnreachableError(f"ConnectTimeout: no connection to {host}:{port} within {timeout:g}s") from exc
        except OSError as exc:
            raise EngineUnreachableError(f"ClientConnectorError: cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _release(self, conn: _Conn) -> None:
        """After an exchange: back to the idle connections if it ended cleanly and may be kept, else dropped."""
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn.pause_by_reader(False)
            conn._sink = conn._end = None
            conn._chunks.clear()
            conn.headers_done = None
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.key, deque()).append(conn)
        elif not conn.closed and conn.transport is not None:
            if conn.error is None:
                conn.error = EngineStreamError("Closed: the response was closed unread")
                conn._cancel_timers()
                conn._wake()
            conn.transport.abort()
