"""The inference path: validate -> tokenize -> route -> dispatch (with failover) -> relay.

    handle(request, kind)
      body  = read (413 past max_body_bytes) and validate (400 naming the field)
      model = must be served by some registered worker (404), with a ready one (503 + Retry-After)
      ids   = prompt tokens (chat template applied); longer than the context -> 400
      plan  = router.route(ids, live endpoints) -> endpoints ranked best first
      send  = POST to the best; on connection error or 5xx *before any byte reached the client*,
              book the next-ranked one and try again (max_attempts); then 503
      relay = SSE event by event (streaming) or the JSON body; the router hears first token and
              completion on every path, including client disconnect (which aborts the engine request)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from orchestrator.config import FrontendConfig
from orchestrator.engine_client import EngineClient, EngineResponse, EngineStreamError, EngineUnreachableError
from orchestrator.errors import (
    BadRequestError,
    ContextLengthError,
    KvyardError,
    ModelNotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
)
from orchestrator.metrics import FrontendMetrics
from orchestrator.pool import WorkerPool
from orchestrator.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from orchestrator.telemetry_recorder import FrontendTelemetry
from orchestrator.streaming import StreamStats, relay_sse, sse_error_event
from orchestrator.tokenizer import load_tokenizer
from router import Endpoint, NoEndpointsError, RouteRequest, Router
from workers.types import WorkerInfo

__all__ = ["InferenceService", "Dispatched"]

log = logging.getLogger("kvyard.frontend")

@dataclass(slots=True)
class Dispatched:
    """A routed request whose engine has answered with headers; its body is yet to be relayed."""

    rreq: RouteRequest
    endpoint: Endpoint
    resp: EngineResponse
    stream: bool
    include_usage: bool
    t0: float


_KINDS = {
    "completions": ("/v1/completions", CompletionRequest),
    "chat": ("/v1/chat/completions", ChatCompletionRequest),
}


class InferenceService:
    def __init__(self, cfg: FrontendConfig, pool: WorkerPool, router: Router, metrics: FrontendMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.client = EngineClient(cfg.connect_timeout_s)
        self.telemetry: FrontendTelemetry | None = None  # set by the app when telemetry is on

    async def close(self) -> None:
        await self.client.close()

    # ---- request admission -------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect as exc:
            raise BadRequestError("client disconnected while sending the body") from exc
        return b"".join(chunks)

    def _prompt_ids(self, req, info: WorkerInfo) -> list[int]:
        folder = self.pool.tokenizer_dir(info.model)
        if folder is None:  # no tokenizer reachable yet: route without token ids; the engine checks lengths
            return []
        tok = load_tokenizer(folder)
        if isinstance(req, ChatCompletionRequest):
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            return tok.encode_chat(msgs)
        prompt = req.prompt
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt[0], list):
            return max(prompt, key=len)
        return max((tok.encode(p) for p in prompt), key=len)

    def _check_lengths(self, req, ids: list[int], info: WorkerInfo) -> None:
        ctx = info.max_model_len
        if len(ids) > ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has {len(ids)} tokens. "
                "Please reduce the length of the prompt.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        want = req.requested_max_tokens()
        if want is not None and want + len(ids) > ctx:
            raise ContextLengthError(
                f"max_tokens={want} is too large: with {len(ids)} prompt tokens the total exceeds the model's "
                f"maximum context length of {ctx} tokens.",
                param="max_tokens",
            )

    # ---- the request path --------------------------------------------------------------------

    async def dispatch(self, raw: bytes, kind: str, request_id: str | None = None) -> Dispatched:
        """Validate, route and open the engine response; transport-neutral (HTTP and gRPC call this).

        On return the engine has answered with headers; the caller must consume the response with
        `stream_events` / `unary_body`, or `release` it, so the router's bookkeeping is closed.
        """
        t0 = time.perf_counter()
        path, model_cls = _KINDS[kind]
        req, body = parse_request(raw, model_cls)
        info = self.pool.info_for(req.model)
        if info is None:
            raise ModelNotFoundError(f"The model `{req.model}` does not exist.", param="model")
        ids = self._prompt_ids(req, info)
        self._check_lengths(req, ids, info)
        endpoints = self.pool.endpoints(req.model)
        rid = request_id or f"kvy-{uuid.uuid4().hex}"
        rreq = RouteRequest(request_id=rid, model=req.model, token_ids=ids, max_tokens=req.requested_max_tokens() or 0)
        try:
            decision = self.router.route(rreq, endpoints)
        except NoEndpointsError as exc:
            raise ServiceUnavailableError(f"no worker is ready to serve `{req.model}`; retry shortly", retry_after=self.cfg.retry_after_s) from exc
        self.metrics.decision_time.observe(self.router.last_decision_s)
        if self.telemetry is not None:
            self.telemetry.on_arrival(req.model)
        self.metrics.isl.labels(req.model).observe(len(ids))
        if req.stream:
            body = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        payload = json.dumps(body).encode()
        self.metrics.inflight.labels(req.model).inc()
        try:
            ep, resp = await self._send(rreq, decision.ranked, path, payload, req.stream)
        except BaseException:
            self._finish(rreq, t0, "error")
            raise
        self.metrics.routed.labels(req.model, ep.worker_id, decision.policy).inc()
        if ids and ep.block_size:
            overlap = decision.overlap_of(ep)
            self.metrics.overlap_blocks.labels(req.model).inc(overlap)
            self.metrics.prompt_blocks.labels(req.model).inc(len(ids) // ep.block_size)
            self.metrics.kv_hit_rate.labels(req.model).observe(min(1.0, overlap * ep.block_size / len(ids)))
        return Dispatched(rreq, ep, resp, req.stream, req.include_usage, t0)

    async def release(self, d: Dispatched, status: str) -> bytes:
        """Read and close a response that will not be relayed (e.g. the engine's own 4xx)."""
        try:
            return await d.resp.aread()
        finally:
            await d.resp.aclose()
            self._finish(d.rreq, d.t0, status)

    async def handle(self, request: Request, kind: str) -> Response:
        """HTTP: body limits, then dispatch, then SSE or JSON back to the client."""
        d = await self.dispatch(await self._read_body(request), kind, request.headers.get("x-request-id"))
        headers = {"x-request-id": d.rreq.request_id, "x-kvyard-worker": d.endpoint.worker_id}
        if d.resp.status_code >= 400:  # the engine refused the request (client error): pass it on as is
            body_bytes = await self.release(d, str(d.resp.status_code))
            return Response(body_bytes, status_code=d.resp.status_code, media_type="application/json", headers=headers)
        if d.stream:
            return StreamingResponse(self.stream_events(d), media_type="text/event-stream; charset=utf-8",
                                     headers={**headers, "cache-control": "no-cache"})
        return await self._unary(request, d, headers)

    async def _send(self, rreq: RouteRequest, ranked: list[Endpoint], path: str, payload: bytes, stream: bool):
        """POST to the ranked engines in turn until one answers below 500."""
        last_error = "no engine answered"
        read_timeout = self.cfg.stream_idle_timeout_s if stream else self.cfg.first_byte_timeout_s
        headers = {"content-type": "application/json", "x-request-id": rreq.request_id}
        for attempt, ep in enumerate(ranked[: self.cfg.max_attempts]):
            if attempt:
                self.metrics.retries.labels(rreq.model).inc()
                self.router.on_complete(rreq.request_id)
                self.router.book(rreq, ep)
            try:
                resp = await self.client.post(ep.url + path, payload, headers, read_timeout)
            except EngineUnreachableError as exc:
                last_error = f"{ep.worker_id}: {exc}"
                log.warning("engine %s failed before answering %s: %s", ep.worker_id, rreq.request_id, last_error)
                continue
            if resp.status_code >= 500:
                last_error = f"{ep.worker_id}: HTTP {resp.status_code}"
                await resp.aclose()
                continue
            return ep, resp
        raise ServiceUnavailableError(f"no engine could serve the request ({last_error})", retry_after=self.cfg.retry_after_s)

    async def stream_events(self, d: Dispatched):
        """Relay the engine's SSE events (bytes, each ending in a blank line) until [DONE]."""
        rreq, resp, forward_usage, t0 = d.rreq, d.resp, d.include_usage, d.t0
        stats = StreamStats()
        model = rreq.model
        itl = self.metrics.itl.labels(model)
        status = "ok"

        def first_token() -> None:
            self.router.on_first_token(rreq.request_id)
            self.metrics.ttft.labels(model).observe(time.perf_counter() - t0)

        try:
            async for out in relay_sse(resp.aiter_raw(), stats, forward_usage, first_token, itl.observe):
                yield out
        except EngineStreamError as exc:
            status = "engine_error"
            log.warning("stream %s broke: %s", rreq.request_id, exc)
            yield sse_error_event(f"the engine stream failed: {exc}")
        except BaseException:  # client went away (CancelledError / GeneratorExit): abort upstream
            status = "cancelled"
            raise
        finally:
            await resp.aclose()
            osl = int((stats.usage or {}).get("completion_tokens", stats.content_events))
            if stats.usage:
                self.metrics.osl.labels(model).observe(osl)
            ttft = stats.first_token_at - t0 if stats.first_token_at is not None else None
            self._finish(rreq, t0, status, ttft_s=ttft, osl=osl)

    async def _unary(self, request: Request, d: Dispatched, headers: dict) -> Response:
        read = asyncio.ensure_future(self.unary_body(d))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:  # client left: cancelling the read drops the engine connection, the engine aborts
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
                return Response(status_code=499)
            content = read.result()
        finally:
            gone.cancel()
        return Response(content, status_code=d.resp.status_code, media_type="application/json", headers=headers)

    async def unary_body(self, d: Dispatched) -> bytes:
        """Read a non-streaming engine response; cancelling this aborts the engine request."""
        rreq, resp, t0 = d.rreq, d.resp, d.t0
        status = "ok"
        try:
            content = await resp.aread()
        except EngineStreamError as exc:
            status = "engine_error"
            raise ServiceUnavailableError(f"the engine failed mid-response: {type(exc).__name__}", retry_after=self.cfg.retry_after_s) from exc
        except BaseException:
            status = "cancelled"
            raise
        finally:
            await resp.aclose()
            if status != "ok":
                self._finish(rreq, t0, status)
        self.router.on_first_token(rreq.request_id)
        osl = 0
        try:
            osl = int((json.loads(content).get("usage") or {}).get("completion_tokens", 0))
            self.metrics.osl.labels(rreq.model).observe(osl)
        except (ValueError, AttributeError, TypeError):
            pass
        self._finish(rreq, t0, "ok", osl=osl)
        return content

    def _finish(self, rreq: RouteRequest, t0: float, status: str, ttft_s: float | None = None, osl: int = 0) -> None:
        """Close the books on a request, on every path: router load, metrics, telemetry."""
        duration = time.perf_counter() - t0
        self.router.on_complete(rreq.request_id)
        self.metrics.inflight.labels(rreq.model).dec()
        self.metrics.duration.labels(rreq.model).observe(duration)
        self.metrics.requests.labels(rreq.model, "generate", status).inc()
        if self.telemetry is not None:
            self.telemetry.on_finish(rreq.model, ttft_s=ttft_s, duration_s=duration, isl=rreq.isl, osl=osl, ok=status == "ok")


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


