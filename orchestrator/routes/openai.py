"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models (base models and LoRA adapters).

Each inference call is authorised (API key, rate limit; orchestrator/security/http.py), then served by the
InferenceService (orchestrator/service.py): validation, routing, the engine call, relay, failover, migration.

The two inference POSTs are also served by plain Starlette routes placed first in the app's route list
(`hot_routes`): the same endpoint functions, but without FastAPI's per-request route context and dependency
solving, which cost ~0.1 ms of a short request's ~1 ms of frontend CPU. Every middleware, exception handler
and `scope["route"]` reader sees them as before; the FastAPI routes stay registered for the OpenAPI schema
(and answer nothing, being matched second).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from orchestrator.features_view import model_cards
from orchestrator.lora import LoraConfig
from orchestrator.pool import WorkerPool
from orchestrator.security import InferenceGuard
from orchestrator.security.http import authorize_inference, require_json
from orchestrator.service import InferenceService

__all__ = ["hot_routes", "make_openai_router"]


def make_openai_router(service: InferenceService, guard: InferenceGuard, pool: WorkerPool, max_body_bytes: int,
                       lora: LoraConfig | None = None) -> APIRouter:
    router = APIRouter()
    lora = lora or LoraConfig()
    base_of = {a.name: a.base_model for a in lora.adapters}  # a LoRA adapter is served by its base model's workers

    def model_context(model: str) -> int | None:  # the smallest context among the (base) model's workers
        return pool.context_len(base_of.get(model, model))

    async def inference(request: Request, kind: str) -> Response:
        require_json(request)  # a cross-site text/plain or form POST (no CORS preflight) never runs inference
        request, grant = await authorize_inference(guard, request, kind, max_body_bytes, model_context)
        response = await service.handle(request, kind)
        if grant is not None:
            response.headers.update(grant.headers())
        return response

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await inference(request, "completions")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await inference(request, "chat")

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        guard.authenticate(request.headers, "http")
        return JSONResponse({"object": "list", "data": model_cards(pool, lora)})  # base models, then LoRA adapters

    return router


class _HotRoute(Route):
    """A Starlette route that, like FastAPI's, leaves itself in `scope["route"]` (error metrics read its path)."""

    def matches(self, scope):
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child


def hot_routes(router: APIRouter) -> list[Route]:
    """Plain routes for the POSTs of `router` (make_openai_router's: the two inference routes), to insert before the
    app's routes."""
    return [_HotRoute(r.path, r.endpoint, methods=["POST"], include_in_schema=False)
            for r in router.routes if isinstance(r, APIRoute) and "POST" in r.methods]
