"""The ASGI app: routes, the API key check, and every error in OpenAI's shape."""

from __future__ import annotations

import contextlib
import hmac

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import sessions_api
from .completions import chat_completions
from .errors import ApiError, server_error, unauthorized
from .state import ServeOptions, ServerState

OPEN_PATHS = {"/health"}  # answered without a key: load balancers and probes ask it


class ApiKeyCheck:
    """With a key set, every request but /health needs `Authorization: Bearer KEY` (compared in
    constant time, so the answer's timing tells nothing of the key)."""

    def __init__(self, app, key: str | None):
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return await unauthorized().response()(scope, receive, send)
        await self.app(scope, receive, send)


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.ready()
    return JSONResponse(await run_in_threadpool(state.health))


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    model = {"id": state.options.model_id, "object": "model", "created": state.started, "owned_by": "llama-chat"}
    return JSONResponse({"object": "list", "data": [model]})


async def api_error(request: Request, e: ApiError) -> Response:
    return e.response()


async def http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    if e.status_code == 404:
        message, code = f"Unknown request URL: {request.method} {request.url.path}.", "unknown_url"
    elif e.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    else:
        message, code = e.detail, None
    return ApiError(e.status_code, message, code=code, headers=e.headers).response()


async def unexpected(request: Request, e: Exception) -> Response:
    return server_error(f"The server failed: {type(e).__name__}: {e}").response()


def create_app(options: ServeOptions, load=None, api_key: str | None = None) -> Starlette:
    """The app for `options`; load(options) → Model replaces loading options.model (tests time it)."""
    state = ServerState(options, load)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        state.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        *sessions_api.ROUTES,
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(ApiKeyCheck, key=api_key)],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: unexpected},
        lifespan=lifespan,
    )
    app.state.server = state
    return app

