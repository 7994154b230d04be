"""A request's work raced against its client leaving: the answer, or 499 with the work cancelled.

    return await unless_client_leaves(request, self._respond(...))
    left, value = await watched(direct, work)     # the same race, for a DirectBody's request (service.py's relay)

Used once the request body has been read (the receive channel then carries only `http.disconnect`): a client that
leaves while its request is queued, tokenized or waiting for the engine cancels it, which drops the engine
connection (the engine aborts the request) and lets the work's own cleanup close the books. A streamed answer is
watched by its response (orchestrator/service.py `_RelayResponse`) from the moment its headers go out.

On kvyard's own HTTP server (the request has a DirectBody, orchestrator/direct_body.py) the work runs in the request's
own task and the protocol's connection_lost cancels that task: no task of its own, no task waiting on `receive()`,
no `asyncio.wait` (two loop turns a request less, which a burst of new requests waits behind). Elsewhere
(another ASGI server, the tests' in-process transport) the work runs as a task raced against `receive()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from orchestrator.direct_body import EXTENSION as DIRECT_BODY, DirectBody

__all__ = ["disconnected", "unless_client_leaves", "watched"]


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    direct = request.scope.get("extensions", {}).get(DIRECT_BODY)
    if direct is not None:
        left, response = await watched(direct, work)
        return Response(status_code=499) if left else response
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


async def watched(direct: DirectBody, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await `work` in this task; if the client's connection is lost meanwhile the task is cancelled, the work sees
    CancelledError (and cleans up as it would), and this returns (True, None). Otherwise (False, the work's value);
    the work's own errors, and a cancellation of this task from elsewhere, propagate."""
    if direct.client_gone:
        if asyncio.iscoroutine(work):
            work.close()
        return True, None
    task = asyncio.current_task()
    left = False

    def gone() -> None:
        nonlocal left
        if not left:
            left = True
            task.cancel()

    direct.on_gone = gone
    try:
        return False, await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # only the client's leaving cancelled it
            return True, None
        raise
    finally:
        direct.on_gone = None


async def disconnected(receive) -> None:
    """Returns when the ASGI `receive` channel says the client left (once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
