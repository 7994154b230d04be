"""Fan-in for a bidirectional stream: every request read from the client runs as its own task, and
their responses are written back on the one stream in the order they are produced.

    serve_stream(request_iterator, handle_one) -> async iterator of responses
      reader   : for each request, start handle_one(request, emit) as a task
      consumer : yield what the tasks emit; end when the client has half-closed and every task is done
      cancel   : if the RPC ends early (client cancelled, deadline, server stop), the reader and every
                 task are cancelled and awaited -- a cancelled relay closes its engine connection,
                 which aborts the engine request

The queue is unbounded: a relay never blocks on a slow client (responses are small token deltas and
a request's total is bounded by its max_tokens); gRPC flow control applies to the writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

__all__ = ["serve_stream"]

log = logging.getLogger("kvyard.grpc")

_READ_DONE = object()
_ONE_DONE = object()


async def serve_stream(
    request_iterator: AsyncIterator[Any],
    handle_one: Callable[[Any, Callable[[Any], None]], Awaitable[None]],
    on_crash: Callable[[Any, BaseException], Any] | None = None,
) -> AsyncIterator[Any]:
    """Run `handle_one(request, emit)` per request concurrently; yield everything they `emit`.

    `on_crash(request, exc)` turns an unexpected exception of one handler into a response to emit
    (the stream itself carries on); handlers are expected to turn their known errors into responses.
    """
    queue: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()
    started = 0

    async def run_one(request: Any) -> None:
        try:
            await handle_one(request, queue.put_nowait)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in one request must not take down the others
            log.exception("stream request failed")
            if on_crash is not None:
                queue.put_nowait(on_crash(request, exc))
        finally:
            queue.put_nowait(_ONE_DONE)

    async def read() -> None:
        nonlocal started
        try:
            async for request in request_iterator:
                started += 1
                task = asyncio.create_task(run_one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            queue.put_nowait(_READ_DONE)

    reader = asyncio.create_task(read())
    reading, finished = True, 0
    try:
        while reading or finished < started:
            item = await queue.get()
            if item is _READ_DONE:
                reading = False
            elif item is _ONE_DONE:
                finished += 1
            else:
                yield item
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            log.warning("reading the request stream failed: %r", reader.exception())
    finally:
        pending = [reader, *tasks]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
