"""The inference POSTs' own ASGI chain: the app's middlewares and error handling, without the framework's other layers.

A request reaches a route through every layer FastAPI and Starlette stack in front of the router: the error
middleware, FastAPI's exception-telemetry and body-limit middlewares, the app's own middlewares, the exception
middleware, FastAPI's per-request AsyncExitStack, the router's match over the route list, the route's handler and
its second exception wrapper: layers the two inference endpoints do not use (they take a `Request` and return a
`Response`: no dependencies, no form files, no body limit of FastAPI's, since kvyard bounds the body itself). With
caches warm they cost only a few microseconds of a ~0.9 ms request; at concurrency 1, with caches cold from the
engine and the client running in between, skipping them brings kvyard's handler ~60 µs sooner and the engine write
~50 µs sooner (`benchmarks/request_stages.py`, docs/benchmarks.md "KV events and the engine send").

`KvyardApp.hot_routes` maps those paths to their routes (orchestrator/routes/openai.py `hot_routes`). A POST to one
of them runs

    ServerErrorMiddleware (the app's 500 handler) -> the app's middlewares, in order -> ExceptionMiddleware (the
    app's exception handlers) -> the endpoint

built from the same pieces, with the same handlers, as the full stack, and with `scope["route"]` set to the route as
the router would. Everything else (other paths, other methods, a `root_path`) takes the full stack, unchanged.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["KvyardApp"]


async def _endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    response = await scope["endpoint"](Request(scope, receive, send))
    await response(scope, receive, send)


class _Split:
    """The hot routes' POSTs down the lean chain, everything else down the full stack."""

    __slots__ = ("full", "lean", "routes")

    def __init__(self, full: ASGIApp, lean: ASGIApp, routes: dict[str, Route]) -> None:
        self.full, self.lean, self.routes = full, lean, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.routes.get(scope["path"])
            if route is not None:  # what the router's match would have put in the scope
                scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, {}
                await self.lean(scope, receive, send)
                return
        await self.full(scope, receive, send)


class KvyardApp(FastAPI):
    """FastAPI, with `hot_routes` (path -> a plain Starlette route of an async `endpoint(request) -> Response`) served
    by the lean chain. Set them before the app serves its first request (the stack is built then)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hot_routes: dict[str, Route] = {}

    def build_middleware_stack(self) -> ASGIApp:
        full = super().build_middleware_stack()
        if not self.hot_routes:
            return full
        error_handler, handlers = None, {}
        for key, value in self.exception_handlers.items():  # split as Starlette and FastAPI split them
            if key in (500, Exception):
                error_handler = value
            else:
                handlers[key] = value
        lean: ASGIApp = ExceptionMiddleware(_endpoint, handlers=handlers, debug=self.debug)
        for cls, args, kwargs in reversed(self.user_middleware):
            lean = cls(lean, *args, **kwargs)
        lean = ServerErrorMiddleware(lean, handler=error_handler, debug=self.debug)
        return _Split(full, lean, dict(self.hot_routes))
