"""`inference.GRPCInferenceService` on top of InferenceService (the HTTP frontend's request path).

    ServerLive        always live while the process serves
    ServerReady       at least one worker is ready
    ModelReady        the model has a ready worker (unknown model: ready=false, as Triton answers)
    ServerMetadata    name "kvyard", the package version, extensions ["parameters"]
    ModelMetadata     the LLM tensors (see llm.py); unknown model -> NOT_FOUND
    ModelInfer        one completion; text_output is the whole text
    ModelStreamInfer  per request: stream=true -> one response per engine chunk with the text delta, then
                      a final one (empty text, usage, triton_final_response=true); stream=false -> one
                      final response with the whole text. Errors go in `error_message`.

Auth (when the frontend has API keys): ModelReady, ModelMetadata, ModelInfer and ModelStreamInfer need
`authorization: Bearer <key>` (or `x-api-key`) metadata, else UNAUTHENTICATED; the key's rate limits
apply per inference request: RESOURCE_EXHAUSTED + `retry-after` for ModelInfer, an in-band
error_message ("rate_limit_exceeded: ...") for one request of a ModelStreamInfer stream.
ServerLive, ServerReady, ServerMetadata, health and reflection stay open (probes).

Every inference request becomes an OpenAI /v1/completions body and goes through
`InferenceService.dispatch` (validation, context-length checks, routing, failover, metrics), so gRPC
and HTTP answer alike. Model version: "" or "1" (kvyard serves one version per model name).
"""

from __future__ import annotations

import functools
import json
import logging
from contextlib import aclosing
from importlib.metadata import PackageNotFoundError, version

import grpc

from orchestrator.errors import BadRequestError, KvyardError, ModelNotFoundError, PayloadTooLargeError, UpstreamError
from orchestrator.grpc.fanin import serve_stream
from orchestrator.grpc.generated import pb, pb_grpc
from orchestrator.grpc.llm import FINAL_FLAG, INPUTS, OUTPUT, completion_body, text_response
from orchestrator.grpc.status import engine_error, grpc_code, trailing_metadata
from orchestrator.pool import WorkerPool
from orchestrator.security import InferenceGuard, Principal, estimate_tokens
from orchestrator.service import Dispatched, InferenceService
from workers.types import WorkerState

__all__ = ["InferenceServicer", "MODEL_VERSION", "SERVICE_NAME"]

log = logging.getLogger("kvyard.grpc")

SERVICE_NAME = "inference.GRPCInferenceService"
MODEL_VERSION = "1"
_RPC = "/" + SERVICE_NAME + "/"

try:
    _VERSION = version("kvyard")
except PackageNotFoundError:  # running from a source tree without an install
    _VERSION = "0.0.0"


def _check_version(model: str, v: str) -> None:
    if v not in ("", MODEL_VERSION):
        raise ModelNotFoundError(f"The model `{model}` has no version '{v}' (kvyard serves version {MODEL_VERSION}).",
                                 param="model_version")


def _usage_params(usage: dict, finish_reason: str | None) -> dict:
    return {"prompt_tokens": int(usage.get("prompt_tokens", 0)), "completion_tokens": int(usage.get("completion_tokens", 0)),
            "finish_reason": finish_reason}


def _sse_payloads(chunk: bytes):
    """The JSON objects in a run of SSE events (`data: {...}` separated by blank lines); [DONE] skipped."""
    for ev in chunk.split(b"\n\n"):
        ev = ev.strip()
        if ev.startswith(b"data: {"):
            try:
                yield json.loads(ev[6:])
            except ValueError:
                log.warning("dropping an undecodable engine event: %r", ev[:200])


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService, pool: WorkerPool, guard: InferenceGuard | None = None) -> None:
        self.service = service
        self.pool = pool
        self.guard = guard or InferenceGuard(None)  # no keys: every call is let in

    def _authenticate(self, context) -> Principal | None:
        """The caller's key (None when keys are off); raises AuthenticationError."""
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return self.guard.authenticate(md, "grpc")

    async def _admit(self, principal: Principal | None, body: dict) -> None:
        """Charge the key's rate limits for one inference request; raises RateLimitError."""
        if principal is None:
            return
        tokens = 0
        if self.guard.needs_token_estimate(principal):
            tokens = estimate_tokens(body, "completions", self.pool.context_len)
        await self.guard.admit(principal, tokens)

    def any_ready(self) -> bool:
        return any(w.info.state == WorkerState.READY for w in self.pool.workers.values())

    # ---- server and model state --------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.any_ready())

    async def ModelReady(self, request, context):
        try:
            self._authenticate(context)
        except KvyardError as exc:
            await self._abort(context, exc, "ModelReady")
        ok = request.version in ("", MODEL_VERSION) and bool(self.pool.ready(request.name))
        return pb.ModelReadyResponse(ready=ok)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kvyard", version=_VERSION, extensions=["parameters"])

    async def ModelMetadata(self, request, context):
        try:
            self._authenticate(context)
            if self.pool.info_for(request.name) is None:
                raise ModelNotFoundError(f"The model `{request.name}` does not exist.", param="model")
            _check_version(request.name, request.version)
        except KvyardError as exc:
            await self._abort(context, exc, "ModelMetadata")
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name, versions=[MODEL_VERSION], platform="kvyard",
            inputs=[T(name=n, datatype=dt, shape=shape) for n, dt, shape in INPUTS],
            outputs=[T(name=OUTPUT, datatype="BYTES", shape=[-1])],
        )

    # ---- inference ---------------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        try:
            principal = self._authenticate(context)
            body, stream, prepend = completion_body(request)
            _check_version(request.model_name, request.model_version)
            if stream:
                raise BadRequestError("stream=true needs the streaming RPC ModelStreamInfer", param="stream")
            await self._admit(principal, body)
            rid = dict(context.invocation_metadata() or ()).get("x-request-id")
            d = await self._dispatch(body, rid, principal)
            resp = await self._unary(request, body, prepend, d)
            await context.send_initial_metadata((("x-request-id", d.rreq.request_id), ("x-kvyard-worker", d.endpoint.worker_id)))
            return resp
        except KvyardError as exc:
            await self._abort(context, exc, "ModelInfer")
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: INTERNAL with a message, counted, logged (never an opaque UNKNOWN)
            log.exception("ModelInfer failed")
            await self._abort(context, KvyardError(f"internal error ({type(exc).__name__})"), "ModelInfer")

    async def ModelStreamInfer(self, request_iterator, context):
        try:  # once per call, before any request is read
            principal = self._authenticate(context)
        except KvyardError as exc:
            await self._abort(context, exc, "ModelStreamInfer")
        handle = functools.partial(self._stream_one, principal=principal)
        async for response in serve_stream(request_iterator, handle, self._crash_response):
            yield response

    # ---- helpers -----------------------------------------------------------------------------

    async def _dispatch(self, body: dict, request_id: str | None, principal: Principal | None = None) -> Dispatched:
        payload = json.dumps(body).encode()
        limit = self.service.cfg.max_body_bytes
        if len(payload) > limit:
            raise PayloadTooLargeError(f"request is {len(payload)} bytes as JSON; the limit is {limit}")
        if principal is not None:  # the admission queue's per-key hook
            return await self.service.dispatch(payload, "completions", request_id, key_id=principal.key_id,
                                               priority=(principal.priority, principal.weight))
        return await self.service.dispatch(payload, "completions", request_id)

    async def _unary(self, request, body: dict, prepend: bool, d: Dispatched) -> pb.ModelInferResponse:
        """Consume a dispatched non-streaming request (nothing may await between dispatch and this)."""
        if d.resp.status_code >= 400:
            raise engine_error(d.resp.status_code, await self.service.release(d, str(d.resp.status_code)))
        content = await self.service.unary_body(d)
        try:
            doc = json.loads(content)
            choice = doc["choices"][0]
            text = choice.get("text") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise UpstreamError(f"the engine's answer could not be read: {type(exc).__name__}") from exc
        if prepend:
            text = body["prompt"] + text
        return text_response(request.model_name, MODEL_VERSION, request.id, text,
                             _usage_params(doc.get("usage") or {}, choice.get("finish_reason")))

    async def _stream_one(self, request, emit, principal: Principal | None = None) -> None:
        """One request of a ModelStreamInfer call: emit its responses, or one error response."""
        try:
            body, stream, prepend = completion_body(request)
            _check_version(request.model_name, request.model_version)
            await self._admit(principal, body)
            d = await self._dispatch(body, None, principal)
            if not stream:
                resp = await self._unary(request, body, prepend, d)
                resp.parameters[FINAL_FLAG].bool_param = True
                emit(pb.ModelStreamInferResponse(infer_response=resp))
                return
            if d.resp.status_code >= 400:
                raise engine_error(d.resp.status_code, await self.service.release(d, str(d.resp.status_code)))
            await self._relay(request, d, emit)
        except KvyardError as exc:
            self._count_error(exc, "ModelStreamInfer")
            emit(self._error_response(request, f"{exc.code}: {exc.message}" if exc.status == 429 else exc.message))

    async def _relay(self, request, d: Dispatched, emit) -> None:
        model, rid = request.model_name, request.id
        usage: dict = {}
        finish_reason = None
        async with aclosing(self.service.stream_events(d)) as events:
            async for chunk in events:
                for ev in _sse_payloads(chunk):
                    if "error" in ev:
                        err = ev["error"]
                        msg = err.get("message") if isinstance(err, dict) else str(err)
                        emit(self._error_response(request, msg or "the engine stream failed"))
                        return
                    if ev.get("usage") and not ev.get("choices"):
                        usage = ev["usage"]
                    for choice in ev.get("choices") or ():
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if choice.get("text"):
                            emit(pb.ModelStreamInferResponse(
                                infer_response=text_response(model, MODEL_VERSION, rid, choice["text"], {FINAL_FLAG: False})))
        params = {**_usage_params(usage, finish_reason), FINAL_FLAG: True}
        emit(pb.ModelStreamInferResponse(infer_response=text_response(model, MODEL_VERSION, rid, "", params)))

    def _error_response(self, request, message: str) -> pb.ModelStreamInferResponse:
        resp = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
        resp.parameters[FINAL_FLAG].bool_param = True
        return pb.ModelStreamInferResponse(error_message=message, infer_response=resp)

    def _crash_response(self, request, exc: BaseException) -> pb.ModelStreamInferResponse:
        self.service.metrics.requests.labels("", _RPC + "ModelStreamInfer", "500").inc()
        return self._error_response(request, f"internal error: {type(exc).__name__}")

    def _count_error(self, exc: KvyardError, rpc: str) -> None:
        self.service.metrics.requests.labels("", _RPC + rpc, str(exc.status)).inc()

    async def _abort(self, context: grpc.aio.ServicerContext, exc: KvyardError, rpc: str) -> None:
        self._count_error(exc, rpc)
        await context.abort(grpc_code(exc.status), exc.message, trailing_metadata(exc))
