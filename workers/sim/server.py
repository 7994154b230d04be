"""The sim's HTTP server: vLLM 0.32's OpenAI-compatible routes on Starlette.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (+ GET /v1/responses/{id}, POST .../cancel),
/tokenize, /detokenize; GET /v1/models, /health, /ping, /metrics, /load, /version, /kv_event_sources; with
`--runner pooling`, POST /v1/embeddings (workers/sim/responses_api.py); with runtime LoRA updating, the adapter
routes of workers/sim/adapters.py. Generation handlers are in `workers.sim.generate`.
`build_app(cfg)` wires tokenizer -> engine (scheduler, KV manager, timing, metrics, publisher); the
engine loop and the ZMQ sockets start in the app's lifespan.

`--flavor sglang|trtllm` swaps in that engine's observability (workers/sim/flavors.py: sglang:* metrics
and SGLang-format KV events; TRT-LLM's JSON /metrics, /prometheus/metrics, POST /kv_cache_events) and
P/D hand-off (workers/sim/disagg.py, with vLLM's NixlConnector one under the default flavor).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.sim.adapters import SimLoras, load_lora_adapter, unload_lora_adapter
from workers.sim.config import SimConfig
from workers.sim.disagg import DisaggRuntime, KvTransferModel, default_kv_bytes_per_token
from workers.sim.engine import SimEngine
from workers.sim.flavors import SglangMetrics, TrtllmEventBuffer, TrtllmIterationStats, TrtllmPrometheus, split_per_page
from workers.sim.hashing import BlockHasher
from workers.sim.kv_manager import KvBlockManager
from workers.sim.metrics import CONTENT_TYPE, SimMetrics
from workers.sim.profiles import load_profile
from workers.sim.protocol import ApiError, bad_request, parse_body
from workers.sim.scheduler import Scheduler
from workers.sim.text import SimTokenizer, TextSource
from workers.sim.timing import TimingModel

__all__ = ["SimState", "VLLM_VERSION", "build_app", "build_state"]

VLLM_VERSION = "0.32.0"


@dataclass
class SimState:
    cfg: SimConfig
    tokenizer: SimTokenizer
    text: TextSource
    engine: SimEngine
    metrics: SimMetrics
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    server_load: int = 0
    publisher: object | None = None
    disagg: DisaggRuntime | None = None
    sglang_metrics: SglangMetrics | None = None
    trtllm_events: TrtllmEventBuffer | None = None
    trtllm_prometheus: TrtllmPrometheus | None = None
    loras: SimLoras = field(default_factory=lambda: SimLoras(False))

    def check_model(self, model: str | None) -> tuple[str, str] | None:
        """404 unless `model` is a served name or a loaded LoRA adapter; returns the adapter's (name, path).
        trtllm-serve answers whatever model a request names (it serves one); vLLM and SGLang check it."""
        if model is not None and model not in self.cfg.served_model_names and self.cfg.flavor != "trtllm":
            lora = self.loras.get(model)
            if lora is not None:
                return lora
            aliases = ", ".join(self.cfg.served_model_names)
            raise ApiError(f"The model `{model}` does not exist. Valid aliases: {aliases}.", "NotFoundError", 404, "model")
        return None


def build_state(cfg: SimConfig, tokenizer: SimTokenizer | None = None) -> SimState:
    profile = load_profile(cfg.profile)
    num_blocks = cfg.num_gpu_blocks or profile.max_kv_tokens // cfg.block_size
    if (num_blocks - 1) * cfg.block_size < cfg.max_model_len:
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {cfg.block_size} tokens cannot hold one max_model_len="
            f"{cfg.max_model_len} sequence; raise --num-gpu-blocks or lower --max-model-len"
        )
    kv = KvBlockManager(num_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                        enable_events=cfg.kv_events.active or cfg.flavor == "trtllm")
    sched = Scheduler(
        kv,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        hasher=BlockHasher(cfg.block_size, cfg.hash_seed),
    )
    tok = tokenizer or SimTokenizer()
    engine = SimEngine(sched, TimingModel(profile, cfg.speedup, cfg.prefill_pricing))
    cache_info = {
        "block_size": str(cfg.block_size), "cache_dtype": "auto", "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "num_gpu_blocks": str(num_blocks), "num_gpu_blocks_override": str(cfg.num_gpu_blocks),
        "prefix_caching_hash_algo": "sha256", "kv_cache_size_tokens": str((num_blocks - 1) * cfg.block_size),
        "kv_cache_max_concurrency": str(round((num_blocks - 1) * cfg.block_size / cfg.max_model_len, 2)),
        "user_specified_block_size": "True", "effective_attention_block_size": str(cfg.block_size),
    }  # fmt: skip
    metrics = SimMetrics(cfg.model_name, cfg.max_model_len, engine.gauges, cache_info)
    engine.metrics = metrics
    digest = hashlib.sha256(repr((cfg.profile, cfg.block_size, cfg.max_model_len, num_blocks, cfg.speedup)).encode()).hexdigest()
    st = SimState(cfg, tok, TextSource(tok, cfg.seed), engine, metrics, f"vllm-{VLLM_VERSION}-{digest[:8]}",
                  loras=SimLoras(cfg.enable_lora, cfg.lora_modules))
    if cfg.flavor == "sglang":
        engine_type = {"prefill": "prefill", "decode": "decode"}.get(cfg.disaggregation_mode, "unified")
        st.sglang_metrics = SglangMetrics(metrics, engine.gauges, engine_type, (num_blocks - 1) * cfg.block_size)
    elif cfg.flavor == "trtllm":
        st.trtllm_events = TrtllmEventBuffer()
        engine.publisher = st.trtllm_events  # type: ignore[assignment]
        engine.iteration_stats = TrtllmIterationStats(engine.gauges, num_blocks, cfg.block_size, cfg.max_num_seqs)
        st.trtllm_prometheus = TrtllmPrometheus(metrics, engine.gauges)
    if cfg.disagg_enabled:
        st.disagg = build_disagg(cfg, engine, profile.tp)
    return st


def build_disagg(cfg: SimConfig, engine: SimEngine, tp_size: int = 1) -> DisaggRuntime:
    """The P/D runtime for this sim's flavor, hooked into the engine (see workers/sim/disagg.py)."""
    transfer = KvTransferModel(cfg.kv_transfer_bandwidth_gbps, cfg.kv_bytes_per_token or default_kv_bytes_per_token(cfg.profile),
                               cfg.kv_transfer_latency_ms, cfg.speedup)
    lease = cfg.kv_transfer.lease_s if cfg.flavor == "vllm" and cfg.kv_transfer is not None else cfg.kv_transfer_timeout
    rt = DisaggRuntime(
        cfg.flavor, transfer=transfer, side_host=cfg.side_channel_host, side_port=cfg.side_channel_port, lease_s=lease,
        timeout_s=cfg.kv_transfer_timeout, kv_transfer=cfg.kv_transfer, sglang_mode=cfg.disaggregation_mode, tp_size=tp_size,
        serve=cfg.flavor != "sglang" or cfg.disaggregation_mode == "prefill", release=engine.release_held,
    )
    engine.loader, engine.on_held, engine.on_ended = rt.load, rt.on_held, rt.on_ended
    return rt


def _state(request: Request) -> SimState:
    return request.app.state.sim


def error_response(err: ApiError, flavor: str = "vllm") -> JSONResponse:
    return JSONResponse(err.body(flavor), status_code=err.code)


async def health(_request: Request) -> Response:
    return Response(status_code=200)


async def version(_request: Request) -> Response:
    return JSONResponse({"version": VLLM_VERSION})


async def load(request: Request) -> Response:
    return JSONResponse({"server_load": _state(request).server_load})


async def metrics(request: Request) -> Response:
    st = _state(request)
    if st.sglang_metrics is not None:
        return Response(st.sglang_metrics.render(), media_type=CONTENT_TYPE)
    if st.engine.iteration_stats is not None:  # TRT-LLM: JSON iteration stats, drained
        return JSONResponse(st.engine.iteration_stats.drain())
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


async def prometheus_metrics(request: Request) -> Response:
    st = _state(request)
    assert st.trtllm_prometheus is not None
    return Response(st.trtllm_prometheus.render(), media_type=CONTENT_TYPE)


async def kv_cache_events(request: Request) -> Response:
    """TRT-LLM's `POST /kv_cache_events`: the buffered events, drained."""
    from workers.trtllm.kv_events import encode_events

    st = _state(request)
    assert st.trtllm_events is not None
    return Response(encode_events(st.trtllm_events.drain()), media_type="application/json")


async def models(request: Request) -> Response:
    st = _state(request)
    now = int(time.time())
    data = [
        {
            "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": st.cfg.model, "parent": None,
            "max_model_len": st.cfg.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
        for name in st.cfg.served_model_names
    ]
    data += [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": path, "parent": st.cfg.model_name,
              "max_model_len": None, "permission": data[0]["permission"] if data else []}
             for name, path in st.loras.loaded.items()]
    return JSONResponse({"object": "list", "data": data})


async def kv_event_sources(request: Request) -> Response:
    st = _state(request)
    kv = st.cfg.kv_events.model_dump()
    pub = st.publisher
    if pub is not None:
        kv["endpoint"] = pub.endpoint  # type: ignore[attr-defined]
        kv["replay_endpoint"] = pub.replay_endpoint  # type: ignore[attr-defined]
    return JSONResponse({"0": kv})


async def tokenize(request: Request) -> Response:
    st = _state(request)
    try:
        body = parse_body(await request.body(), _TokenizeBody)
        st.check_model(body.model)
        if body.messages is not None:
            text = st.tokenizer.apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = st.tokenizer.encode(text, add_special_tokens=body.add_special_tokens if body.add_special_tokens is not None else False)
        elif body.prompt is not None:
            ids = st.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            raise bad_request("Either prompt or messages must be provided.", "prompt")
    except ApiError as err:
        return error_response(err, st.cfg.flavor)
    strs = [st.tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": st.cfg.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    st = _state(request)
    try:
        body = parse_body(await request.body(), _DetokenizeBody)
        st.check_model(body.model)
    except ApiError as err:
        return error_response(err, st.cfg.flavor)
    return JSONResponse({"prompt": st.tokenizer.decode(body.tokens)})


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def build_app(cfg: SimConfig, state: SimState | None = None) -> Starlette:
    from workers.sim.generate import chat_completions, completions
    from workers.sim.responses_api import cancel_response, create_response, embeddings, retrieve_response

    st = state or build_state(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if cfg.kv_events.active and cfg.flavor != "trtllm":  # TRT-LLM has no ZMQ publisher (POST /kv_cache_events)
            from workers.kv_publisher import KvEventPublisher

            if cfg.flavor == "sglang":
                from workers.sglang.kv_events import encode_batch as sglang_encode

                pub = KvEventPublisher(cfg.kv_events, encode=lambda ts, ev, dp: sglang_encode(ts, ev, dp_rank=dp),
                                       transform=split_per_page)
            else:
                pub = KvEventPublisher(cfg.kv_events)
            pub.start()
            st.engine.publisher = pub
            st.publisher = pub
        if st.disagg is not None:
            st.disagg.start()
        task = asyncio.get_running_loop().create_task(st.engine.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if st.disagg is not None:
                await st.disagg.close()
            if st.publisher is not None:
                await st.publisher.close()  # type: ignore[attr-defined]

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    if cfg.runner == "pooling":
        routes.append(Route("/v1/embeddings", embeddings, methods=["POST"]))
    elif cfg.flavor == "vllm":
        routes += [Route("/v1/responses", create_response, methods=["POST"]),
                   Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
                   Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])]
    if cfg.runtime_lora_updating and cfg.flavor in ("vllm", "sglang"):
        prefix = "/v1" if cfg.flavor == "vllm" else ""
        routes.append(Route(f"{prefix}/load_lora_adapter", load_lora_adapter, methods=["POST"]))
        routes.append(Route(f"{prefix}/unload_lora_adapter", unload_lora_adapter, methods=["POST"]))
    if cfg.flavor == "trtllm":
        routes.append(Route("/kv_cache_events", kv_cache_events, methods=["POST"]))
        routes.append(Route("/prometheus/metrics", prometheus_metrics, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sim = st
    return _FastPaths(app, {"/v1/completions": completions, "/v1/chat/completions": chat_completions})  # type: ignore[return-value]


class _FastPaths:
    """Serves the two generation routes without Starlette's middleware stack (which wraps every
    streamed chunk's `send` in several layers); everything else, lifespan included, goes to Starlette."""

    def __init__(self, app: Starlette, routes: dict) -> None:
        self.app, self.routes = app, routes
        self.state = app.state

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                scope["app"] = self.app
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
