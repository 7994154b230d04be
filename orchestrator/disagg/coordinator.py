"""The frontend side of disaggregated prefill/decode: route both phases, run the engine's hand-off.

InferenceService.dispatch calls in at one place: when a model has prefill or decode workers,
`route_decode` replaces the aggregated routing and `send` replaces the aggregated send. The
response `send` returns is the one the client gets (decode's, or a finished prefill's), relayed
by the service as usual, so streaming, unary, HTTP and gRPC all work unchanged.

    decode  = decode_router.route(prompt, decode workers)   kv cost with prefill weight 0 (Dynamo):
              load and decode-side prefix overlap only; booked in the service's load book
    prefill = prefill_router.route(prompt, prefill workers)  KV-aware on the prompt; own load book,
              closed as soon as the hand-off is back (or the prefill failed or was not needed)
    where   = decide(prompt, decode overlap, prefill worker's active tokens)   (decision.py); always
              remote for SGLang, whose decode-mode engines cannot prefill (reason decode_cannot_prefill)
    local   -> the decode worker serves the whole request (aggregated)
    remote  -> the flavor's hand-off:
        vllm    prefill (max_tokens=1, kv_transfer_params do_remote_decode) -> its kv_transfer_params
                go verbatim into the decode request
        sglang  one body with bootstrap_host/port/room to prefill and decode at the same time; the
                decode response is returned once prefill succeeded; a failed prefill cancels decode
        trtllm  context_only -> generation_only with its disaggregated_params and prompt token ids;
                a context answer that already finished is the answer
    failure -> a failed, slow (prefill_timeout_s) or lost prefill falls back to aggregated serving on
               the decode pool (SGLang: on `both` workers only, as a decode-mode SGLang engine cannot
               prefill alone), or is a clean 503 when enforce is set
    decode  -> a decode engine that answers 5xx to the hand-off (after the service's own failover over
    failure    the ranked decode workers; vLLM fails a request whose KV load failed, e.g. when NIXL's
               first handshake misses its 5 s timeout) gets the whole hand-off again with a fresh
               prefill (`handoff_retries`, default 1; a retry never reuses blocks that may be freed),
               then the same fallback or 503 (reason decode_error)

Blocks held by an abandoned hand-off: a prefill cancelled or timed out here is dropped on its
connection, so the prefill engine aborts it and frees its blocks. vLLM: a decode request cancelled
by the client is dropped on its connection too, and the decode engine notifies the prefill engine,
which frees the blocks; when no decode request was ever sent (fallback after a malformed answer,
enforce 503), the prefill engine frees them at `remote_blocks_expiry_time`. SGLang: a cancelled
decode leaves the room unclaimed and the prefill engine times the transfer out. TRT-LLM: the
context's blocks are freed by its cache transceiver timeout when no generation request follows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

from orchestrator.config import DisaggConfig
from orchestrator.disagg.decision import DisaggDecision, decide
from orchestrator.engine_client import EngineClient, EngineResponse, EngineStreamError, EngineUnreachableError
from orchestrator.errors import ServiceUnavailableError
from orchestrator.json_input import dump_json
from orchestrator.metrics import FrontendMetrics
from orchestrator.tracing import Tracing
from orchestrator.routing import build_phase_routers
from router import Endpoint, NoEndpointsError, RouteRequest, Router, RoutingDecision
from router.config import KvPolicyConfig
from workers.sglang import handoff as sglang_handoff
from workers.trtllm import handoff as trtllm_handoff
from workers.vllm import handoff as vllm_handoff

if TYPE_CHECKING:
    from orchestrator.pool import WorkerPool

__all__ = ["DisaggCoordinator", "PrefillFailed", "DecodeFailed", "BufferedResponse", "PROTOCOLS", "protocol_of"]

log = logging.getLogger("kvyard.disagg")

PROTOCOLS = ("vllm", "sglang", "trtllm")


def protocol_of(info) -> str:
    """The P/D hand-off protocol of a registered worker: its pd_protocol, else its backend's own."""
    proto = info.pd_protocol or info.backend
    return proto if proto in PROTOCOLS else "vllm"  # the sim speaks vLLM unless told otherwise


class PrefillFailed(Exception):
    """The remote prefill did not produce a usable hand-off; `reason` labels the fallback."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DecodeFailed(Exception):
    """The prefill's hand-off was sent on, and no decode engine served it (5xx or unreachable)."""


class BufferedResponse:
    """An answer already read in full (a finished TRT-LLM context, a prefill engine's 4xx), shaped
    like EngineResponse so the service relays it as any other: JSON, or SSE when `sse` is set."""

    def __init__(self, content: bytes, status_code: int, sse: bytes | None = None) -> None:
        self.status_code = status_code
        self._content = content
        self._sse = sse

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        yield self._sse if self._sse is not None else self._content

    async def aread(self) -> bytes:
        return self._content

    async def aclose(self) -> None:
        return None


def completion_to_sse(resp: dict, chat: bool) -> bytes:
    """A non-streaming completion as the SSE events a streaming client expects (content, usage, [DONE])."""
    rid, created, model = resp.get("id", ""), resp.get("created", int(time.time())), resp.get("model", "")
    obj = "chat.completion.chunk" if chat else "text_completion"
    choices = []
    for c in resp.get("choices") or []:
        base = {"index": c.get("index", 0), "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        if chat:
            msg = c.get("message") or {}
            base["delta"] = {"role": msg.get("role", "assistant"), "content": msg.get("content") or ""}
        else:
            base["text"] = c.get("text") or ""
        choices.append(base)
    events = [{"id": rid, "object": obj, "created": created, "model": model, "choices": choices}]
    if resp.get("usage"):
        events.append({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": resp["usage"]})
    out = b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"


@dataclass(slots=True)
class _Call:
    """One disaggregated request on its way through `send`."""

    rreq: RouteRequest
    body: dict
    path: str
    stream: bool
    chat: bool
    decode: RoutingDecision
    proto: str


class EngineSender(Protocol):
    """How the coordinator sends a request to engines: the service's own failover send, which it implements."""

    retry_after_s: float

    def allows(self, worker_id: str) -> bool:
        """Called before routing a prefill: False while the worker's circuit breaker is open."""
        ...

    def report_failure(self, worker_id: str, reason: str) -> None:
        """Called when a prefill worker failed a hand-off: counts against its circuit breaker."""
        ...

    async def send_ranked(self, rreq: RouteRequest, ranked: list[Endpoint], path: str, payload: bytes,
                          stream: bool) -> tuple[Endpoint, EngineResponse]:
        """POST to the ranked engines in turn until one answers below 500 (retries, breakers, deadline);
        raises ServiceUnavailableError when none does."""
        ...


class DisaggCoordinator:
    def __init__(self, cfg: DisaggConfig, pool: "WorkerPool", router: Router, metrics: FrontendMetrics, client: EngineClient,
                 sender: EngineSender, kv: KvPolicyConfig) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.client = client
        self.sender = sender
        self.router = router
        # Both share the service router's prefix index (fed by the KV-event ingestor); decode also shares
        # its load book, which the service closes (first token, completion) on every path (orchestrator/routing.py).
        self.decode_router, self.prefill_router = build_phase_routers(cfg, router, kv)
        pool.on_worker_left.append(self.prefill_router.loads.remove_worker)

    # ---- the two calls the service makes ---------------------------------------------------------

    def applies(self, model: str) -> bool:
        """True when the model is served disaggregated: it has ready prefill or decode workers."""
        return any(w.info.role.value != "both" for w in self.pool.ready(model))

    def route_decode(self, rreq: RouteRequest, endpoints: list[Endpoint]) -> RoutingDecision:
        """Rank the decode candidates (decode workers; `both` ones when there are none) and book the best."""
        decode = [e for e in endpoints if e.role == "decode"] or [e for e in endpoints if e.role == "both"]
        if not decode and self.cfg.enforce:
            raise NoEndpointsError(f"no decode worker serves model {rreq.model!r}")
        return self.decode_router.route(rreq, decode)

    async def send(self, rreq: RouteRequest, body: dict, payload: bytes, decision: RoutingDecision,
                   path: str, stream: bool) -> tuple[Endpoint, EngineResponse | BufferedResponse]:
        """Serve one request whose decode worker is booked (`decision.ranked[0]`); returns the worker and
        response the client gets. Raises ServiceUnavailableError when nothing could serve it."""
        d_ep = decision.ranked[0]
        live = self.pool.workers.get(d_ep.worker_id)
        proto = protocol_of(live.info) if live else "vllm"
        call = _Call(rreq, body, path, stream, path.endswith("/chat/completions"), decision, proto)
        prefill_eps = [e for e in self.pool.endpoints(rreq.model, roles=("prefill",))  # skip prefill workers failing now
                       if self._proto(e) == proto and self.sender.allows(e.worker_id)]
        if not prefill_eps:
            return await self._aggregated(call, payload, "fallback", "no_prefill_worker")
        active = {e.worker_id: (ld.prefill_tokens if (ld := self.prefill_router.loads.peek(e.worker_id)) else 0) for e in prefill_eps}
        p_decision = self.prefill_router.route(rreq, prefill_eps)
        p_ep = p_decision.ranked[0]
        cached = decision.overlap_of(d_ep) * d_ep.block_size if d_ep.block_size == rreq.hashed_block_size else 0
        verdict = decide(self.cfg, rreq.isl, cached, active[p_ep.worker_id])
        if not verdict.remote and proto == "sglang":  # a decode-mode SGLang engine only decodes: no local prefill
            verdict = DisaggDecision(True, "decode_cannot_prefill", verdict.eff_isl)
        self._log(rreq, verdict, d_ep, p_ep)
        if not verdict.remote:
            self.prefill_router.on_complete(rreq.request_id)
            self.metrics.disagg_decisions.labels("local", verdict.reason).inc()
            return await self.sender.send_ranked(rreq, decision.ranked, path, payload, stream)
        self.metrics.disagg_decisions.labels("remote", verdict.reason).inc()
        flow = {"vllm": self._vllm, "sglang": self._sglang, "trtllm": self._trtllm}[proto]
        attempt = 0
        while True:
            try:
                return await flow(call, p_ep)
            except PrefillFailed as exc:
                failed: Exception = exc
                reason = exc.reason
                if exc.reason != "prefill_bad_response":
                    self.sender.report_failure(p_ep.worker_id, str(exc))
                break
            except DecodeFailed as exc:
                failed, reason = exc, "decode_error"
                if attempt >= self.cfg.handoff_retries:
                    break
                attempt += 1
                self.metrics.disagg_decisions.labels("retry", "decode_error").inc()
                log.warning("decode of %s's hand-off failed (%s); hand-off retry %d of %d with a fresh prefill", rreq.request_id,
                            exc, attempt, self.cfg.handoff_retries)
            finally:
                self.prefill_router.on_complete(rreq.request_id)  # every path: the prefill worker's book is closed
            prefill_eps = [e for e in prefill_eps if self.sender.allows(e.worker_id)] or prefill_eps
            p_ep = self.prefill_router.route(rreq, prefill_eps).ranked[0]
            self.router.on_complete(rreq.request_id)  # the decode booking back on the first-ranked worker (its
            self.router.book(rreq, decision.ranked[0])  # failover may have moved it)
        log.warning("%s of %s (prefill on %s) failed (%s); %s", "prefill" if reason != "decode_error" else "hand-off",
                    rreq.request_id, p_ep.worker_id, failed, "enforce-disagg: 503" if self.cfg.enforce else "serving it aggregated")
        return await self._aggregated(call, payload, "fallback", reason)

    # ---- helpers ---------------------------------------------------------------------------------

    def _proto(self, ep: Endpoint) -> str:
        live = self.pool.workers.get(ep.worker_id)
        return protocol_of(live.info) if live else "vllm"

    def _log(self, rreq: RouteRequest, v: DisaggDecision, d_ep: Endpoint, p_ep: Endpoint) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("disagg %s: %s (%s) prompt=%d uncached_on_decode=%d decode=%s prefill=%s", rreq.request_id,
                      "remote prefill" if v.remote else "local prefill", v.reason, rreq.isl, v.eff_isl, d_ep.worker_id, p_ep.worker_id)

    async def _aggregated(self, call: _Call, payload: bytes, mode: str, reason: str):
        """Serve the request whole on the decode side, or 503 under enforce."""
        if self.cfg.enforce:
            self.metrics.disagg_decisions.labels("rejected", reason).inc()
            raise ServiceUnavailableError(f"the disaggregated hand-off failed ({reason}) and disaggregation is enforced",
                                          retry_after=self.sender.retry_after_s)
        self.metrics.disagg_decisions.labels(mode, reason).inc()
        ranked = call.decode.ranked
        if call.proto == "sglang":  # a decode-mode SGLang engine cannot prefill: only `both` workers serve whole requests
            both = [e for e in self.pool.endpoints(call.rreq.model, roles=("both",)) if self._proto(e) == "sglang"]
            if not both:
                raise ServiceUnavailableError(f"the hand-off failed ({reason}) and no SGLang worker serves whole requests",
                                              retry_after=self.sender.retry_after_s)
            ranked = self.decode_router.route(call.rreq, both).ranked  # re-books the request on the new worker
        return await self.sender.send_ranked(call.rreq, ranked, call.path, payload, call.stream)

    async def _post_prefill(self, ep: Endpoint, path: str, body: dict, request_id: str) -> tuple[int, bytes]:
        """POST to a prefill engine and read the whole answer within prefill_timeout_s."""
        headers = {"content-type": "application/json", "x-request-id": request_id}
        timeout = self.cfg.prefill_timeout_s
        tracing = getattr(self.sender, "tracing", None) or Tracing.off()  # the prefill's own engine-attempt span
        headers, span = tracing.attempt(ep, 0, headers)

        async def call() -> tuple[int, bytes]:
            try:
                resp = await self.client.post(ep.url + path, dump_json(body), headers, timeout)
            except BaseException as exc:
                tracing.end_attempt(span, error=f"{type(exc).__name__}: {exc}")
                raise
            tracing.end_attempt(span, status=resp.status_code)
            try:
                return resp.status_code, await resp.aread()
            finally:
                await resp.aclose()  # unread (cancelled, timed out): the connection drops, the engine aborts

        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):  # in this task: no task of wait_for's own, fewer loop turns
                status, content = await call()
        except TimeoutError as exc:  # the deadline's, or a read timeout's
            raise PrefillFailed("prefill_timeout", f"no answer from {ep.worker_id} within {timeout:g}s") from exc
        except EngineUnreachableError as exc:
            raise PrefillFailed("prefill_unreachable", f"{ep.worker_id}: {exc}") from exc
        except EngineStreamError as exc:
            reason = "prefill_timeout" if "Timeout" in str(exc) else "prefill_error"
            raise PrefillFailed(reason, f"{ep.worker_id}: {exc}") from exc
        self.metrics.disagg_prefill.labels(ep.model).observe(time.perf_counter() - t0)
        return status, content

    async def _decode(self, call: _Call, ranked: list[Endpoint], payload: bytes):
        """The decode leg of a hand-off: the service's send (failover over `ranked`); DecodeFailed when none served it."""
        try:
            return await self.sender.send_ranked(call.rreq, ranked, call.path, payload, call.stream)
        except ServiceUnavailableError as exc:
            raise DecodeFailed(str(exc)) from exc

    @staticmethod
    def _json(status: int, content: bytes, ep: Endpoint) -> dict:
        if status >= 500:
            raise PrefillFailed("prefill_error", f"{ep.worker_id}: HTTP {status}")
        try:
            data = json.loads(content)
        except ValueError as exc:
            raise PrefillFailed("prefill_bad_response", f"{ep.worker_id}: the answer is not JSON") from exc
        if not isinstance(data, dict):
            raise PrefillFailed("prefill_bad_response", f"{ep.worker_id}: the answer is not a JSON object")
        return data

    # ---- the three hand-offs -----------------------------------------------------------------------

    async def _vllm(self, call: _Call, p_ep: Endpoint):
        status, content = await self._post_prefill(p_ep, call.path, vllm_handoff.prefill_body(call.body, call.chat), call.rreq.request_id)
        if 400 <= status < 500:  # the engine refused the request itself: the client's error, passed on as is
            return p_ep, BufferedResponse(content, status)
        try:
            live = self.pool.workers.get(p_ep.worker_id)
            connector = live.info.labels.get("kv_connector") if live else None
            params = vllm_handoff.kv_transfer_params_of(self._json(status, content, p_ep),
                                                        prefix_addressed=connector in vllm_handoff.PREFIX_ADDRESSED_CONNECTORS)
        except ValueError as exc:
            raise PrefillFailed("prefill_bad_response", f"{p_ep.worker_id}: {exc}") from exc
        self.prefill_router.on_complete(call.rreq.request_id)  # hand-off received: the prefill is done
        payload = dump_json(vllm_handoff.decode_body(call.body, params))
        return await self._decode(call, call.decode.ranked, payload)

    async def _trtllm(self, call: _Call, p_ep: Endpoint):
        ctx_body = trtllm_handoff.context_body(call.body, trtllm_handoff.new_disagg_request_id())
        status, content = await self._post_prefill(p_ep, call.path, ctx_body, call.rreq.request_id)
        if 400 <= status < 500:
            return p_ep, BufferedResponse(content, status)
        ctx = self._json(status, content, p_ep)
        try:
            if trtllm_handoff.context_finished(ctx):  # already complete: that is the answer
                return p_ep, BufferedResponse(content, status, completion_to_sse(ctx, call.chat) if call.stream else None)
            gen_body = trtllm_handoff.generation_body(call.body, ctx, call.chat)
        except ValueError as exc:
            raise PrefillFailed("prefill_bad_response", f"{p_ep.worker_id}: {exc}") from exc
        self.prefill_router.on_complete(call.rreq.request_id)  # hand-off received: the prefill is done
        return await self._decode(call, call.decode.ranked, dump_json(gen_body))

    async def _sglang(self, call: _Call, p_ep: Endpoint):
        live = self.pool.workers.get(p_ep.worker_id)
        port = (live.info.bootstrap_port if live else None) or sglang_handoff.DEFAULT_BOOTSTRAP_PORT
        body = sglang_handoff.bootstrap_body(call.body, urlparse(p_ep.url).hostname or "127.0.0.1", port, sglang_handoff.new_room())
        payload = dump_json(body)
        prefill = asyncio.ensure_future(self._post_prefill(p_ep, call.path, body, call.rreq.request_id))
        # decode is paired with this prefill by the room: no failover to another decode worker
        decode = asyncio.ensure_future(self._decode(call, call.decode.ranked[:1], payload))
        try:
            status, content = await prefill  # both in flight; the decode engine waits on the room
            if 400 <= status < 500:  # the engine refused the request itself: the client's error, passed on as is
                await _cancel(decode)
                return p_ep, BufferedResponse(content, status)
            if status >= 500:  # its body is JSON or SSE (the same body, `stream` included, went to both): not parsed
                raise PrefillFailed("prefill_error", f"{p_ep.worker_id}: HTTP {status}")
            self.prefill_router.on_complete(call.rreq.request_id)  # hand-off received: the prefill is done
            return await decode
        except BaseException:  # prefill failed, or the caller was cancelled: cancel decode, close its response
            await _cancel(decode)
            if not prefill.done():  # dropping its connection aborts the prefill engine's request
                prefill.cancel()
                await asyncio.gather(prefill, return_exceptions=True)
            raise


async def _cancel(task: asyncio.Future) -> None:
    """Cancel a decode send still in flight, or close the response it already opened (the engine aborts)."""
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    resp = result[1] if isinstance(result, tuple) else None
    if resp is not None:
        await resp.aclose()
