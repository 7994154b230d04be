"""HTTP client for the token path: frontend -> engine, on aiohttp.

aiohttp's C HTTP parser reads a streamed chunk in a fraction of the CPU that httpx+h11 take
(measured: benchmarks/frontend_overhead.py), and the frontend relays every token, so this hop
uses it. Its errors are translated here into two of ours:
    EngineUnreachableError  nothing was received (connect refused/timed out): safe to retry elsewhere
    EngineStreamError       the engine failed after answering: the response is partial

Every wait has a deadline: connect (connect_timeout_s), the response headers (`headers_timeout_s`
of `post`), each read of the body (`read_timeout_s`, aiohttp's sock_read: the longest silence), and
the whole exchange (`total_s`, the request's remaining deadline).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

__all__ = ["EngineClient", "EngineResponse", "EngineUnreachableError", "EngineStreamError"]


class EngineUnreachableError(ConnectionError):
    pass


class EngineStreamError(ConnectionError):
    pass


class EngineResponse:
    """One engine response whose headers have arrived; read it once, then it is closed."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (whatever is buffered, per read): one awaited call per chunk, no generators
        stacked in between (the relay runs this once per streamed token)."""
        return _RawChunks(self._resp.content)

    async def aread(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineStreamError(f"{type(exc).__name__}: {exc}") from exc

    def abort(self) -> None:
        """Drop the connection now (the engine stopped answering): a pending read raises EngineStreamError."""
        if not self._resp.closed:
            self._resp.close()

    async def aclose(self) -> None:
        """Close; if the body was not fully read the connection is dropped, which aborts the engine request."""
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class _RawChunks:
    """`async for chunk in ...`: aiohttp's readany() until EOF, its errors as EngineStreamError."""

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> "_RawChunks":
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineStreamError(f"{type(exc).__name__}: {exc}") from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk


class EngineClient:
    def __init__(self, connect_timeout_s: float, limit: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # created lazily inside the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=30.0, ttl_dns_cache=60),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def post(self, url: str, payload: bytes, headers: dict[str, str], read_timeout_s: float,
                   headers_timeout_s: float | None = None, total_s: float | None = None) -> EngineResponse:
        """POST and wait for the response headers (at most `headers_timeout_s`); the body is read later."""
        timeout = aiohttp.ClientTimeout(total=total_s, connect=self._connect_timeout_s, sock_read=read_timeout_s)
        try:
            call = self._get_session().post(url, data=payload, headers=headers, timeout=timeout)
            resp = await (asyncio.wait_for(call, headers_timeout_s) if headers_timeout_s else call)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            raise EngineUnreachableError(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnreachableError(f"{type(exc).__name__}: {exc}") from exc
        return EngineResponse(resp)

    async def request(self, method: str, url: str, timeout_s: float) -> tuple[int | None, bytes]:
        """A small bodiless call (GET / POST) read whole: (status, body), or (None, b"") if the engine did not answer."""
        try:
            async with self._get_session().request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None, b""

    async def healthy(self, url: str, timeout_s: float) -> bool:
        """GET url (an engine's /health) within timeout_s: True on a 200."""
        try:
            async with self._get_session().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
