"""POST /v1/chat/completions: a request parsed, its job submitted, and the job's events rendered as
one JSON reply or as a stream of chunks (server-sent events). A client that leaves cancels its job."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llama_chat.inference.errors import ContextFullError
from llama_chat.storage import Session, StoreError
from llama_chat.storage.kv_store import RemoteRead

from ..chat.engine import ChatEngine, ReplyNotStored, SavedReply
from ..chat.jobs import Job, State
from ..chat.scheduler import QueueFull
from .errors import (
    ApiError,
    busy,
    context_length_exceeded,
    invalid,
    server_error,
    session_not_found,
    storage_failed,
    unavailable,
)
from .openai_api import CompletionRequest, Kept, Reply, finish_reason, parse_completion
from .state import ServerState
from .transport import JobEvents, ended_or_gone, read_json, tenant_of

RETRY_AFTER_S = 1
# How long a stream has, once the server is told to stop, to say that its reply was cut short and end
# (its job is cancelled at once; sse_starlette would otherwise cut the stream mid-way).
CLOSING_GRACE_S = 5


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_completion(
        await read_json(request, state.options.max_body, state.options.body_timeout_s),
        request.headers.get("x-session-id"),
    )
    state.check_model(req.model)
    engine = state.ready()
    events = JobEvents()
    reply = Reply(req.model, "llama-chat-" + engine.model.fingerprint[:12])
    headers = {}
    if req.session is None:
        tenant = tenant_of(request)
        job = await run_in_threadpool(_submitted, lambda: _submit_conversation(state, req, events, tenant))
    else:
        session = await run_in_threadpool(find_session, state, req.session, tenant_of(request))
        job = await run_in_threadpool(_submitted, lambda: _submit_turn(state, session, req, events))
        headers["X-Session-Id"] = session.id
    if req.stream:
        return EventSourceResponse(
            _chunks(job, events, reply, req.include_usage, engine),
            headers=headers,
            shutdown_grace_period=CLOSING_GRACE_S,
        )
    if not await ended_or_gone(request, events):
        job.cancel()  # the client left: nobody will read the reply
        return Response(status_code=499)
    kept = await kept_where(job)
    failure = _failure(job, kept)
    if failure is not None:
        raise failure
    if kept.session is not None:
        headers["X-Session-Id"] = kept.session
    if kept.error is not None:
        headers["X-Store-Error"] = kept.error_code
    texts = [job.text(i) for i in range(job.n)]
    return JSONResponse(reply.completion(texts, job.stats, kept, kv_remote(engine, job)), headers=headers)


def kv_remote(engine: ChatEngine, job: Job) -> dict | None:
    """The remote tier's numbers, and what it did for this request's prompt: "fetch" (and the tokens it
    read), "compute" (the rule found fetching slower), or "local" (RAM and SQLite held every block)."""
    if engine.kv.remote is None:
        return None
    read = job.remote or RemoteRead()
    return {"choice": read.choice, "fetched_tokens": read.tokens, **engine.kv.remote.stats()}


def find_session(state: ServerState, session_id: str, tenant: str | None) -> Session:
    """A stored session of the tenant's by id (or unique prefix); 404 when there is none."""
    try:
        return state.ready().store.get_session(session_id, tenant)
    except StoreError as e:
        if e.brief is not None:  # the database failed, not the request
            raise
        raise session_not_found(str(e)) from None


def _submitted(submit: Callable[[], Job]) -> Job:
    """submit(), with the scheduler's refusals said as the API says them."""
    try:
        return submit()
    except QueueFull:
        raise busy(RETRY_AFTER_S) from None
    except ContextFullError as e:
        raise invalid(str(e), param="messages", code="context_length_exceeded") from None
    except RuntimeError:  # the scheduler is closed
        raise unavailable("The server is shutting down.", "shutting_down") from None


def _refused_early(engine: ChatEngine, messages: list[dict]) -> None:
    """What is refused before a conversation is rendered, tokenized and looked up in the KV tiers
    (seconds of CPU and a network read for 100k messages): a full queue, or more messages than the
    context window holds tokens (each message takes one at least)."""
    if engine.scheduler.load()["queued"] >= engine.scheduler.max_queued:
        raise busy(RETRY_AFTER_S)
    if len(messages) >= engine.n_ctx:
        raise invalid(
            f"The conversation has {len(messages):,} messages; this server's context window holds "
            f"{engine.n_ctx:,} tokens (llama-chat serve --ctx), and each message takes one at least.",
            param="messages",
            code="context_length_exceeded",
        )


def _submit_conversation(state: ServerState, req: CompletionRequest, events: JobEvents, tenant: str | None) -> Job:
    conversations, n_ctx = state.conversations, state.engine.n_ctx
    _refused_early(state.engine, req.messages)
    prompt = conversations.prompt(req.messages)
    if len(prompt) >= n_ctx:
        raise context_length_exceeded(len(prompt), n_ctx)
    return conversations.submit(
        req.messages,
        prompt,
        n=req.n,
        sampling=req.sampling,
        max_tokens=req.max_tokens,
        stop=req.stop,
        store=req.store,
        on_event=events,
        tenant=tenant,
        cache_key=req.prompt_cache_key,
    )


def _submit_turn(state: ServerState, session: Session, req: CompletionRequest, events: JobEvents) -> Job:
    try:
        return state.conversations.submit_turn(
            session,
            req.messages[-1]["content"],
            sampling=req.sampling,
            max_tokens=req.max_tokens,
            stop=req.stop,
            store=req.store,
            on_event=events,
        )
    except ValueError as e:  # an empty message
        raise invalid(f"The new message cannot be used: {e}.", param="messages") from None
    except StoreError as e:  # deleted meanwhile
        if e.brief is not None:  # the database failed, not the request
            raise
        raise session_not_found(str(e)) from None


async def kept_where(job: Job) -> Kept:
    """The session the reply was stored in, if it was (waiting for the writer to store it), or why not."""
    result = job.result
    try:
        if isinstance(job.error, ReplyNotStored):
            raise job.error
        if isinstance(result, Future):  # shielded: a client that leaves meanwhile must not cancel the storing
            result = await asyncio.shield(asyncio.wrap_future(result))
    except ReplyNotStored as e:
        return Kept(error=e)
    if isinstance(result, SavedReply):
        result = result.session
    return Kept(result.id if isinstance(result, Session) else None)


def _failure(job: Job, kept: Kept) -> ApiError | None:
    """Why the job has no reply to send, as the API says it; None when it has one (even one that could
    not be stored: the client gets it, with a note)."""
    if job.state is State.DONE or isinstance(job.error, ReplyNotStored):
        return None
    if job.state is State.CANCELLED:  # not by the client: the server is closing
        where = f", and stored as it is in session {kept.session}" if kept.session else ""
        return unavailable(f"The server is shutting down; the reply was cut short{where}.", "shutting_down")
    if isinstance(job.error, StoreError):  # the database failed, or the session was deleted while it waited
        return storage_failed(job.error) if job.error.brief is not None else session_not_found(str(job.error))
    return server_error(f"The reply failed: {job.error}")


async def _chunks(
    job: Job, events: JobEvents, reply: Reply, include_usage: bool, engine: ChatEngine
) -> AsyncIterator[str]:
    """The stream: a first chunk per alternative, its text as it comes, its finish_reason, usage if
    asked for, then [DONE]. An error after the stream began comes as an error object, as OpenAI's does."""
    try:
        for i in range(job.n):
            yield _data(reply.chunk(i, {"role": "assistant", "content": ""}))
        async for event in events:
            if event.kind == "text" and event.text:
                yield _data(reply.chunk(event.alt, {"content": event.text}))
        kept = await kept_where(job)
        failure = _failure(job, kept)
        if failure is not None:  # an error object, as OpenAI's streams send one, then the end
            yield _data({**failure.body(), **kept.fields()})
            yield "[DONE]"
            return
        for i, stats in enumerate(job.stats):
            yield _data(reply.chunk(i, {}, finish_reason(stats), **kept.fields()))
        if include_usage:
            yield _data(reply.usage_chunk(job.stats, kept, kv_remote(engine, job)))
        yield "[DONE]"
    finally:
        if not job.state.ended:  # the client left (its task was cancelled) or the server is stopping
            job.cancel()


def _data(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)
