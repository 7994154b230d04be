"""A request's work raced against its client leaving: the answer, or 499 with the work cancelled.

    return await unless_client_leaves(request, self._respond(...))

Used once the request body has been read (the receive channel then carries only `http.disconnect`): a client that
leaves while its request is queued, tokenized or waiting for the engine cancels it, which drops the engine
connection (the engine aborts the request) and lets the work's own cleanup close the books. A streamed answer is
watched by its response (orchestrator/service.py `_RelayResponse`) from the moment its headers go out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["disconnected", "unless_client_leaves"]


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client left first
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
        return task.result()
    finally:
        gone.cancel()


async def disconnected(receive) -> None:
    """Returns when the ASGI `receive` channel says the client left (once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
