"""/v1/sessions: the stored conversations over HTTP — list, create, show, fork, delete, export and
import (.llamachat files) — on the same database as the TUI and the CLI, so a session moves between
them and any server that shares the file. A turn is added with POST /v1/chat/completions and
"session": ID (or the X-Session-Id header)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict
from functools import partial
from pathlib import Path

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from llama_chat.storage import Session, StoreError

from ..chat.conversations import API_ORIGIN
from ..chat.session_cache import computed_here, kv_salt
from ..chat.sessions import (
    HEADER_SIZE,
    MAX_DATA_BYTES,
    MAX_MANIFEST_BYTES,
    ExchangeError,
    declared_size,
    export_file_name,
    read_session_file,
)
from ..chat.titles import session_title
from .completions import find_session
from .errors import ApiError, busy, invalid
from .openai_api import text_field
from .state import ServerState
from .transport import read_json, save_file, tenant_of

MAX_IMPORT = MAX_MANIFEST_BYTES + MAX_DATA_BYTES + (1 << 20)  # the largest file import would read


def _state(request: Request) -> ServerState:
    state = request.app.state.server
    state.ready()
    return state


def _json(session: Session) -> dict:
    """A session as the API shows it: its KV is verified where it is its tenant's own (not an import's)."""
    return {**session.to_json(), "kv_verified": computed_here(session)}


async def list_sessions(request: Request) -> Response:
    sessions = await run_in_threadpool(_state(request).sessions.list, tenant_of(request))
    return JSONResponse({"object": "list", "data": [_json(s) for s in sessions]})


async def create_session(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.options.max_body, state.options.body_timeout_s)
    title, system = text_field(body, "title"), text_field(body, "system_prompt")
    engine, tenant = state.engine, tenant_of(request)

    def create():  # "": no system prompt (the model's recommended one is a chat's of the app)
        return engine.new_session(session_title(title or "") or "API chat", system or "", origin=API_ORIGIN,
                                  tenant=tenant)  # fmt: skip

    session = await run_in_threadpool(create)
    return JSONResponse(_json(session), status_code=201, headers={"X-Session-Id": session.id})


async def show_session(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))
    messages = await run_in_threadpool(state.sessions.messages, session)
    return JSONResponse({**_json(session), "messages": [asdict(m) for m in messages]})


async def fork_session(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.options.max_body, state.options.body_timeout_s)
    at = body.get("at_message")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int)):
        raise invalid("'at_message' must be a message id (an integer).", param="at_message")
    title = text_field(body, "title")
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))

    def fork():
        try:
            return state.sessions.fork(session, at, title)
        except StoreError as e:  # a message not on the session's path
            if e.brief is not None:  # the database failed, not the request
                raise
            raise invalid(f"Cannot fork there: {e}.", param="at_message") from None

    child = await run_in_threadpool(fork)
    return JSONResponse(_json(child), status_code=201, headers={"X-Session-Id": child.id})


async def delete_session(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))

    removed = await run_in_threadpool(state.sessions.delete, session.id)  # after a turn being made is stored
    return JSONResponse({"id": session.id, "object": "session.deleted", "deleted": True, "messages": removed})


async def export(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))
    query = request.query_params
    with_kv = query.get("kv", "1") not in ("0", "false", "no")
    tree = query.get("tree", "0") in ("1", "true", "yes")
    folder = Path(tempfile.mkdtemp(prefix="llama-chat-export-"))
    path = folder / export_file_name(session)
    try:
        codec = query.get("codec") or None
        export = partial(state.sessions.export, session.id, path, with_kv=with_kv, codec=codec, tree=tree)
        await run_in_threadpool(export)
    except ExchangeError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise invalid(str(e), param="codec") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=path.name,
        background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
    )


def _unusable(e: ExchangeError, path: Path) -> ApiError:
    """The file's problem, without the server's own path for it (its messages begin with the path)."""
    return invalid(f"Not a usable .llamachat file: {str(e).removeprefix(f'{path}: ')}")


async def import_file(request: Request) -> Response:
    """The upload streams to a file beside the database (not /tmp, often memory) and is read back a
    piece at a time: no import holds more than a piece of its file in memory. At most
    options.max_imports run at once; more get 429."""
    state = _state(request)
    options = state.options
    if state.imports >= options.max_imports:
        raise busy(1, f"{options.max_imports} imports are running already; retry in a moment.")
    folder = Path(tempfile.mkdtemp(prefix=".llama-chat-import-", dir=options.db.parent))
    state.imports += 1
    try:
        path = folder / "upload.llamachat"

        def check_head(head: bytes) -> int:  # before the rest is written: a wrong file is refused at once
            try:
                return declared_size(str(path), head)
            except ExchangeError as e:
                raise _unusable(e, path) from None

        await save_file(request, path, MAX_IMPORT, options.body_timeout_s, HEADER_SIZE, check_head)
        tenant = tenant_of(request)

        def read_and_import():
            try:
                return state.sessions.import_file(
                    read_session_file(path), tenant=tenant, kv_namespace=kv_salt(tenant)
                )
            except ExchangeError as e:
                raise _unusable(e, path) from None

        result = await run_in_threadpool(read_and_import)
    finally:
        state.imports -= 1
        shutil.rmtree(folder, ignore_errors=True)
    return JSONResponse(
        {
            "object": "session.import",
            "ids": result.session_ids,
            "title": result.title,
            "messages": result.messages,
            "kv": result.kv,
            "blocks_added": result.blocks_added,
        },
        status_code=201,
    )


ROUTES = [
    Route("/v1/sessions", list_sessions, methods=["GET"]),
    Route("/v1/sessions", create_session, methods=["POST"]),
    Route("/v1/sessions/import", import_file, methods=["POST"]),
    Route("/v1/sessions/{id}", show_session, methods=["GET"]),
    Route("/v1/sessions/{id}", delete_session, methods=["DELETE"]),
    Route("/v1/sessions/{id}/fork", fork_session, methods=["POST"]),
    Route("/v1/sessions/{id}/export", export, methods=["GET"]),
]
