"""The inference path: validate -> tokenize -> admit -> route -> dispatch (with failover) -> relay (with migration).

    handle(request, kind)
      body  = read (413 past max_body_bytes) and validate (400 naming the field)
      model = must be served by some registered worker (404), with a ready one (503 + Retry-After)
      ids   = prompt tokens (chat template applied); longer than the context -> 400; max_tokens over
              max_tokens_cap -> 400 (absent: the cap is filled in)
      admit = bounded admission queue per model (resilience/admission.py): 429 for a client over
              its rate, 503 + Retry-After when the fleet is saturated and the queue full or too slow
      plan  = router.route(ids, live endpoints whose circuit breaker is closed) -> ranked best first
      send  = POST to the best; on connection error, timeout or 5xx *before any byte reached the
              client*, book the next-ranked one and try again after a jittered backoff (max_attempts)
      relay = SSE event by event (streaming) or the JSON body; if the stream breaks after tokens
              reached the client, it is continued on another worker (resilience/migration.py) up to
              max_migrations times, so the client sees one complete answer
    Every wait has a deadline (connect, headers, idle stream, the whole request); every outcome
    feeds the worker's circuit breaker (resilience/breaker.py); the router hears first token and
    completion on every path, including client disconnect (which aborts the engine request).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from orchestrator import access_log
from orchestrator.client_gone import disconnected, unless_client_leaves, watched
from orchestrator.config import FrontendConfig
from orchestrator.direct_body import EXTENSION as DIRECT_BODY, DirectBody
from orchestrator.disagg.coordinator import protocol_of
from orchestrator.engine_client import EngineClient, EngineResponse, EngineStreamError, EngineUnreachableError
from orchestrator.errors import (
    BadRequestError,
    KvyardError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from orchestrator.json_input import dump_json
from orchestrator.lora import LoraAdapterSpec, LoraManager, features_of
from orchestrator.metrics import BatchedObserver, FrontendMetrics
from orchestrator.multimodal import stamp_uuids
from orchestrator.security.http import read_body
from orchestrator.pool import WorkerPool
from orchestrator.prepare import EAGER, PromptCacheCollector, PromptPreparer, PromptTokens
from orchestrator.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from orchestrator.request_fields import RequestFields
from orchestrator.resilience.admission import AdmissionController, Ticket, worker_saturated
from orchestrator.resilience.breaker import BreakerBoard, BreakerState, backoff_s
from orchestrator.resilience.liveness import HungWorkers
from orchestrator.resilience.migration import (
    CONTINUATION_PATH,
    ChunkRewriter,
    StreamTracker,
    continuation_body,
    migration_blocker,
    usage_event,
)
from orchestrator.sessions import session_id_of
from orchestrator.telemetry_recorder import FrontendTelemetry
from orchestrator.tracing import Tracing
from orchestrator.streaming import Relay, StreamStats, sse_error_event
from router import Endpoint, NoEndpointsError, RouteRequest, Router
from workers.types import WorkerInfo, WorkerTask

__all__ = ["InferenceService", "Dispatched"]

log = logging.getLogger("kvyard.frontend")

_DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Dispatched:
    """A routed request whose engine has answered with headers; its body is yet to be relayed."""

    rreq: RouteRequest
    endpoint: Endpoint
    resp: EngineResponse
    stream: bool
    include_usage: bool
    t0: float
    # what a retry or a mid-stream migration needs
    kind: str = "completions"
    path: str = ""
    body: dict = field(default_factory=dict)  # the client's request as forwarded (before stream_options)
    payload: bytes = b""  # what the engines were sent
    prompt: PromptTokens = field(default_factory=PromptTokens)  # its ids: all of them once complete
    max_tokens: int | None = None
    blocker: str | None = None  # why the request cannot be migrated, None if it can
    strip_ids: bool = False  # the frontend asked the engine for token ids the client did not ask for
    deadline: float = 0.0  # perf_counter time the whole request must end by
    ticket: Ticket | None = None
    failed: set[str] = field(default_factory=set)  # workers that failed this request
    relay_started: bool = False  # stream_events ran (it closes the books), or `abandon` did


@dataclass(slots=True)
class _Standalone:
    """Deadline and failed workers of a send made outside `dispatch` (e.g. by the disagg coordinator)."""

    deadline: float
    failed: set[str] = field(default_factory=set)


_KINDS = {
    "completions": ("/v1/completions", CompletionRequest),
    "chat": ("/v1/chat/completions", ChatCompletionRequest),
}


class _Ended(Exception):
    """A broken stream that cannot be continued: the message of the error event that ends it."""


class InferenceService:
    def __init__(self, cfg: FrontendConfig, pool: WorkerPool, router: Router, metrics: FrontendMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.client = EngineClient(cfg.resilience.connect_timeout_s)
        self.telemetry: FrontendTelemetry | None = None  # set by the app when telemetry is on
        self.tracing = Tracing.off()  # set by the app when tracing is on (orchestrator/tracing.py)
        self.rng = random.Random()
        rc, ac = cfg.resilience, cfg.admission
        self.breakers = BreakerBoard(rc.breaker_failure_threshold, rc.breaker_open_s, rc.breaker_max_open_s,
                                     probe=self._probe, on_change=self._breaker_changed)
        self.admission = AdmissionController(
            ac.max_inflight_per_model, ac.max_queued_per_model, ac.timeout_s, rc.retry_after_s,
            saturated=self.fleet_saturated, recheck_s=min(0.25, cfg.scrape_interval_s),
            on_reject=lambda model, reason: metrics.admission_rejected.labels(model, reason).inc(),
            on_queue=lambda model, depth: metrics.admission_queue.labels(model).set(depth), fair=cfg.fair_share.enabled)
        # LoRA adapters loaded on demand (orchestrator/lora.py); None when none is configured
        self.lora = LoraManager(cfg.lora, self._protocol_of) if cfg.lora.adapters else None
        if self.lora is not None:
            pool.on_worker_left.append(self.lora.forget_worker)
        self._probing = False
        # engines that stop answering: out of routing, their requests in flight failed over (resilience/liveness.py)
        self.hung = HungWorkers(self._probe, self._trip, self._has_alternative)
        pool.on_worker_unresponsive.append(self.hung.suspect)
        pool.on_worker_left.append(self._forget)
        self.prep = PromptPreparer(pool, cfg.max_tokens_cap, cache_tokens=cfg.prompt_cache_tokens, fast_bpe=cfg.fast_bpe,
                                   learn=cfg.learn_prompt_ids)
        metrics.registry.register(PromptCacheCollector(self.prep))
        self.fields = RequestFields(cfg.security.request_fields, on_removed=lambda reason: metrics.fields_removed.labels(reason).inc())
        # disaggregated prefill/decode (orchestrator/disagg): set by the app; None serves every model aggregated
        self.disagg = None

    async def close(self) -> None:
        await self.breakers.close()
        await self.admission.close()
        await self.client.close()
        self.prep.close()
        if self.lora is not None:
            await self.lora.close()

    # ---- worker health -----------------------------------------------------------------------

    def _start_probes(self) -> None:
        if not self._probing:  # lazily, inside the running loop
            self._probing = True
            self.breakers.start(min(1.0, self.cfg.resilience.breaker_open_s / 2))

    async def _probe(self, worker_id: str) -> bool:
        self.breakers.prune(set(self.pool.workers))
        live = self.pool.workers.get(worker_id)
        if live is None:
            return False
        return await self.client.healthy(live.info.url + "/health", self.cfg.resilience.health_probe_timeout_s)

    def _forget(self, worker_id: str) -> None:
        """A worker left the pool: its per-worker series and books go with it."""
        self.hung.forget(worker_id)
        self.breakers.prune(set(self.pool.workers))
        self.metrics.forget_worker(worker_id)

    def _trip(self, worker_id: str, why: str) -> None:
        if worker_id in self.pool.workers:  # not one that left meanwhile
            self.breakers.trip(worker_id, why)

    def _has_alternative(self, worker_id: str) -> bool:
        live = self.pool.workers.get(worker_id)
        return live is not None and any(e.worker_id != worker_id for e in self.routable(live.info.model))

    def _breaker_changed(self, worker_id: str, state: BreakerState) -> None:
        self.metrics.breaker_state.labels(worker_id).set(int(state))
        self.metrics.breaker_transitions.labels(worker_id, state.name.lower()).inc()

    def allows(self, worker_id: str) -> bool:
        """The worker's circuit breaker lets a request through now (EngineSender, for the disagg coordinator)."""
        return self.breakers.allows(worker_id)

    def report_failure(self, worker_id: str, reason: str) -> None:
        """A failure seen outside this service's own sends (a disagg prefill) counts against the worker's breaker."""
        self.breakers.failure(worker_id, reason)

    @property
    def retry_after_s(self) -> float:
        return self.cfg.resilience.retry_after_s

    def routable(self, model: str) -> list[Endpoint]:
        """Ready endpoints of the model whose circuit breaker is closed."""
        return [e for e in self.pool.endpoints(model) if self.breakers.allows(e.worker_id)]

    def _tokenize_until(self, model: str, lora_name: str | None):
        """How far a long prompt must be tokenized for routing (orchestrator/prepare.py, 4): the kv policy's index
        tells, when every worker of the model feeds it KV events; all of it for predicted contents (workers without
        events) and disaggregated models; none of it for policies without an index."""
        index = self.router.kv_index
        if index is None:
            return None
        workers = [w.info for w in self.pool.ready(model)]
        if not workers or (self.disagg is not None and self.disagg.applies(model)) or not all(index.event_fed(w.worker_id) for w in workers):
            return EAGER
        block_size = workers[0].block_size
        return lambda ids: self.router.prefix_cached(ids, block_size, lora_name)

    def fleet_saturated(self, model: str) -> bool:
        """Every routable worker of the model reports KV usage and waiting requests over the thresholds."""
        ws = [w for w in self.pool.ready(model) if w.info.role.value != "prefill" and self.breakers.allows(w.info.worker_id)]
        if not ws or any(w.metrics is None for w in ws):
            return False
        return all(worker_saturated(w.metrics.kv_cache_usage, w.metrics.num_requests_waiting,
                                    self.cfg.admission.saturation_kv_usage, self.cfg.admission.saturation_waiting) for w in ws)

    # ---- request admission -------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.cfg.max_body_bytes)  # 413 past the limit, as the auth layer reads it

    # ---- LoRA adapters, engine fields ----------------------------------------------------------

    def _protocol_of(self, worker_id: str) -> str | None:
        live = self.pool.workers.get(worker_id)
        return protocol_of(live.info) if live is not None else None

    async def _prepare_adapter(self, rreq: RouteRequest, adapter: LoraAdapterSpec, decision) -> None:
        """Load the adapter on the first worker of the ranking that can (orchestrator/lora.py) and move the booking
        there if that is not the router's first choice; decision.ranked becomes that worker, then the other holders."""
        first = decision.ranked[0]
        decision.ranked = await self.lora.prepare(adapter, decision.ranked)
        if decision.ranked[0] is not first:
            self.router.on_complete(rreq.request_id)
            self.router.book(rreq, decision.ranked[0])
        self.lora.begin(rreq.request_id, decision.ranked[0].worker_id, adapter.name)

    def _engine_fields(self, body: dict, info: WorkerInfo, adapter: LoraAdapterSpec | None, mm_items: list, priority: str) -> dict:
        """What the engine needs beyond the client's body: the adapter's fields, the multimodal identifiers, the
        key's priority (each in the engine's own words, workers/<backend>/features.py)."""
        proto = protocol_of(info)
        feats = features_of(proto)
        if adapter is not None and feats is not None:
            body = {**body, **feats.lora_request_fields(adapter.name, adapter.base_model)}
        if mm_items and proto == "vllm" and self.cfg.multimodal.stamp_uuids:
            body = stamp_uuids(body)
        if self.cfg.fair_share.engine_priority and feats is not None and "priority" not in body:
            body = {**body, "priority": feats.priority_value(priority)}
        return body

    def _adapter_holders(self, rreq: RouteRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        """Failover for an adapter's request: only workers that hold the adapter (others would answer 404)."""
        if rreq.lora_name and self.lora is not None:
            return self.lora.holders(rreq.lora_name, endpoints)
        return endpoints

    # ---- the request path --------------------------------------------------------------------

    async def dispatch(self, raw: bytes, kind: str, request_id: str | None = None, key_id: str | None = None, *,
                       session_id: str | None = None, priority: tuple[str, float] = ("normal", 1.0)) -> Dispatched:
        """Validate, admit, route and open the engine response; transport-neutral (HTTP and gRPC call this).

        On return the engine has answered with headers; the caller must consume the response with
        `stream_events` / `unary_body`, or `release` it, so the router's bookkeeping and the
        admission slot are closed. `key_id` names the client's API key (per-key rate limits); `priority` is
        its (class, weight) in the admission queue; `session_id` the conversation (session affinity).
        """
        t0 = time.perf_counter()
        self._start_probes()
        path, model_cls = _KINDS[kind]
        req, body = parse_request(raw, model_cls)
        body = self.fields.filter(kind, body)  # engine-internal fields never come from a client (request_fields.py)
        adapter = self.lora.resolve(req.model) if self.lora is not None else None  # a LoRA adapter: its base model serves it
        model = adapter.base_model if adapter is not None else req.model
        info = self.pool.info_for(model)
        if info is None:
            if not self.pool.workers or not self.pool.discovery_ok:
                # knowing no worker at all (just started, or the registry was emptied by a Redis restart while the
                # workers re-register), or cut off from discovery, the frontend cannot tell a wrong name from a fleet
                # on its way: retryable 503, not a 404 that tells the client the model does not exist
                raise ServiceUnavailableError(f"no worker of `{model}` is known yet; retry shortly", retry_after=self.cfg.resilience.retry_after_s)
            raise ModelNotFoundError(f"The model `{req.model}` does not exist.", param="model")
        if info.task == WorkerTask.EMBED:  # a pooling model: /v1/embeddings only (orchestrator/passthrough.py)
            raise BadRequestError(f"The model `{model}` does not support generation (it is an embedding model).", param="model")
        ctx = self.pool.context_len(model) or info.max_model_len
        try:  # long prompts are tokenized off the loop, and only as far as routing needs (prepare.py)
            with self.tracing.span("kvyard.tokenize"):  # tracing hook
                prompt = await self.prep.prompt_ids(req, model, ctx, self.cfg.multimodal.spec(),
                                                    lambda: self._tokenize_until(model, adapter.name if adapter is not None else None),
                                                    engine_refuses=protocol_of(info) == "vllm")
            ids, mm_items = prompt.ids, prompt.mm_items
            self.prep.check_lengths(req, prompt.count, ctx)
            body, max_tokens = self.prep.fill_max_tokens(req, body, prompt.count, ctx)
            with self.tracing.span("kvyard.admission"):  # tracing hook
                ticket = await self.admission.admit(model, key_id, *priority)
        except asyncio.CancelledError:  # the client left while its prompt was tokenized or it was queued
            self.metrics.requests.labels(model, "generate", "cancelled").inc()
            raise
        if ticket.queued_s:
            self.metrics.admission_wait.labels(model).observe(ticket.queued_s)
        rid = request_id or f"kvy-{uuid.uuid4().hex}"
        self.tracing.annotate(**{"kvyard.request_id": rid, "kvyard.model": model, "kvyard.prompt_tokens": prompt.count})  # tracing hook
        booked = False
        try:
            endpoints = self.routable(model)
            if not endpoints and self.pool.endpoints(model):
                wait = max(self.cfg.resilience.retry_after_s, self.breakers.retry_after_s())
                raise ServiceUnavailableError(f"every worker of `{model}` is failing its health checks; retry shortly", retry_after=wait)
            rreq = RouteRequest(request_id=rid, model=model, token_ids=ids, max_tokens=max_tokens or 0, session_id=session_id,
                                lora_name=adapter.name if adapter is not None else None, mm_items=tuple(mm_items),
                                prompt_tokens=-1 if prompt.complete else prompt.count)
            disagg = self.disagg if self.disagg is not None and self.disagg.applies(model) else None
            if adapter is not None:
                if disagg is not None:
                    raise BadRequestError(f"LoRA adapter `{adapter.name}` cannot be served: `{model}` runs disaggregated", param="model")
                self.lora.annotate(endpoints)
            try:
                decision = disagg.route_decode(rreq, endpoints) if disagg else self.router.route(rreq, endpoints)
            except NoEndpointsError as exc:
                raise ServiceUnavailableError(f"no worker is ready to serve `{model}`; retry shortly", retry_after=self.cfg.resilience.retry_after_s) from exc
            booked = True
            if adapter is not None:  # the first worker that has, or now loads, the adapter (orchestrator/lora.py)
                await self._prepare_adapter(rreq, adapter, decision)
        except BaseException:
            if booked:
                self.router.on_complete(rid)
            ticket.release()
            raise
        decision_s = self.router.last_decision_s  # the router's, until the next request routes
        self.tracing.route(decision, len(endpoints), decision_s)  # tracing hook
        blocker = migration_blocker(kind, body, prompt.obtainable) if self.cfg.resilience.max_migrations else "migration disabled"
        strip_ids = False
        send_body = body
        if req.stream:
            send_body = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
            # vLLM and the sim in its vLLM flavor answer `return_token_ids` (SGLang and TRT-LLM do not)
            if blocker is None and protocol_of(info) == "vllm" and not body.get("return_token_ids"):
                send_body["return_token_ids"] = True  # exact continuation prompts (resilience/migration.py)
                strip_ids = True
        send_body = self._engine_fields(send_body, info, adapter, mm_items, priority[0])
        payload = dump_json(send_body)
        d = Dispatched(rreq, endpoints[0], None, req.stream, req.include_usage, t0, kind=kind, path=path, body=body,  # type: ignore[arg-type]
                       payload=payload, prompt=prompt, max_tokens=max_tokens, blocker=blocker, strip_ids=strip_ids,
                       deadline=t0 + self.cfg.resilience.request_timeout_s, ticket=ticket)
        self.metrics.child(self.metrics.inflight, model).inc()
        booked_arrival = False

        def book_arrival() -> None:  # once the engine request is sent (send_ranked's `sent`): not after its answer
            nonlocal booked_arrival
            if not booked_arrival:
                booked_arrival = True
                self.metrics.decision_time.observe(decision_s)
                if self.telemetry is not None:
                    self.telemetry.on_arrival(model)
        try:
            if disagg:  # the disagg hook: prefill remotely (or not), then the decode response is relayed as usual
                book_arrival()
                d.endpoint, d.resp = await disagg.send(rreq, send_body, payload, decision, path, req.stream)
            else:
                d.endpoint, d.resp = await self.send_ranked(rreq, decision.ranked, path, payload, req.stream, d, book_arrival)
        except BaseException as exc:
            book_arrival()
            self._finish(rreq, t0, "cancelled" if isinstance(exc, asyncio.CancelledError) else "error", ticket=ticket)
            raise
        self.metrics.routed.labels(model, d.endpoint.worker_id, decision.policy).inc()
        ep = d.endpoint
        access_log.note(request_id=rid, model=model, worker=ep.worker_id, prompt_tokens=prompt.count, key_id=key_id,  # access-log hook
                        cached_tokens=decision.overlap_of(ep) * ep.block_size if ids else None, queue_s=ticket.queued_s)
        if adapter is not None:
            self.lora.begin(rid, ep.worker_id, adapter.name)
        if ids and ep.block_size:
            overlap = decision.overlap_of(ep)
            self.metrics.child(self.metrics.overlap_blocks, model).inc(overlap)
            if decision.overlap_blocks:
                self.metrics.child(self.metrics.best_overlap_blocks, model).inc(max(decision.overlap_blocks.values()))
            self.metrics.child(self.metrics.prompt_blocks, model).inc(prompt.count // ep.block_size)
            self.metrics.child(self.metrics.kv_hit_rate, model).observe(min(1.0, overlap * ep.block_size / max(1, prompt.count)))
        return d

    async def release(self, d: Dispatched, status: str) -> bytes:
        """Read and close a response that will not be relayed (e.g. the engine's own 4xx). A 400 for a prompt
        admitted on its token estimate raises this frontend's context-length error if the exact count breaks a
        limit (prepare.py, `recheck`)."""
        try:
            body = await d.resp.aread()
        finally:
            await d.resp.aclose()
            self.breakers.success(d.endpoint.worker_id)  # it answered: alive
            self._finish(d.rreq, d.t0, status, ticket=d.ticket)
        if d.resp.status_code == 400:
            await self.prep.recheck(d.prompt)  # nothing unless the prompt was sent on its estimate
        return body

    async def handle(self, request: Request, kind: str) -> Response:
        """HTTP: body limits, then dispatch, then SSE or JSON back to the client.

        From the moment the body is read the client's connection is watched: a client that leaves while
        its request is queued, tokenized, waiting for the engine's headers (a non-streaming answer's come
        with its end) or being read cancels it, which drops the engine connection (the engine aborts the
        request), frees the admission slot and counts it `cancelled`. A stream is then watched by Starlette."""
        key_id = getattr(request.state, "api_key_id", None)  # set by the auth layer when API keys are on
        priority = getattr(request.state, "api_key_priority", ("normal", 1.0))  # the key's admission class and weight
        header = self.cfg.affinity.header
        session = session_id_of(request.headers.get(header), header)
        raw = await self._read_body(request)
        return await unless_client_leaves(request, self._respond(raw, kind, request.headers.get("x-request-id"), key_id, session, priority))

    async def _respond(self, raw: bytes, kind: str, request_id: str | None, key_id: str | None, session: str | None,
                       priority: tuple[str, float]) -> Response:
        d = await self.dispatch(raw, kind, request_id, key_id, session_id=session, priority=priority)
        headers = {"x-request-id": d.rreq.request_id, "x-kvyard-worker": d.endpoint.worker_id}
        if d.resp.status_code >= 400:  # the engine refused the request (client error): pass it on as is
            body_bytes = await self.release(d, str(d.resp.status_code))
            return Response(body_bytes, status_code=d.resp.status_code, media_type="application/json", headers=headers)
        if d.stream:
            return _RelayResponse(self, d, headers={**headers, "cache-control": "no-cache"})
        content = await self.unary_body(d)  # cancelling this aborts the engine request
        return Response(content, status_code=d.resp.status_code, media_type="application/json", headers=headers)

    async def abandon(self, d: Dispatched) -> None:
        """Close the books on a stream whose relay never started (its client left as the headers went out)."""
        if not d.relay_started:
            d.relay_started = True
            await d.resp.aclose()
            self._finish(d.rreq, d.t0, "cancelled", ticket=d.ticket)

    def _remaining(self, d: "Dispatched | _Standalone") -> float:
        return d.deadline - time.perf_counter()

    async def send_ranked(self, rreq: RouteRequest, ranked: list[Endpoint], path: str, payload: bytes, stream: bool,
                    d: Dispatched | None = None, sent: Callable[[], None] | None = None):
        """POST to the ranked engines in turn until one answers below 500; `sent()` is called as each attempt is
        handed to the engine client (the request already written when a kept-alive connection was at hand, else
        about to be, once its connection opens).

        Each failure (nothing received, a timeout, a 5xx) counts against that worker's breaker; the
        next attempt waits a jittered exponential backoff. Bounded by max_attempts and the deadline
        (`d` carries the request's deadline and the workers that already failed it).
        """
        if d is None:
            d = _Standalone(deadline=time.perf_counter() + self.cfg.resilience.request_timeout_s)
        last_error = "no engine answered"
        cfg = self.cfg.resilience
        read_timeout = cfg.stream_idle_timeout_s if stream else cfg.first_byte_timeout_s
        headers_timeout = cfg.stream_headers_timeout_s if stream else None
        headers = {"content-type": "application/json", "x-request-id": rreq.request_id}
        candidates = [ep for ep in ranked if ep.worker_id not in d.failed]
        for attempt, ep in enumerate(candidates[: cfg.max_attempts]):
            if attempt:
                delay = backoff_s(attempt, cfg.retry_backoff_base_s, cfg.retry_backoff_max_s, self.rng)
                if delay >= self._remaining(d):
                    break
                await asyncio.sleep(delay)
                self.metrics.retries.labels(rreq.model).inc()
                self.router.on_complete(rreq.request_id)
                self.router.book(rreq, ep)
            remaining = self._remaining(d)
            if remaining <= 0:
                break
            sent_headers, span = self.tracing.attempt(ep, attempt, headers)  # tracing hook
            post = self.client.start_post(  # written now when a kept-alive connection is at hand
                ep.url + path, payload, sent_headers, min(read_timeout, remaining),
                headers_timeout_s=min(headers_timeout, remaining) if headers_timeout else None, total_s=remaining)
            if sent is not None:
                sent()
            inflight = self.hung.book(ep.worker_id)
            inflight.add(post)  # cancelled if the engine is found hung meanwhile
            try:
                resp = await post
            except EngineUnreachableError as exc:
                last_error = f"{ep.worker_id}: {exc}"
                log.warning("engine %s failed before answering %s: %s", ep.worker_id, rreq.request_id, last_error)
                self._worker_failed(d, ep, last_error)
                continue
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # this request itself is being cancelled
                    raise
                last_error = f"{ep.worker_id}: stopped answering (its metric scrapes failed)"
                self._worker_failed(d, ep, last_error)
                continue
            finally:
                inflight.discard(post)
                self.tracing.end_attempt(span, post)  # tracing hook
            inflight.add(resp)
            if resp.status_code >= 500:
                last_error = f"{ep.worker_id}: HTTP {resp.status_code}"
                await resp.aclose()
                self._worker_failed(d, ep, last_error)
                continue
            return ep, resp
        if self._remaining(d) <= 0:
            self.metrics.deadline_exceeded.labels(rreq.model).inc()
            last_error = f"the request deadline of {cfg.request_timeout_s:g}s passed; last: {last_error}"
        raise ServiceUnavailableError(f"no engine could serve the request ({last_error})", retry_after=cfg.retry_after_s)

    def _worker_failed(self, d: "Dispatched | _Standalone", ep: Endpoint, why: str) -> None:
        d.failed.add(ep.worker_id)
        self.breakers.failure(ep.worker_id, why)

    # ---- streaming, with mid-stream migration ------------------------------------------------

    async def stream_events(self, d: Dispatched, direct: DirectBody | None = None):
        """Relay the engine's SSE events (bytes, each ending in a blank line) until [DONE].

        With `direct` (the HTTP frontend's connection, orchestrator/direct_body.py) each engine chunk is relayed
        inside the engine socket's read callback and written to the client there: the generator then yields only
        what the service itself adds (a migration's or an error's ending). Without it (gRPC, other servers) every
        piece is yielded.

        If the stream breaks (an error, the idle or total deadline, or an end without [DONE]):
        nothing relayed yet -> the request is re-sent elsewhere; tokens relayed -> it is continued
        on another worker (migration); neither possible -> one error event, then [DONE].
        """
        d.relay_started = True
        rreq, t0, model = d.rreq, d.t0, d.rreq.model
        itl = BatchedObserver(self.metrics.child(self.metrics.itl, model))  # per-token: counted here, added in batches
        gap_bounds = itl.bounds  # the relay counts the gaps itself (orchestrator/streaming.py)
        # with vLLM's return_token_ids the first chunk carries the prompt's ids: the chunk cache learns what it left
        # untokenized (prepare.py, `learner`)
        tracker = StreamTracker(on_prompt_ids=self.prep.learner(d.prompt)) if d.blocker is None else None
        rewriter: ChunkRewriter | None = None
        migrations = 0
        relayed = 0  # content events the client has received, all workers together
        first_at: float | None = None
        status = "ok"
        osl = 0
        final_usage: dict | None = None

        def first_token() -> None:
            nonlocal first_at
            self.router.on_first_token(rreq.request_id)  # this worker's booking moves from prefill to decode
            if first_at is None:
                first_at = time.perf_counter()
                self.metrics.child(self.metrics.ttft, model).observe(first_at - t0)

        try:
            while True:
                stats = StreamStats()
                broke: str | None = None
                ep = d.endpoint
                relay = Relay(stats, d.include_usage and rewriter is None, first_token, itl.observe,
                              on_content=tracker.feed if tracker is not None else None, transform=rewriter,
                              forward_done=rewriter is None, strip_ids=d.strip_ids, gap_bounds=gap_bounds,
                              on_gaps=itl.add if gap_bounds is not None else None)
                try:
                    if direct is not None:
                        await _relay_direct(d.resp, relay, direct)
                    else:
                        async for chunk in d.resp.aiter_raw():
                            out = relay.feed(chunk)
                            if out:
                                yield out
                    if not stats.done:
                        broke = "the stream ended without [DONE]"
                except EngineStreamError as exc:
                    broke = str(exc) or type(exc).__name__
                finally:
                    relay.flush()
                    relayed += stats.content_events
                    await d.resp.aclose()
                if broke is None:
                    self.breakers.success(ep.worker_id)
                    usage = stats.usage or {}
                    if rewriter is None:
                        osl = int(usage.get("completion_tokens", stats.content_events))
                        final_usage = stats.usage
                    else:  # a continuation finished: the one usage chunk, with the totals
                        osl = rewriter.before + int(usage.get("completion_tokens", stats.content_events))
                        prompt_tokens = rewriter.prompt_tokens
                        final_usage = {"prompt_tokens": prompt_tokens, "completion_tokens": osl}
                        tail = (usage_event(d.kind, tracker, prompt_tokens, osl) + b"\n\n") if d.include_usage else b""
                        yield tail + _DONE_EVENT
                    break
                self._worker_failed(d, ep, broke)
                log.warning("stream %s from %s broke after %d events: %s", rreq.request_id, ep.worker_id, relayed, broke)
                try:
                    if relayed == 0:
                        await self._resend(d)
                        continue
                    # the original stream's usage chunk already reached the client: the answer was complete
                    usage_sent = rewriter is None and stats.usage is not None and d.include_usage
                    with self.tracing.span("kvyard.migration", **{"kvyard.from_worker": ep.worker_id, "kvyard.migration": migrations + 1}):  # tracing hook
                        tail, rewriter = await self._migrate(d, tracker, migrations, rewriter, usage_sent)
                except _Ended as end:
                    status = "engine_error"
                    yield sse_error_event(str(end))
                    break
                if tail is not None:  # the answer was already complete: only its ending was lost
                    osl = rewriter_before(tracker, self._encoder(model))
                    yield tail
                    break
                migrations += 1
        except BaseException:  # client went away (CancelledError / GeneratorExit): abort upstream
            status = "cancelled"
            raise
        finally:
            itl.flush()
            if d.resp is not None:
                await d.resp.aclose()
            if final_usage:
                self.metrics.child(self.metrics.osl, model).observe(osl)
                _settle_prompt_tokens(rreq, final_usage)
            ttft = first_at - t0 if first_at is not None else None
            self._finish(rreq, t0, status, ttft_s=ttft, osl=osl, ticket=d.ticket)

    def _encoder(self, model: str):
        tok = self.prep.tokenizer(model)
        return (lambda text: tok.encode(text, add_special_tokens=False)) if tok is not None else None

    async def _resend(self, d: Dispatched) -> None:
        """Nothing reached the client yet: send the original request to another worker."""
        endpoints = self._adapter_holders(d.rreq, [e for e in self.routable(d.rreq.model) if e.worker_id not in d.failed])
        if not endpoints:
            raise _Ended("the engine stream failed and no other worker is available")
        self.router.on_complete(d.rreq.request_id)
        try:
            decision = self.router.route(d.rreq, endpoints)
            d.endpoint, d.resp = await self.send_ranked(d.rreq, decision.ranked, d.path, d.payload, True, d)
        except (NoEndpointsError, ServiceUnavailableError) as exc:
            raise _Ended(f"the engine stream failed and no other worker could take it: {exc}") from exc
        self.metrics.retries.labels(d.rreq.model).inc()
        if d.resp.status_code >= 400:
            body = await d.resp.aread()
            await d.resp.aclose()
            raise _Ended(f"the engine stream failed and the retry was refused: HTTP {d.resp.status_code} {body[:200]!r}")

    async def _migrate(self, d: Dispatched, tracker: StreamTracker | None, migrations: int, rewriter: ChunkRewriter | None,
                       usage_sent: bool = False):
        """Continue a broken stream on another worker. Returns (tail, rewriter): `tail` (bytes) when the
        answer turned out complete (only its end is sent), else the new rewriter with d.resp/d.endpoint
        set to the continuation. Raises _Ended with the client-facing message when it cannot."""
        model = d.rreq.model
        outcome = self.metrics.migrations

        def end(kind: str, message: str) -> _Ended:
            outcome.labels(model, kind).inc()
            return _Ended(message)

        if tracker is None:
            raise end("refused", f"the engine stream failed mid-way; this request cannot be continued elsewhere ({d.blocker})")
        if tracker.blocked:
            raise end("refused", f"the engine stream failed mid-way; this request cannot be continued elsewhere ({tracker.blocked})")
        prompt_ids = await self.prep.complete(d.prompt)  # tokenized lazily: the continuation needs every id
        encode = self._encoder(model)
        gen_ids, _exact = tracker.generated_ids(encode)
        n_gen = len(gen_ids) if gen_ids is not None else tracker.events
        prompt_tokens = len(prompt_ids)
        if tracker.finish_reason is not None or (d.max_tokens is not None and n_gen >= d.max_tokens):
            # everything was generated; only the final chunk, the usage or [DONE] was lost
            tail = b""
            if tracker.finish_reason is None:
                tail += _finish_chunk(d.kind, tracker) + b"\n\n"
            if d.include_usage and not usage_sent:
                tail += usage_event(d.kind, tracker, prompt_tokens, n_gen) + b"\n\n"
            outcome.labels(model, "finished").inc()
            return tail + _DONE_EVENT, rewriter
        if migrations >= self.cfg.resilience.max_migrations:
            raise end("exhausted", f"the engine stream failed {migrations + 1} times; giving up (max_migrations={self.cfg.resilience.max_migrations})")
        if self._remaining(d) <= 0:
            self.metrics.deadline_exceeded.labels(model).inc()
            raise end("exhausted", f"the request deadline of {self.cfg.resilience.request_timeout_s:g}s passed")
        endpoints = self._adapter_holders(d.rreq, [e for e in self.routable(model) if e.worker_id not in d.failed])
        if not endpoints:
            raise end("exhausted", "the engine stream failed mid-way and no other worker is available to continue it")
        body = continuation_body(d.kind, d.body, prompt_ids, gen_ids, tracker.text, n_gen, d.max_tokens, d.strip_ids)
        payload = dump_json(body)
        rreq = RouteRequest(request_id=d.rreq.request_id, model=model,
                            token_ids=body["prompt"] if isinstance(body["prompt"], list) else [],
                            max_tokens=body.get("max_tokens") or 0, lora_name=d.rreq.lora_name, session_id=d.rreq.session_id)
        self.router.on_complete(d.rreq.request_id)
        try:
            decision = self.router.route(rreq, endpoints)
            ep, resp = await self.send_ranked(rreq, decision.ranked, CONTINUATION_PATH, payload, True, d)
        except (NoEndpointsError, ServiceUnavailableError) as exc:
            raise end("failed", f"the engine stream failed mid-way and could not be continued: {exc}") from exc
        if resp.status_code >= 400:
            text = await resp.aread()
            await resp.aclose()
            raise end("failed", f"the engine stream failed mid-way and the continuation was refused: HTTP {resp.status_code} {text[:200]!r}")
        d.endpoint, d.resp = ep, resp
        outcome.labels(model, "migrated").inc()
        log.info("stream %s continues on %s after %d tokens (migration %d)", d.rreq.request_id, ep.worker_id, n_gen, migrations + 1)
        if not prompt_tokens:  # no tokenizer: the prompt's size is what the first engine saw; unknown here
            prompt_tokens = max(0, rreq.isl - n_gen) if rreq.token_ids else 0
        return None, ChunkRewriter(d.kind, tracker, prompt_tokens, n_gen, keep_token_ids=bool(d.body.get("return_token_ids")))

    # ---- unary -------------------------------------------------------------------------------

    async def unary_body(self, d: Dispatched) -> bytes:
        """Read a non-streaming engine response; cancelling this aborts the engine request.

        Nothing reaches the client before the whole body is read, so an engine that fails mid-body
        is simply replaced: the request is re-sent to another worker (within max_attempts)."""
        rreq, t0 = d.rreq, d.t0
        status = "ok"
        try:
            for _ in range(self.cfg.resilience.max_attempts):
                try:
                    content = await d.resp.aread()
                    break
                except EngineStreamError as exc:
                    await d.resp.aclose()
                    self._worker_failed(d, d.endpoint, str(exc))
                    log.warning("engine %s failed mid-response for %s: %s", d.endpoint.worker_id, rreq.request_id, exc)
                    endpoints = self._adapter_holders(rreq, [e for e in self.routable(rreq.model) if e.worker_id not in d.failed])
                    if not endpoints or self._remaining(d) <= 0:
                        raise ServiceUnavailableError(f"the engine failed mid-response: {type(exc).__name__}",
                                                      retry_after=self.cfg.resilience.retry_after_s) from exc
                    self.router.on_complete(rreq.request_id)
                    try:
                        decision = self.router.route(rreq, endpoints)
                    except NoEndpointsError as exc2:
                        raise ServiceUnavailableError("no worker is left to serve the request", retry_after=self.cfg.resilience.retry_after_s) from exc2
                    d.endpoint, d.resp = await self.send_ranked(rreq, decision.ranked, d.path, d.payload, False, d)
                    self.metrics.retries.labels(rreq.model).inc()
            else:
                raise ServiceUnavailableError("the engines failed mid-response", retry_after=self.cfg.resilience.retry_after_s)
        except BaseException as exc:
            status = "engine_error" if isinstance(exc, KvyardError) else "cancelled"
            raise
        finally:
            await d.resp.aclose()
            if status != "ok":
                self._finish(rreq, t0, status, ticket=d.ticket)
        self.breakers.success(d.endpoint.worker_id)
        self.router.on_first_token(rreq.request_id)
        osl = 0
        try:
            usage = json.loads(content).get("usage") or {}
            osl = int(usage.get("completion_tokens", 0))
            self.metrics.child(self.metrics.osl, rreq.model).observe(osl)
            _settle_prompt_tokens(rreq, usage)
        except (ValueError, AttributeError, TypeError):
            pass
        self._finish(rreq, t0, "ok", osl=osl, ticket=d.ticket)
        return content

    def _finish(self, rreq: RouteRequest, t0: float, status: str, ttft_s: float | None = None, osl: int = 0,
                ticket: Ticket | None = None) -> None:
        """Close the books on a request, on every path: router load, admission slot, metrics, telemetry."""
        duration = time.perf_counter() - t0
        access_log.note(output_tokens=osl, ttft_at=t0 + ttft_s if ttft_s is not None else None)  # access-log hook
        if rreq.prompt_tokens >= 0:  # a lazily tokenized prompt: the engine's count, once its usage said it
            access_log.note(prompt_tokens=rreq.prompt_tokens)
        self.router.on_complete(rreq.request_id)
        if rreq.lora_name and self.lora is not None:
            self.lora.end(rreq.request_id)
        if ticket is not None:
            ticket.release()
        self.metrics.child(self.metrics.inflight, rreq.model).dec()
        self.metrics.child(self.metrics.duration, rreq.model).observe(duration)
        self.metrics.child(self.metrics.isl, rreq.model).observe(rreq.isl)
        self.metrics.child(self.metrics.requests, rreq.model, "generate", status).inc()
        if self.telemetry is not None:
            self.telemetry.on_finish(rreq.model, ttft_s=ttft_s, duration_s=duration, isl=rreq.isl, osl=osl, ok=status == "ok")


def _settle_prompt_tokens(rreq: RouteRequest, usage) -> None:
    """A lazily tokenized prompt's count was an estimate: the engine's usage says what it was."""
    if rreq.prompt_tokens >= 0 and isinstance(usage, dict):
        n = usage.get("prompt_tokens")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            rreq.prompt_tokens = n


async def _relay_direct(resp: EngineResponse, relay: Relay, direct: DirectBody) -> None:
    """One engine stream relayed from its socket's read callback straight to the client's connection; the
    client's back-pressure pauses the engine read. With the C relay, writer and tracker buffer, a token runs no
    Python frame from the engine client's body callback to the client's socket."""
    direct.on_pause, direct.on_resume = resp.pause_reading, resp.resume_reading
    if direct.write_paused:
        resp.pause_reading()
    try:
        await resp.stream_into(functools.partial(relay.pipe, direct.writer()))
    finally:
        direct.on_pause = direct.on_resume = None


class _RelayResponse(Response):
    """The SSE relay of a dispatched stream. On kvyard's HTTP server the engine's chunks go straight to the client's
    connection (orchestrator/direct_body.py); elsewhere through ASGI's send. The client's connection is watched:
    if it leaves, the relay is cancelled (which drops the engine connection, so the engine aborts the request). If
    the client leaves before the relay starts, the engine response is dropped and the books closed all the same."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, service: InferenceService, d: Dispatched, headers: dict) -> None:  # no body: no content-length
        self.status_code, self.background = 200, None
        self.init_headers(headers)
        self._service, self._d = service, d

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            direct = scope.get("extensions", {}).get(DIRECT_BODY)
            if direct is not None and direct.usable():  # relayed in this task; the connection's loss cancels it
                left, _ = await watched(direct, self._relay(send, direct))
                if not left:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            relay = asyncio.ensure_future(self._relay(send, None))
            gone = asyncio.ensure_future(disconnected(receive))  # not kvyard's server: a task watches receive()
            try:
                await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not relay.done():  # the client left (or this task is cancelled): stop the relay, wait for its books
                    relay.cancel()
                    await asyncio.gather(relay, return_exceptions=True)
            if relay.cancelled():
                return
            relay.result()  # the relay's own error, if any, as before (Starlette then logs it)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._service.abandon(self._d)

    async def _relay(self, send, direct: DirectBody | None) -> None:
        events = self._service.stream_events(self._d, direct)
        try:
            async for piece in events:
                if direct is not None:
                    direct.write(piece)
                else:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
        finally:
            await events.aclose()


def rewriter_before(tracker: StreamTracker | None, encode) -> int:
    if tracker is None:
        return 0
    ids, _ = tracker.generated_ids(encode)
    return len(ids) if ids is not None else tracker.events


def _finish_chunk(kind: str, tracker: StreamTracker) -> bytes:
    """A last chunk with finish_reason "length" for an answer whose final chunk was lost."""
    if kind == "chat":
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    out = {"id": tracker.id, "object": obj, "created": tracker.created, "model": tracker.model, "choices": [choice]}
    return b"data: " + json.dumps(out, separators=(",", ":")).encode()
