"""The ASGI app: routes, the checks every request passes (its Host, its Origin, the API key), one
access line per request, and every error in OpenAI's shape."""

from __future__ import annotations

import contextlib
import hmac
import time

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llama_chat.storage import StoreError

from . import sessions_api
from .completions import chat_completions
from .errors import ApiError, forbidden, server_error, storage_failed, unauthorized
from .state import ServeOptions, ServerState, say
from .text_completions import text_completions

OPEN_PATHS = {"/health"}  # answered without a key: load balancers and probes ask it
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class AccessLog:
    """One line per request once it is answered: method, path, status, time. Never the query, the
    headers (the key) or a body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 500  # what the client gets when the app raises

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            say(f"{scope['method']} {scope['path']} {status} {(time.perf_counter() - t0) * 1000:.0f} ms")


class UnderWay:
    """Counts the requests taken while the server is ready until each is answered whole (a stream to
    its last chunk), for a SIGTERM's drain to wait on (ServerState.drained). /health is not counted: a
    balancer asks it all along."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.state.phase != "ready":
            return await self.app(scope, receive, send)
        self.state.under_way += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.under_way -= 1


def host_name(host: str) -> str:
    """The name in a Host header (or a name given to --allowed-host), without its port and final dot:
    'localhost:8080' → 'localhost', '[::1]:80' → '::1', 'Example.com.' → 'example.com'."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


class HostCheck:
    """Requests must name this server in their Host header (loopback names, the address it listens on,
    the address the client reached, --allowed-host): a web page on another name that resolves here
    (DNS rebinding) gets 403."""

    def __init__(self, app, names: set[str]):
        self.app = app
        self.names = {host_name(n) for n in names}

    def answers_to(self, host: str, scope) -> bool:
        # the address the connection came in on (a server on 0.0.0.0 reached as 192.168.1.5): a page
        # whose origin is that address would be this server's own, and it serves no pages
        name = host_name(host)
        return "*" in self.names or name in self.names or name == (scope.get("server") or ("",))[0]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            # HTTP/1.0 may leave the header out; every browser sends it
            if host is not None and not self.answers_to(host, scope):
                name = host_name(host)[:100]
                message = (
                    f"The Host header names '{name}', which this server does not answer to; "
                    f"start it with --allowed-host {name} if it should."
                )
                return await forbidden(message, "host_not_allowed").response()(scope, receive, send)
        await self.app(scope, receive, send)


class OriginCheck:
    """A request from a web page (it has an Origin header) must come from an origin named by
    --cors-origin: any other page gets 403, whatever it sends, so none can post, read or delete
    through the user's browser (CSRF). Clients that are not browsers send no Origin."""

    def __init__(self, app, origins: set[str]):
        self.app = app
        self.origins = {o.rstrip("/").lower() for o in origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and origin.rstrip("/").lower() not in self.origins:
                origin = origin[:100]
                message = (
                    f"Requests from web pages at {origin} are refused; start the server with "
                    f"--cors-origin {origin} to let that page use it."
                )
                return await forbidden(message, "origin_not_allowed").response()(scope, receive, send)
        await self.app(scope, receive, send)


class ApiKeyCheck:
    """With keys set, every request but /health needs `Authorization: Bearer KEY` (compared with every
    key in constant time, so the answer's timing tells nothing of them); the request is then its
    tenant's (scope["state"]["tenant"]: see transport.tenant_of)."""

    def __init__(self, app, keys: dict[str, str | None]):
        self.app = app
        self.keys = {key.encode(): tenant for key, tenant in keys.items()}

    async def __call__(self, scope, receive, send):
        if self.keys and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            given, found, tenant = token.strip().encode(), False, None
            for key, name in self.keys.items():
                if hmac.compare_digest(given, key):
                    found, tenant = True, name
            if scheme.lower() != "bearer" or not found:
                return await unauthorized().response()(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


async def health(request: Request) -> Response:
    """Answered on the event loop, waiting on nothing (not even a free worker thread)."""
    status, said = request.app.state.server.health()
    return JSONResponse(said, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    model = {
        "id": state.options.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "llama-chat",
    }
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


async def store_failed(request: Request, e: StoreError) -> Response:
    """A database that cannot be used (a full disk, …): one line in the log, and the API's error."""
    say(f"{request.method} {request.url.path}: {e}")
    return storage_failed(e).response()


async def unexpected(request: Request, e: Exception) -> Response:
    """A failure nobody foresaw: the whole of it in the server's log, only its kind to the client (its
    text may name the server's files)."""
    say(f"error: {request.method} {request.url.path} failed: {type(e).__name__}: {e}")
    return server_error(f"The server failed ({type(e).__name__}); its log says why.").response()


def create_app(
    options: ServeOptions, load=None, api_key: str | dict[str, str | None] | None = None
) -> Starlette:
    """The app for `options`; load(options) → Model replaces loading options.model (tests time it).
    `api_key`: one key, or keys with their tenants' names (state.api_keys_from)."""
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
        Route("/v1/completions", text_completions, methods=["POST"]),
        *sessions_api.ROUTES,
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware(options, api_key, state),
        exception_handlers={
            ApiError: api_error, HTTPException: http_error, StoreError: store_failed, Exception: unexpected
        },
        lifespan=lifespan,
    )
    app.state.server = state
    return app


def middleware(
    options: ServeOptions, api_key: str | dict[str, str | None] | None, state: ServerState
) -> list[Middleware]:
    """What every request passes, outermost first. CORS answers an allowed page's preflight before the
    key is asked for (a browser sends none with it)."""
    cors = []
    if options.cors_origins:
        cors = [
            Middleware(
                CORSMiddleware,
                allow_origins=list(options.cors_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["*"],  # the openai JS client sends x-stainless-* headers
                expose_headers=["X-Session-Id", "X-Conversation-Key", "Retry-After"],
                max_age=600,
            )
        ]
    return [
        Middleware(AccessLog),
        Middleware(UnderWay, state=state),
        Middleware(HostCheck, names={*LOOPBACK_NAMES, options.host, *options.allowed_hosts}),
        Middleware(OriginCheck, origins=set(options.cors_origins)),
        *cors,
        Middleware(ApiKeyCheck, keys={api_key: None} if isinstance(api_key, str) else api_key or {}),
    ]

