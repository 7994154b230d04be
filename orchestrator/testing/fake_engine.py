"""A minimal stand-in engine for frontend unit tests: vLLM-shaped JSON and SSE, scriptable faults.

Not a simulator (that is workers/sim); it exists to make failure paths (500s, broken streams,
slow answers) happen on demand.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.types import WorkerInfo

__all__ = ["FakeEngine", "ThreadedEngine", "free_port", "free_port_pair", "free_port_run", "winfo"]


def winfo(wid: str, url: str, max_model_len: int = 64) -> WorkerInfo:
    """A registry entry for a fake engine at `url`: model "m", block size 16, the sim's tokenizer."""
    return WorkerInfo(worker_id=wid, model="m", backend="sim", url=url, block_size=16, max_model_len=max_model_len,
                      tokenizer=str(SIM_TOKENIZER_DIR))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port p outside the kernel's ephemeral range with p .. p + n - 1 all free now: a local cluster's `--base-port`
    (its engines bind them seconds later; a port from the ephemeral range can meanwhile become an outgoing
    connection's source port, which a clean-clone CI run saw as `address already in use`)."""
    from orchestrator.disagg.launch import free_port as outside_ephemeral

    for _ in range(50):
        p = outside_ephemeral()
        try:
            socks = []
            for i in range(1, n):
                b = socket.socket()
                socks.append(b)
                b.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for b in socks:
                b.close()
    raise RuntimeError(f"no run of {n} free ports found")


def free_port_pair() -> int:
    """A port p with p and p + 1 both free now (an engine's KV-event socket and its replay socket; a local cluster's
    first two engines), outside the kernel's ephemeral range (free_port_run)."""
    return free_port_run(2)


class ThreadedEngine:
    """A Starlette app served by uvicorn on a free 127.0.0.1 port in a thread; `with` starts and stops it."""

    def _serve_routes(self, routes: list[Route]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="error"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(5)


class FakeEngine(ThreadedEngine):
    def __init__(self, tokens: int = 5, fail_status: int | None = None, break_after: int | None = None, delay_s: float = 0.0) -> None:
        self.tokens = tokens
        self.fail_status = fail_status
        self.break_after = break_after
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self.cancelled = 0
        self._serve_routes([
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route("/health", lambda r: PlainTextResponse("")),
            Route("/metrics", lambda r: PlainTextResponse("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n")),
        ])

    async def _complete(self, request: Request):
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers)})
        if self.fail_status:
            return JSONResponse({"error": {"message": "boom", "type": "InternalError", "code": self.fail_status}}, status_code=self.fail_status)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        chat = request.url.path.endswith("chat/completions")
        n = min(self.tokens, body.get("max_tokens") or self.tokens)
        usage = {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "x" * n}} if chat else {"index": 0, "text": "x" * n}
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice], "usage": usage})

        async def gen():
            try:
                for i in range(n):
                    if self.break_after is not None and i == self.break_after:
                        raise RuntimeError("engine died mid-stream")
                    delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                    yield "data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, **delta, "finish_reason": None}]}, separators=(",", ":")) + "\n\n"
                    await asyncio.sleep(0.005)
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield "data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}, separators=(",", ":")) + "\n\n"
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

        return StreamingResponse(gen(), media_type="text/event-stream; charset=utf-8")
