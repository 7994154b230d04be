"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Each inference call is authorised (API key, rate limit; orchestrator/security/http.py), then served by the
InferenceService (orchestrator/service.py): validation, routing, the engine call, relay, failover, migration.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from orchestrator.pool import WorkerPool
from orchestrator.security import InferenceGuard
from orchestrator.security.http import authorize_inference, require_json
from orchestrator.service import InferenceService

__all__ = ["make_openai_router"]


def make_openai_router(service: InferenceService, guard: InferenceGuard, pool: WorkerPool, max_body_bytes: int) -> APIRouter:
    router = APIRouter()

    model_context = pool.context_len  # the smallest context among the model's workers

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
        data = []
        for name in pool.models():
            info = pool.info_for(name)
            data.append({"id": name, "object": "model", "created": int(info.started_at if info else time.time()),
                         "owned_by": "kvyard", "root": name, "parent": None,
                         "max_model_len": pool.context_len(name)})
        return JSONResponse({"object": "list", "data": data})

    return router
