"""/v1/sessions: the stored conversations over HTTP — list, create, show, fork, delete, export and
import (.llamachat files) — on the same database as the TUI and the CLI, so a session moves between
them and any server that shares the file. A turn is added with POST /v1/chat/completions and
"session": ID (or the X-Session-Id header)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from llama_chat.storage import Session, StoreError
from llama_chat.storage.exchange import (
    HEADER_SIZE,
    MAX_DATA_BYTES,
    MAX_MANIFEST_BYTES,
    ExchangeError,
    declared_size,
    default_file_name,
    export_session,
    import_session,
    read_session_file,
)

from ..chat.conversations import API_ORIGIN, kv_salt
from ..chat.titles import session_title
from .completions import find_session
from .errors import ApiError, invalid
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
    return {**session.to_json(), "kv_verified": session.kv_namespace in (None, kv_salt(session.tenant))}


async def list_sessions(request: Request) -> Response:
    store = _state(request).engine.store
    sessions = await run_in_threadpool(store.list_sessions, tenant_of(request))
    return JSONResponse({"object": "list", "data": [_json(s) for s in sessions]})


async def create_session(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.options.max_body, state.options.body_timeout_s)
    title, system = text_field(body, "title"), text_field(body, "system_prompt")
    engine, tenant = state.engine, tenant_of(request)

    def create():
        return engine.store.create_session(
            session_title(title or "") or "API chat",
            model_fingerprint=engine.model.fingerprint,
            model_name=engine.model.name,
            system_prompt=system or None,
            origin=API_ORIGIN,
            tenant=tenant,
            kv_namespace=kv_salt(tenant),
        )

    session = await run_in_threadpool(create)
    return JSONResponse(_json(session), status_code=201, headers={"X-Session-Id": session.id})


async def show_session(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))
    messages = await run_in_threadpool(state.engine.store.path, session.head_id)
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
            return state.engine.fork(session, at, session_title(title) if title else None)
        except StoreError as e:  # a message not on the session's path
            if e.brief is not None:  # the database failed, not the request
                raise
            raise invalid(f"Cannot fork there: {e}.", param="at_message") from None

    child = await run_in_threadpool(fork)
    return JSONResponse(_json(child), status_code=201, headers={"X-Session-Id": child.id})


async def delete_session(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))

    removed = await run_in_threadpool(state.engine.delete, session.id)  # after a turn being made is stored
    return JSONResponse({"id": session.id, "object": "session.deleted", "deleted": True, "messages": removed})


async def export(request: Request) -> Response:
    state = _state(request)
    session = await run_in_threadpool(find_session, state, request.path_params["id"], tenant_of(request))
    query = request.query_params
    with_kv = query.get("kv", "1") not in ("0", "false", "no")
    tree = query.get("tree", "0") in ("1", "true", "yes")
    folder = Path(tempfile.mkdtemp(prefix="llama-chat-export-"))
    path = folder / default_file_name(session)
    try:
        codec = query.get("codec") or None
        store = state.engine.store
        await run_in_threadpool(export_session, store, session.id, path, with_kv=with_kv, codec=codec, tree=tree)
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
    state = _state(request)
    folder = Path(tempfile.mkdtemp(prefix="llama-chat-import-"))
    try:
        path = folder / "upload.llamachat"

        def check_head(head: bytes) -> int:  # before the rest is written: a wrong file is refused at once
            try:
                return declared_size(str(path), head)
            except ExchangeError as e:
                raise _unusable(e, path) from None

        options = state.options
        await save_file(request, path, MAX_IMPORT, options.body_timeout_s, HEADER_SIZE, check_head)
        fingerprint, tenant = state.engine.model.fingerprint, tenant_of(request)

        def read_and_import():
            try:
                return import_session(
                    state.engine.store, read_session_file(path), model_fingerprint=fingerprint, tenant=tenant,
                    kv_namespace=kv_salt(tenant),
                )
            except ExchangeError as e:
                raise _unusable(e, path) from None

        result = await run_in_threadpool(read_and_import)
    finally:
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
