"""Endpoints the frontend forwards whole to one engine: /v1/embeddings, /tokenize, /detokenize, /v1/responses.

Same gate as chat/completions (routes/openai.py: API key, rate limit), then here:

    model   must be served: 404 for an unknown name (503 + Retry-After while no worker is known at all), and by
            workers of the right task (workers/types.py WorkerTask): embeddings need an embedding (pooling) model,
            responses a generating one, else 400 naming `model`; tokenize/detokenize take either, and may leave
            `model` out when the fleet serves one model (vLLM's own endpoints make it optional)
    admit   the model's admission queue (429 / 503 as for generation)
    route   the router ranks the model's routable workers of that task (booked, released at the end); a Responses
            request continuing an earlier one (`previous_response_id`) goes only to the worker holding that state
    send    InferenceService.send_ranked: failover before any byte, breakers, deadlines (as for generation)
    relay   the body as the engine wrote it; a streamed Response as its SSE events, untouched

Responses are stateful on the engine. The id of every response relayed is pinned to its worker in the
session-affinity store (router/plugins/affinity.py, one pin per session id), so a response id is also a session
key: `x-session-id: <response id>` sends a chat turn to the same worker, and GET /v1/responses/{id} goes there.
An id this frontend has not seen (another frontend's, or one whose pin expired) is looked up on the workers: a
retrieval asks each ready worker in turn, a `previous_response_id` asks the model's routable workers at once
(GET /v1/responses/{id}), and the one that knows it is pinned. There is no mid-stream migration for these endpoints (an embedding is one
body; a Response's state lives on its engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from orchestrator import access_log
from orchestrator.client_gone import unless_client_leaves
from orchestrator.engine_client import EngineStreamError
from orchestrator.errors import BadRequestError, ModelNotFoundError, NotFoundError, ServiceUnavailableError
from orchestrator.json_input import load_json
from orchestrator.request_fields import ENGINE_INTERNAL
from orchestrator.resilience.admission import Ticket
from orchestrator.sessions import session_id_of
from router import Endpoint, NoEndpointsError, RouteRequest
from router.plugins.affinity import SessionAffinity
from workers.types import WorkerTask

__all__ = ["PassThrough", "ENDPOINTS"]

log = logging.getLogger("kvyard.frontend")


@dataclass(frozen=True, slots=True)
class _Endpoint:
    path: str  # the engine's path (vLLM's)
    task: WorkerTask | None  # the workers that can serve it (None: any)
    model_required: bool = True


ENDPOINTS = {
    "embeddings": _Endpoint("/v1/embeddings", WorkerTask.EMBED),
    "tokenize": _Endpoint("/tokenize", None, model_required=False),
    "detokenize": _Endpoint("/detokenize", None, model_required=False),
    "responses": _Endpoint("/v1/responses", WorkerTask.GENERATE),
}
_WHAT = {WorkerTask.EMBED: "embeddings (it is not an embedding model)", WorkerTask.GENERATE: "generation (it is an embedding model)"}
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")  # resp_<hex> (vLLM), resp_<alnum> (OpenAI)
_ID_SCAN_BYTES = 1 << 16  # how far into a streamed Response its id is looked for (it is in the first event)


class PassThrough:
    """The forwarding path, on the InferenceService's pool, router, admission, breakers and metrics."""

    def __init__(self, service) -> None:
        self.service = service
        self.pool = service.pool
        self.router = service.router
        self.metrics = service.metrics
        aff = service.cfg.affinity
        stage = next((s for s in self.router.stages if isinstance(s, SessionAffinity)), None)
        # with session affinity off, the pins are kept all the same (only Responses use them then)
        self.pins = stage or SessionAffinity(aff.ttl_s, aff.max_load_gap, aff.saturation_kv_usage, aff.max_sessions)

    # ---- which workers ---------------------------------------------------------------------------

    def _task_of(self, worker_id: str) -> WorkerTask | None:
        live = self.pool.workers.get(worker_id)
        return live.info.task if live is not None else None

    def _model(self, body: dict, ep: _Endpoint) -> str:
        model = body.get("model")
        if model is None and not ep.model_required:
            models = self.pool.models()
            if len(models) == 1:
                return models[0]
            raise BadRequestError("model: this server serves several models; name one", param="model")
        if not isinstance(model, str) or not model:
            raise BadRequestError("model: a model name is required", param="model")
        if self.pool.info_for(model) is None:
            if not self.pool.workers or not self.pool.discovery_ok:
                raise ServiceUnavailableError(f"no worker of `{model}` is known yet; retry shortly", retry_after=self.service.retry_after_s)
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        if ep.task is not None and not any(w.info.task == ep.task for w in self.pool.workers.values() if w.info.model == model):
            raise BadRequestError(f"The model `{model}` does not support {_WHAT[ep.task]}.", param="model")
        return model

    def _candidates(self, model: str, ep: _Endpoint, holder: str | None) -> list[Endpoint]:
        eps = [e for e in self.service.routable(model) if ep.task is None or self._task_of(e.worker_id) == ep.task]
        if holder is not None:
            held = [e for e in eps if e.worker_id == holder]
            if held:  # the response's state lives there; elsewhere the engine would not know it
                return held
        if not eps:
            raise ServiceUnavailableError(f"no worker is ready to serve `{model}`; retry shortly", retry_after=self.service.retry_after_s)
        return eps

    # ---- POST: forward one request -----------------------------------------------------------------

    async def handle(self, request: Request, kind: str) -> Response:
        """Forward one request; a client that leaves before the answer starts cancels it (the engine connection is
        dropped, so the engine aborts the request), as for generation."""
        t0 = time.perf_counter()
        raw = await self.service._read_body(request)
        return await unless_client_leaves(request, self._forward(request, raw, kind, t0))

    async def _forward(self, request: Request, raw: bytes, kind: str, t0: float) -> Response:
        ep = ENDPOINTS[kind]
        svc = self.service
        svc._start_probes()
        body = load_json(raw, "request body")
        if not isinstance(body, dict):
            raise BadRequestError("request body must be a JSON object")
        model = self._model(body, ep)
        if any(k in ENGINE_INTERNAL for k in body):  # what only kvyard may set (request_fields.py)
            body = {k: v for k, v in body.items() if k not in ENGINE_INTERNAL}
        if "model" not in body:
            body["model"] = model
        stream = kind == "responses" and body.get("stream") is True
        prev = body.get("previous_response_id") if kind == "responses" else None
        if prev is not None and not isinstance(prev, str):
            raise BadRequestError("previous_response_id: must be a string", param="previous_response_id")
        header = svc.cfg.affinity.header
        session = prev or session_id_of(request.headers.get(header), header)
        holder = self.pins.pinned_worker(prev) if prev else None
        if prev and holder is None and RESPONSE_ID.fullmatch(prev):  # another frontend's response: ask the workers
            holder = await self._find_holder(prev, model)
        key_id = getattr(request.state, "api_key_id", None)
        priority = getattr(request.state, "api_key_priority", ("normal", 1.0))
        with svc.tracing.span("kvyard.admission"):
            ticket = await svc.admission.admit(model, key_id, *priority)
        if ticket.queued_s:
            self.metrics.admission_wait.labels(model).observe(ticket.queued_s)
        rid = request.headers.get("x-request-id") or f"kvy-{uuid.uuid4().hex}"
        rreq = RouteRequest(request_id=rid, model=model, token_ids=[], max_tokens=0, session_id=session)
        svc.tracing.annotate(**{"kvyard.request_id": rid, "kvyard.model": model})
        booked = False
        self.metrics.inflight.labels(model).inc()
        try:
            try:
                decision = self.router.route(rreq, self._candidates(model, ep, holder))
            except NoEndpointsError as exc:
                raise ServiceUnavailableError(f"no worker is ready to serve `{model}`; retry shortly", retry_after=svc.retry_after_s) from exc
            booked = True
            self.metrics.decision_time.observe(self.router.last_decision_s)
            svc.tracing.route(decision, len(decision.ranked), self.router.last_decision_s)
            worker, resp = await svc.send_ranked(rreq, decision.ranked, ep.path, json.dumps(body).encode(), stream)
            self.metrics.routed.labels(model, worker.worker_id, decision.policy).inc()
            access_log.note(request_id=rid, model=model, worker=worker.worker_id, queue_s=ticket.queued_s, key_id=key_id)
            if kind == "responses" and svc.telemetry is not None:  # generation: the planner's load, like chat's
                svc.telemetry.on_arrival(model)
        except BaseException:
            self._finish(rreq, kind, t0, "error", ticket, booked)
            raise
        headers = {"x-request-id": rid, "x-kvyard-worker": worker.worker_id}
        if stream and resp.status_code < 400:
            return StreamingResponse(self._relay(resp, rreq, kind, t0, ticket, worker), media_type="text/event-stream; charset=utf-8",
                                     headers={**headers, "cache-control": "no-cache"})
        status = "ok"
        try:
            content = await resp.aread()
        except EngineStreamError as exc:
            svc.report_failure(worker.worker_id, str(exc))
            status = "engine_error"
            raise ServiceUnavailableError(f"the engine failed mid-response: {exc}", retry_after=svc.retry_after_s) from exc
        except BaseException:
            status = "cancelled"
            raise
        finally:
            await resp.aclose()
            if status == "ok":
                svc.breakers.success(worker.worker_id)
                status = "ok" if resp.status_code < 400 else str(resp.status_code)
            self._finish(rreq, kind, t0, status, ticket, True, usage=_field(content, "usage") if status == "ok" else None)
        if kind == "responses" and resp.status_code < 400:
            self._pin(_field(content, "id"), worker)
        if resp.status_code >= 400:
            content = openai_error_body(resp.status_code, content, ep.path)
        return Response(content, status_code=resp.status_code, media_type="application/json", headers=headers)

    async def _relay(self, resp, rreq: RouteRequest, kind: str, t0: float, ticket: Ticket, worker: Endpoint) -> AsyncIterator[bytes]:
        status = "ok"
        head = b""  # the first bytes, until the Response's id is found in them
        tail = b""  # the last bytes: the response.completed event carries the usage
        first_at: float | None = None
        try:
            async for chunk in resp.aiter_raw():
                if head is not None:
                    head += chunk
                    rid = _first_response_id(head)
                    if rid is not None or len(head) > _ID_SCAN_BYTES:
                        self._pin(rid, worker)
                        head = None
                if first_at is None and b"output_text.delta" in chunk:
                    first_at = time.perf_counter()
                tail = (tail + chunk)[-_ID_SCAN_BYTES:]
                yield chunk
            self.service.breakers.success(worker.worker_id)
        except EngineStreamError as exc:
            status = "engine_error"
            self.service.report_failure(worker.worker_id, str(exc))
            log.warning("response stream %s from %s broke: %s", rreq.request_id, worker.worker_id, exc)
            err = {"type": "error", "code": "upstream_error", "message": f"the engine stream failed: {exc}", "param": None}
            yield b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
        except BaseException:
            status = "cancelled"
            raise
        finally:
            await resp.aclose()
            self._finish(rreq, kind, t0, status, ticket, True, usage=_completed_usage(tail), first_at=first_at)

    def _pin(self, response_id: str | None, worker: Endpoint) -> None:
        if isinstance(response_id, str) and response_id:
            self.pins.on_booked(RouteRequest(request_id=response_id, model=worker.model, token_ids=[], session_id=response_id), worker)

    def _finish(self, rreq: RouteRequest, kind: str, t0: float, status: str, ticket: Ticket, booked: bool,
                usage: dict | None = None, first_at: float | None = None) -> None:
        """Close the books; a Response's usage (input/output tokens) and first-token time feed the planner's
        telemetry and the access log as a chat completion's do."""
        duration = time.perf_counter() - t0
        if booked:
            self.router.on_complete(rreq.request_id)
        ticket.release()
        self.metrics.inflight.labels(rreq.model).dec()
        self.metrics.duration.labels(rreq.model).observe(duration)
        self.metrics.requests.labels(rreq.model, kind, status).inc()
        if kind != "responses":
            return
        usage = usage if isinstance(usage, dict) else {}
        isl, osl = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
        access_log.note(prompt_tokens=isl or None, output_tokens=osl or None, ttft_at=first_at)
        if self.service.telemetry is not None and booked:
            self.service.telemetry.on_finish(rreq.model, ttft_s=first_at - t0 if first_at is not None else None, duration_s=duration,
                                             isl=isl, osl=osl, ok=status == "ok")

    # ---- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------------

    async def _find_holder(self, response_id: str, model: str) -> str | None:
        """The worker of `model` that knows the response (GET /v1/responses/{id} on each routable one at once), pinned;
        None if none does. For a response this frontend did not relay: several frontends share one fleet."""
        eps = [e for e in self.service.routable(model) if self._task_of(e.worker_id) == WorkerTask.GENERATE]
        if len(eps) < 2:
            return None  # one candidate (or none): routing finds it anyway
        timeout = self.service.cfg.resilience.first_byte_timeout_s
        answers = await asyncio.gather(*(self.service.client.request("GET", f"{e.url}/v1/responses/{response_id}", timeout) for e in eps))
        for e, (status, _) in zip(eps, answers):
            if status == 200:
                self._pin(response_id, e)
                return e.worker_id
        return None

    async def response_op(self, response_id: str, method: str, suffix: str = "") -> Response:
        """Ask the worker holding the response (or, unknown here, every ready generating worker in turn)."""
        if not RESPONSE_ID.fullmatch(response_id):  # it goes into an engine's URL: an id, never a path
            raise NotFoundError(f"Response with id '{response_id[:64]}' not found.", param="response_id")
        svc = self.service
        holder = self.pins.pinned_worker(response_id)
        workers = [w for w in self.pool.workers.values() if w.info.task == WorkerTask.GENERATE and w.info.state.value == "ready"
                   and svc.breakers.allows(w.info.worker_id)]
        workers.sort(key=lambda w: w.info.worker_id != holder)  # the holder first
        if holder is not None and workers and workers[0].info.worker_id == holder:
            workers = workers[:1]
        path = f"/v1/responses/{response_id}{suffix}"
        last: tuple[int, bytes] | None = None
        for w in workers:
            status, content = await svc.client.request(method, w.info.url + path, svc.cfg.resilience.first_byte_timeout_s)
            if status is None:
                svc.report_failure(w.info.worker_id, "unreachable")
                continue
            if status < 400 or status != 404:
                if status < 400:
                    self.pins.on_booked(RouteRequest(request_id=response_id, model=w.info.model, token_ids=[], session_id=response_id),
                                        Endpoint(worker_id=w.info.worker_id, url=w.info.url, model=w.info.model))
                self.metrics.requests.labels(w.info.model, "responses_" + (suffix.strip("/") or method.lower()), str(status) if status >= 400 else "ok").inc()
                if status >= 400:
                    content = openai_error_body(status, content, "/v1/responses")
                return Response(content, status_code=status, media_type="application/json", headers={"x-kvyard-worker": w.info.worker_id})
            last = (status, content)
        if last is None and not workers:
            raise ServiceUnavailableError("no worker is ready to look the response up; retry shortly", retry_after=svc.retry_after_s)
        if last is not None:  # every engine said 404: the client gets the engine's own answer (vLLM's error shape)
            return Response(openai_error_body(404, last[1], "/v1/responses"), status_code=404, media_type="application/json")
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


def openai_error_body(status: int, content: bytes, path: str) -> bytes:
    """An engine's error as the client gets it: its own OpenAI-shaped error (vLLM's nested one, SGLang's and TRT-LLM's
    flat one) as is; anything else (an engine without the route answers its framework's 404 `{"detail": ...}` or
    plain text) wrapped into one."""
    try:
        value = json.loads(content)
    except ValueError:
        value = None
    if isinstance(value, dict) and (isinstance(value.get("error"), dict) or isinstance(value.get("message"), str)):
        return content
    if status == 404 or status == 405:
        message = f"this model's engine does not serve {path}"
    else:
        message = f"the engine answered HTTP {status}: {content[:200].decode('utf-8', 'replace')}"
    return json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "upstream_error",
                                 "param": None, "code": status}}).encode()


def _field(content: bytes, name: str):
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value.get(name) if isinstance(value, dict) else None


def _completed_usage(tail: bytes) -> dict | None:
    """The usage of a streamed Response: in its last event, `response.completed` {"response": {"usage": ...}}."""
    at = tail.rfind(b"event: response.completed")
    if at < 0:
        return None
    for line in tail[at:].split(b"\n"):
        if line.startswith(b"data:"):
            try:
                resp = json.loads(line[5:]).get("response")
            except (ValueError, AttributeError):
                return None
            return resp.get("usage") if isinstance(resp, dict) else None
    return None


def _first_response_id(head: bytes) -> str | None:
    """The id in a streamed Response's first event (`response.created`: {"response": {"id": ...}}), once complete."""
    end = head.find(b"\n\n")
    if end < 0:
        return None
    for line in head[:end].split(b"\n"):
        if line.startswith(b"data:"):
            try:
                ev = json.loads(line[5:])
            except ValueError:
                return ""
            resp = ev.get("response") if isinstance(ev, dict) else None
            return resp.get("id", "") if isinstance(resp, dict) else ""
    return ""
