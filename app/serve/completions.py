"""POST /v1/chat/completions: a request parsed, its job submitted, and the job's events rendered as
one JSON reply or as a stream of chunks (server-sent events). A client that leaves cancels its job."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Protocol

from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llama_chat.inference import constrain
from llama_chat.inference.errors import ContextFullError
from llama_chat.inference.tool_calls import ToolFormat, call_ids, split_offered_calls
from llama_chat.inference.tool_stream import CallSplitter, Delta
from llama_chat.storage import Session, StoreError

from ..chat.conversations import Conversation
from ..chat.engine import ChatEngine, ReplyNotStored, SavedReply
from ..chat.jobs import Event, JobView, QueueFull, State
from ..chat.replies import PromptTooLong
from ..chat.resume import RemoteRead
from ..chat.settings import max_tokens as longest
from .affinity import CONVERSATION_KEY, conversation_key
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
from .openai_api import CompletionRequest, parse_completion
from .openai_replies import Kept, Reply, finish_reason, token_logprobs
from .state import ServerState, say
from .transport import JobEvents, ended_or_gone, read_json, tenant_of

RETRY_AFTER_S = 1
# How long a stream has, once the server is told to stop, to say that its reply was cut short and end
# (its job is cancelled at once; sse_starlette would otherwise cut the stream mid-way).
CLOSING_GRACE_S = 5


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, state.options.max_body, state.options.body_timeout_s)
    req = parse_completion(body, request.headers.get("x-session-id"))
    state.check_model(req.model)
    engine = state.ready()
    fmt = engine.model_info.tool_format
    ids = (
        call_ids(fmt, req.parallel_tool_calls) if fmt is not None and req.tool_choice == "required" else None
    )
    grammar = await run_in_threadpool(_grammar, engine, req, fmt, ids)
    events = JobEvents()
    reply = Reply(req.model, "llama-chat-" + engine.model_info.fingerprint[:12])
    headers = {}
    if req.session is None:
        headers[CONVERSATION_KEY] = conversation_key(req.messages, req.prompt_cache_key, body.get("user"))
        tenant = tenant_of(request)
        job = await run_in_threadpool(
            submitted, lambda: _submit_conversation(state, req, events, tenant, grammar)
        )
    else:
        session = await run_in_threadpool(find_session, state, req.session, tenant_of(request))
        job = await run_in_threadpool(submitted, lambda: _submit_turn(state, session, req, events))
        headers["X-Session-Id"] = session.id
    offered = {tool["function"]["name"] for tool in req.tools or []}
    if req.stream:
        splitters = [
            CallSplitter(fmt, grammar is not None, ids, offered) if req.tools else None for _ in range(req.n)
        ]
        logprobs = _Logprobs(job, engine.model_info.tokenizer) if req.logprobs is not None else None
        shape = _ChatStream(job, reply, req.include_usage, engine, splitters, fmt, logprobs)
        return event_stream(job, events, shape, headers)
    kept = await whole(request, job, events)
    if kept is None:
        return Response(status_code=499)
    if kept.session is not None:
        headers["X-Session-Id"] = kept.session
    if kept.error is not None:
        headers["X-Store-Error"] = kept.error_code
    texts, calls = [job.text(i) for i in range(job.n)], None
    if req.tools:
        split = [split_offered_calls(text, offered, fmt) or (text, []) for text in texts]
        texts, calls = [content for content, _ in split], [made for _, made in split]
        for call in (c for made in calls for c in made):
            call.id = call.id or fmt.new_id()
    logprobs = None
    if req.logprobs is not None:
        logprobs = [token_logprobs(engine.model_info.tokenizer, s.logprobs) for s in job.stats]
    thinking = [job.thinking(i) for i in range(job.n)]
    body = reply.completion(texts, job.stats, kept, kv_remote(engine, job), calls, logprobs, thinking)
    return JSONResponse(body, headers=headers)


def _grammar(
    engine: ChatEngine, req: CompletionRequest, fmt: ToolFormat | None, ids: list[str] | None
) -> str | None:
    """The grammar the replies must follow (a JSON schema's, or a required tool call's in the chat
    template's format `fmt`, its calls given `ids` where the format has them), compiled against the
    model's vocabulary; a 400 naming the problem when it does not compile. Tools need a chat template
    that renders them and asks for calls in a format this server reads."""
    model = engine.model_info
    for i, tool in enumerate(req.tools or []):  # each schema on its own, so the error can name it
        parameters = tool["function"].get("parameters") or {"type": "object"}
        try:
            constrain.check_grammar(model.tokenizer, constrain.json_schema_grammar(parameters))
        except constrain.GrammarError as e:
            raise invalid(f"'tools[{i}].function.parameters': {e}.", param=f"tools[{i}]") from None
    for name, used in (("tools", bool(req.tools)), ("messages", _has_tool_messages(req))):
        if used and fmt is None:
            raise invalid(
                "This model's chat template does not take tools in a format this server reads "
                f"({model.name}).",
                param=name,
            )
    if req.session is not None and (req.tools or req.json_schema is not None):
        raise invalid("'tools' and 'response_format' cannot be used with a session.", param="session")
    try:
        if req.tools and req.tool_choice == "required":
            calls = fmt.grammar(req.tools, req.tool_name, req.parallel_tool_calls, ids, model.tokenizer)
            grammar = constrain.lark_grammar(calls)
            return constrain.check_grammar(model.tokenizer, grammar)
        if req.json_schema is not None:
            schema = constrain.json_schema_grammar(req.json_schema)
            return constrain.check_grammar(model.tokenizer, schema)
    except constrain.GrammarError as e:
        raise invalid(f"'response_format': {e}.", param="response_format") from None
    return None


def kv_remote(engine: ChatEngine, job: JobView) -> dict | None:
    """The remote tier's numbers, and what it did for this request's prompt: "fetch" (and the tokens it
    read), "compute" (the rule found fetching slower), or "local" (RAM and SQLite held every block)."""
    stats = engine.kv_remote
    if stats is None:
        return None
    read = job.remote or RemoteRead()
    return {"choice": read.choice, "fetched_tokens": read.tokens, **stats}


def find_session(state: ServerState, session_id: str, tenant: str | None) -> Session:
    """A stored session of the tenant's by id (or unique prefix); 404 when there is none."""
    try:
        state.ready()
        return state.sessions.get(session_id, tenant)
    except StoreError as e:
        if e.brief is not None:  # the database failed, not the request
            raise
        raise session_not_found(str(e)) from None


def submitted(submit: Callable[[], JobView]) -> JobView:
    """submit(), with the scheduler's refusals said as the API says them."""
    try:
        return submit()
    except QueueFull:
        raise busy(RETRY_AFTER_S) from None
    except ContextFullError as e:
        raise invalid(str(e), param="messages", code="context_length_exceeded") from None
    except RuntimeError:  # the scheduler is closed
        raise unavailable("The server is shutting down.", "shutting_down") from None


def refuse_when_full(engine: ChatEngine) -> None:
    """429 before a prompt is rendered, tokenized and looked up in the KV tiers (seconds of CPU and a
    network read for 100k messages) when it would only wait behind a full queue to be refused."""
    if engine.queue_full:
        raise busy(RETRY_AFTER_S)


def _refused_early(engine: ChatEngine, messages: list[dict]) -> None:
    """What is refused before a conversation is rendered: a full queue, or more messages than the
    context window holds tokens (each message takes one at least)."""
    refuse_when_full(engine)
    if len(messages) >= engine.n_ctx:
        raise invalid(
            f"The conversation has {len(messages):,} messages; this server's context window holds "
            f"{engine.n_ctx:,} tokens (llama-chat serve --ctx), and each message takes one at least.",
            param="messages",
            code="context_length_exceeded",
        )


def _submit_conversation(
    state: ServerState,
    req: CompletionRequest,
    events: JobEvents,
    tenant: str | None,
    grammar: str | None = None,
) -> JobView:
    """A conversation sent whole: n replies, kept as an API session of the tenant's (job.result: the
    future of that session)."""
    engine = state.engine
    _refused_early(engine, req.messages)
    conversation = Conversation(req.messages, req.tools, tenant, req.prompt_cache_key)
    try:
        return engine.reply(
            conversation,
            n=req.n,
            settings=req.sampling,
            grammar=grammar,
            logprobs=req.logprobs,
            max_tokens=engine.n_ctx if req.max_tokens is None else req.max_tokens,
            stop=req.stop,
            store=req.store,
            on_event=events,
        )
    except PromptTooLong as e:
        raise context_length_exceeded(e.prompt_tokens, e.n_ctx) from None


def _has_tool_messages(req: CompletionRequest) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in req.messages)


def _submit_turn(state: ServerState, session: Session, req: CompletionRequest, events: JobEvents) -> JobView:
    """The next turn of a stored session, as long as the request or else the session's settings allow;
    job.result is a SavedReply (where it was stored; not `store`: nowhere). It waits in the queue with
    every other reply, behind the session's earlier turns; cancelled before its first token (its client
    left), it stores nothing. The session's KV stays in RAM only as cached blocks once it ended, so that
    no session holds the pool: the next turn takes them back (or reads them from the database)."""
    engine = state.engine

    def on_event(event: Event) -> None:
        if event.kind == "end" and isinstance(event.job.error, ReplyNotStored):  # the client still gets it
            say(f"session {session.id}: {event.job.error}")
        events(event)

    try:
        return engine.reply(
            session,
            req.messages[-1]["content"],
            settings=req.sampling,
            max_tokens=longest(session.sampling, engine.n_ctx) if req.max_tokens is None else req.max_tokens,
            stop=req.stop,
            store=req.store,
            on_event=on_event,
            keep_kv=False,
            drop_unanswered=True,
        )
    except ValueError as e:  # an empty message
        raise invalid(f"The new message cannot be used: {e}.", param="messages") from None
    except StoreError as e:  # deleted meanwhile
        if e.brief is not None:  # the database failed, not the request
            raise
        raise session_not_found(str(e)) from None


async def kept_where(job: JobView) -> Kept:
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


def _failure(job: JobView, kept: Kept) -> ApiError | None:
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


async def whole(request: Request, job: JobView, events: JobEvents) -> Kept | None:
    """The end of a reply sent whole: where it was kept; None when the client left first (its job is
    cancelled: nobody will read the reply). ApiError when the job has no reply to send."""
    if not await ended_or_gone(request, events):
        job.cancel()
        return None
    kept = await kept_where(job)
    failure = _failure(job, kept)
    if failure is not None:
        raise failure
    return kept


class StreamShape(Protocol):
    """What a stream says at each point of its job: the chunks it opens with, those of each piece of
    text (or of thinking) an alternative made, and those it closes with once the job ended well."""

    def opening(self) -> list[dict]: ...

    def text(self, alt: int, text: str) -> list[dict]: ...

    def thinking(self, alt: int, text: str) -> list[dict]: ...

    def closing(self, kept: Kept) -> list[dict]: ...


def event_stream(
    job: JobView, events: JobEvents, shape: StreamShape, headers: dict | None = None
) -> Response:
    """The job's events as server-sent events, in `shape`, then [DONE]. An error after the stream began
    comes as an error object, as OpenAI's does; a client that leaves cancels the job."""

    async def chunks() -> AsyncIterator[str]:
        try:
            for chunk in shape.opening():
                yield _data(chunk)
            async for event in events:
                if event.kind in ("text", "thinking") and event.text:
                    shown = shape.text if event.kind == "text" else shape.thinking
                    for chunk in shown(event.alt, event.text):
                        yield _data(chunk)
            kept = await kept_where(job)
            failure = _failure(job, kept)
            if failure is not None:  # an error object, as OpenAI's streams send one, then the end
                yield _data({**failure.body(), **kept.fields()})
                yield "[DONE]"
                return
            for chunk in shape.closing(kept):
                yield _data(chunk)
            yield "[DONE]"
        finally:
            if not job.state.ended:  # the client left (its task was cancelled) or the server is stopping
                job.cancel()

    return EventSourceResponse(chunks(), headers=headers, shutdown_grace_period=CLOSING_GRACE_S)


class _ChatStream:
    """A chat completion's stream: a first chunk per alternative, its text as it comes, its
    finish_reason, usage if asked for. With tools (a splitter per alternative), the text up to a tool
    call streams as content, and the calls as OpenAI's deltas carry them: an id and a name, then the
    arguments in pieces. Asked for, the log-probabilities of the tokens drawn since the last chunk come
    with each chunk."""

    def __init__(
        self,
        job: JobView,
        reply: Reply,
        include_usage: bool,
        engine: ChatEngine,
        splitters: list[CallSplitter | None],
        fmt: ToolFormat | None,
        logprobs: _Logprobs | None = None,
    ):
        self.job, self.reply, self.include_usage, self.engine = job, reply, include_usage, engine
        self.splitters, self.fmt = splitters, fmt
        self.more = logprobs.new if logprobs is not None else lambda i: {}
        self.calls: list[dict[int, str]] = [{} for _ in range(job.n)]  # each alternative's call ids by index

    def opening(self) -> list[dict]:
        return [self.reply.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.job.n)]

    def text(self, alt: int, text: str) -> list[dict]:
        splitter = self.splitters[alt]
        return self._deltas(alt, [Delta(text)] if splitter is None else splitter.feed(text))

    def thinking(self, alt: int, text: str) -> list[dict]:
        """As llama.cpp's server streams it (--reasoning-format deepseek): reasoning_content deltas."""
        return [self.reply.chunk(alt, {"reasoning_content": text}, **self.more(alt))]

    def closing(self, kept: Kept) -> list[dict]:
        out = []
        for i, splitter in enumerate(self.splitters):
            out += self._deltas(i, splitter.finish() if splitter is not None else [])
        for i, stats in enumerate(self.job.stats):
            finish = finish_reason(stats, bool(self.calls[i]))
            out.append(self.reply.chunk(i, {}, finish, **kept.fields(), **self.more(i)))
        if self.include_usage:
            out.append(self.reply.usage_chunk(self.job.stats, kept, kv_remote(self.engine, self.job)))
        return out

    def _deltas(self, alt: int, deltas: list[Delta]) -> list[dict]:
        return [
            self.reply.chunk(alt, _delta(delta, self.calls[alt], self.fmt), **self.more(alt))
            for delta in deltas
            if delta.content or delta.index >= 0
        ]


class _Logprobs:
    """A stream's log-probabilities: those of each alternative's tokens not sent yet."""

    def __init__(self, job: JobView, tokenizer):
        self.job, self.tokenizer = job, tokenizer
        self.sent = [0] * job.n

    def new(self, alt: int) -> dict:
        entries = self.job.stats[alt].logprobs[self.sent[alt] :]  # the scheduler's thread appends meanwhile
        self.sent[alt] += len(entries)
        return {"logprobs": token_logprobs(self.tokenizer, entries)}


def _delta(delta: Delta, call_ids: dict[int, str], fmt: ToolFormat | None) -> dict:
    """A stream's delta as OpenAI writes it; a call's first one carries its id (the one the model
    wrote, else a new one) and its name."""
    if delta.index < 0:
        return {"content": delta.content}
    function = {"arguments": delta.arguments}
    call = {"index": delta.index, "function": function}
    if delta.name is not None:
        call_ids[delta.index] = call["id"] = delta.id or fmt.new_id()
        call["type"], function["name"] = "function", delta.name
    return {"tool_calls": [call]}


def _data(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)
