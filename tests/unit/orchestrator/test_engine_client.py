"""The engine HTTP client (orchestrator/engine_client.py) against scripted engines on 127.0.0.1: both ways of reading
a body, keep-alive reuse, every deadline, and each way an engine can fail, mapped to the two errors the service
acts on (unreachable: send elsewhere; stream error: the response is partial)."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.engine_client import EngineClient, EngineStreamError, EngineUnreachableError, _Conn


class Engine:
    """A TCP server that reads each request (head + Content-Length body) and answers with `script(writer, n)`,
    n counting requests from 0; it records connections and requests."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if await self.script(writer, len(self.requests) - 1) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


OK_CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"


async def _engine(script):
    e = Engine(script)
    url = await e.start()
    return e, url


async def test_chunked_body_read_whole_and_by_pieces():
    async def script(w, n):
        w.write(OK_CHUNKED)
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            w.write(b"%x\r\n%b\r\n" % (len(part), part))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/v1/completions?x=1", b'{"a":1}', {"content-type": "application/json"}, 5)
    assert r.status_code == 200
    assert await r.aread() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    await r.aclose()
    assert e.requests[0].startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"content-type: application/json\r\n" in e.requests[0] and e.requests[0].endswith(b'Content-Length: 7\r\n\r\n{"a":1}')
    r = await c.post(url + "/v1/completions", b"{}", {}, 5)
    pieces = [p async for p in r.aiter_raw()]
    await r.aclose()
    assert b"".join(pieces).endswith(b"[DONE]\n\n") and len(pieces) >= 2
    assert e.connections == 1  # kept alive and reused
    await c.close()
    await e.stop()


async def test_push_hands_every_chunk_in_order_including_what_came_before():
    async def script(w, n):
        w.write(OK_CHUNKED + b"%x\r\n%b\r\n" % (9, b"data: 0\n\n"))
        await w.drain()
        await asyncio.sleep(0.05)  # the client has the headers and the first chunk before it starts pushing
        for i in range(1, 20):
            w.write(chunked(b"data: %d\n\n" % i)[:-5])
            await w.drain()
        w.write(b"0\r\n\r\n")

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, 5)
    await asyncio.sleep(0.02)
    got: list[bytes] = []
    await r.stream_into(got.append)
    await r.aclose()
    assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(20))
    await c.close()
    await e.stop()


async def test_content_length_and_connection_delimited_bodies():
    async def script(w, n):
        if n == 0:
            w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nnope!")
        else:  # HTTP/1.0 style: the body ends with the connection
            w.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
            return "close"

    e, url = await _engine(script)
    c = EngineClient(1.0)
    assert await c.request("GET", url + "/a", 2) == (404, b"nope!")
    assert await c.request("GET", url + "/b", 2) == (200, b"all of it")
    assert b"GET /a HTTP/1.1" in e.requests[0] and b"Content-Length" not in e.requests[0]
    await c.close()
    await e.stop()


async def test_an_idle_connection_the_engine_closed_is_replaced_once():
    async def script(w, n):
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        return "close"  # closes after answering, without saying so: the client's idle connection is dead

    e, url = await _engine(script)
    c = EngineClient(1.0)
    for _ in range(3):
        assert await c.request("GET", url + "/health", 2) == (200, b"ok")
        await asyncio.sleep(0.05)
    assert e.connections == 3
    assert await c.healthy(url + "/health", 2)
    await c.close()
    await e.stop()


async def test_read_headers_and_total_deadlines():
    async def script(w, n):
        if n == 0:  # headers, one event, then silence
            w.write(OK_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
            await asyncio.sleep(5)
        elif n == 1:  # nothing at all
            await asyncio.sleep(5)
        else:  # a steady trickle that outlives the total deadline
            w.write(OK_CHUNKED)
            for _ in range(100):
                w.write(b"9\r\ndata: 1\n\n\r\n")
                await asyncio.sleep(0.05)

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, read_timeout_s=0.3)
    t0 = time.perf_counter()
    with pytest.raises(EngineStreamError, match="Timeout"):
        await r.aread()
    assert 0.2 < time.perf_counter() - t0 < 2
    await r.aclose()
    t0 = time.perf_counter()
    with pytest.raises(EngineUnreachableError, match="HeadersTimeout"):
        await c.post(url + "/x", b"", {}, read_timeout_s=5, headers_timeout_s=0.3)
    assert time.perf_counter() - t0 < 2
    r = await c.post(url + "/x", b"", {}, read_timeout_s=1, total_s=0.5)
    got = []
    with pytest.raises(EngineStreamError, match="TotalTimeout"):
        await r.stream_into(got.append)
    assert got  # what came before the deadline was handed on
    await r.aclose()
    await c.close()
    await e.stop()


async def test_time_the_reader_paused_is_not_engine_silence():
    async def script(w, n):
        w.write(OK_CHUNKED)
        for _ in range(6):
            w.write(b"9\r\ndata: 1\n\n\r\n")
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(b"0\r\n\r\n")

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, read_timeout_s=0.25)
    r.pause_reading()
    await asyncio.sleep(0.8)  # longer than the read deadline, paused by us
    r.resume_reading()
    assert (await r.aread()).count(b"data: 1") == 6
    await r.aclose()
    await c.close()
    await e.stop()


async def test_engine_failures_mapped_to_the_two_errors():
    async def script(w, n):
        if n == 0:  # dies mid-body
            w.write(OK_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.transport.abort()
            return "close"
        w.write(b"this is not HTTP\r\n\r\n")  # garbage instead of a status line
        return "close"

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, 5)
    got = []
    with pytest.raises(EngineStreamError, match="ServerDisconnected"):
        async for piece in r.aiter_raw():
            got.append(piece)
    assert got == [b"data: 1\n\n"]
    await r.aclose()
    with pytest.raises(EngineUnreachableError, match="BadResponse"):
        await c.post(url + "/x", b"", {}, 5)
    await e.stop()
    with pytest.raises(EngineUnreachableError, match="cannot connect"):
        await c.post(url + "/x", b"", {}, 5)
    with pytest.raises(ValueError):
        await c.post(url + "/x", b"", {"x-evil": "a\r\nInjected: 1"}, 5)
    await c.close()


async def test_abort_close_and_cancel_drop_the_engine_connection():
    async def script(w, n):
        w.write(OK_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.3)
        w.write(b"9\r\ndata: 2\n\n\r\n")  # the peer is gone by now: the server's next read sees it
        await w.drain()

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, 5)
    reading = asyncio.ensure_future(r.aread())
    await asyncio.sleep(0.05)
    r.abort()  # the engine was found hung
    with pytest.raises(EngineStreamError, match="Aborted"):
        await reading
    await r.aclose()
    await asyncio.wait_for(e.closed_by_client.wait(), 2)

    e2, url2 = await _engine(lambda w, n: asyncio.sleep(0.3))  # answers nothing; then reads on, and sees the close
    post = asyncio.ensure_future(c.post(url2 + "/x", b"", {}, 5))
    await asyncio.sleep(0.1)
    post.cancel()  # the client left while the engine had not answered yet
    with pytest.raises(asyncio.CancelledError):
        await post
    await asyncio.wait_for(e2.closed_by_client.wait(), 2)
    assert not c._idle.get(("http", "127.0.0.1", int(url2.rsplit(":", 1)[1])))
    await c.close()
    await e.stop()
    await e2.stop()


async def test_start_post_writes_on_a_kept_alive_connection_before_the_loop_turns():
    async def script(w, n):
        if n == 1:
            await asyncio.sleep(0.3)  # the second request is cancelled before this answers
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    e, url = await _engine(script)
    c = EngineClient(1.0)
    key = ("http", "127.0.0.1", int(url.rsplit(":", 1)[1]))
    r = await c.start_post(url + "/x", b'{"a": 1}', {}, 5)  # no idle connection yet: the task connects first
    assert await r.aread() == b"ok"
    await r.aclose()
    conn = c._idle[key][-1]
    t = c.start_post(url + "/x", b'{"b": 2}', {}, 5)
    assert not c._idle[key] and conn.headers_done is not None  # written before the task's first step
    assert not conn.transport.get_write_buffer_size()  # handed to the kernel, not queued
    r = await t
    assert await r.aread() == b"ok" and e.requests[-1].endswith(b'{"b": 2}') and e.connections == 1
    await r.aclose()
    conn = c._idle[key][-1]
    t = c.start_post(url + "/x", b"{}", {}, 5)
    t.cancel()  # before its first step: its coroutine never runs, the connection must still be dropped
    with pytest.raises(asyncio.CancelledError):
        await t
    assert conn.error is not None and not c._idle[key]
    await asyncio.wait_for(e.closed_by_client.wait(), 2)
    await c.close()
    await e.stop()


async def test_an_error_in_the_push_callback_ends_the_read_with_it():
    async def script(w, n):
        w.write(OK_CHUNKED + chunked(b"data: 1\n\n", b"data: 2\n\n"))

    e, url = await _engine(script)
    c = EngineClient(1.0)
    r = await c.post(url + "/x", b"", {}, 5)

    def bad(chunk: bytes) -> None:
        raise KeyError("a bug in the relay")

    with pytest.raises(KeyError):
        await r.stream_into(bad)
    await r.aclose()
    await c.close()
    await e.stop()


class _DeadTransport:
    """A transport as uvloop leaves it between the engine's EOF and connection_lost: closing, and writes raise."""

    def __init__(self, real, says_closing: bool) -> None:
        self.real, self.says_closing = real, says_closing

    def is_closing(self) -> bool:
        return self.says_closing

    def write(self, data) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    writelines = write

    def abort(self) -> None:
        self.real.abort()

    def close(self) -> None:
        self.real.close()


@pytest.mark.parametrize("says_closing", [True, False])
async def test_an_idle_connection_whose_transport_died_is_replaced(says_closing):
    """Passed over when it says it is closing; re-sent on a new connection when the write itself raises."""
    async def script(w, n):
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    e, url = await _engine(script)
    c = EngineClient(1.0)
    assert await c.request("GET", url + "/a", 2) == (200, b"ok")
    (idle,) = c._idle.values()
    idle[0].transport = _DeadTransport(idle[0].transport, says_closing)
    resp = await c.post(url + "/b", b"", {}, 2)
    assert resp.status_code == 200 and await resp.aread() == b"ok"
    await resp.aclose()
    assert e.connections == 2
    await c.close()
    await e.stop()


async def test_a_request_on_a_new_connection_is_written_one_loop_turn_after_the_connect():
    """In a burst, every loop turn between a request's admission and its engine write waits behind the admissions that
    arrived meanwhile. Without a kept-alive connection, the write follows the connect on the task's next step: one
    turn more than the connect itself takes on this loop (a wait_for around the connect took three more)."""
    async def script(w, n):
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    e, url = await _engine(script)
    loop = asyncio.get_running_loop()
    turns = 0

    def tick():
        nonlocal turns
        turns += 1
        ticker[0] = loop.call_soon(tick)

    ticker = [loop.call_soon(tick)]
    port = int(url.rsplit(":", 1)[1])
    start = turns
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    connect_turns = turns - start
    transport.close()
    c = EngineClient(1.0)
    written: list[int] = []
    real_send = _Conn.send

    def send(self, *args):
        written.append(turns)
        return real_send(self, *args)

    _Conn.send = send
    try:
        start = turns
        r = await c.start_post(url + "/x", b"{}", {}, 5)
    finally:
        _Conn.send = real_send
        ticker[0].cancel()
    assert written and written[0] - start <= connect_turns + 1, (written[0] - start, connect_turns)
    assert await r.aread() == b"ok"
    await r.aclose()
    await c.close()
    await e.stop()
