"""An httpx client to a frontend app in this process, over ASGI (no server) or over the CLI's own HTTP server.

The two differ where it matters for streams: only kvyard's HTTP server (orchestrator/commands.py `_serve`: uvicorn
with orchestrator/security/connections.py's protocol) offers the direct body (orchestrator/direct_body.py), so a
stream relayed through it takes the callback path; over ASGI it takes the send path. Tests parametrized over both
check that clients see the same thing either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from orchestrator.config import FrontendConfig
from orchestrator.testing.fake_engine import free_port

__all__ = ["TRANSPORTS", "frontend_client"]

TRANSPORTS = ("asgi", "http")


@asynccontextmanager
async def frontend_client(app, cfg: FrontendConfig, over: str = "asgi", **client_kw) -> AsyncIterator[httpx.AsyncClient]:
    """`over`: "asgi" (httpx's ASGI transport, the app's lifespan run here) or "http" (the app served on a free
    port of 127.0.0.1, lifespan run by the server)."""
    if over == "asgi":
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", **client_kw) as c:
                yield c
        return
    if over != "http":
        raise ValueError(f"over: one of {TRANSPORTS}, not {over!r}")
    from orchestrator.commands import _serve

    port = free_port()
    server = await _serve(app, cfg.model_copy(update={"host": "127.0.0.1", "port": port}))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the frontend's server stopped before it started")
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", **client_kw) as c:
            yield c
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
