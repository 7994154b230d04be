"""The OpenAI and vLLM endpoints forwarded whole to one engine (orchestrator/passthrough.py):
/v1/embeddings, /tokenize, /detokenize, /v1/responses (create; retrieve and cancel by id).

Each call is authorised like generation (API key, rate limit; orchestrator/security/http.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from orchestrator.passthrough import PassThrough
from orchestrator.pool import WorkerPool
from orchestrator.security import InferenceGuard
from orchestrator.security.http import authorize_inference, require_json

__all__ = ["make_forwarded_router"]


def make_forwarded_router(forward: PassThrough, guard: InferenceGuard, pool: WorkerPool, max_body_bytes: int) -> APIRouter:
    router = APIRouter()

    async def forwarded(request: Request, kind: str) -> Response:
        require_json(request)
        request, grant = await authorize_inference(guard, request, kind, max_body_bytes, pool.context_len)
        response = await forward.handle(request, kind)
        if grant is not None:
            response.headers.update(grant.headers())
        return response

    async def by_id(request: Request, response_id: str, method: str, suffix: str = "") -> Response:
        _, grant = await authorize_inference(guard, request, "responses_by_id", max_body_bytes, pool.context_len)
        response = await forward.response_op(response_id, method, suffix)
        if grant is not None:
            response.headers.update(grant.headers())
        return response

    def post(kind: str):
        async def endpoint(request: Request) -> Response:
            return await forwarded(request, kind)
        return endpoint

    for path, kind in (("/v1/embeddings", "embeddings"), ("/tokenize", "tokenize"), ("/detokenize", "detokenize"),
                       ("/v1/responses", "responses")):
        router.add_api_route(path, post(kind), methods=["POST"], name=kind)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await by_id(request, response_id, "GET")

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await by_id(request, response_id, "POST", "/cancel")

    return router
