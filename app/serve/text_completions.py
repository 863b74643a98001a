"""POST /v1/completions: OpenAI's legacy Completions, as evaluation scripts and editors still call it.
The prompt is raw text (or token ids) the model goes on from, with no chat template; it goes through
the chat engine as a RawText, so it shares the KV cache (per tenant) as chat requests do, and the
same limits, queue, errors and disconnect handling as /v1/chat/completions (completions.py).

Log-probabilities come in that API's own shape: `tokens`, `token_logprobs`, `top_logprobs` (a dict
of token text → logprob per token) and `text_offset` (each token's place in the choice's text)."""

from __future__ import annotations

import codecs
import secrets
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llama_chat.inference import GenerationStats

from ..chat.engine import ChatEngine, RawText
from ..chat.jobs import JobView
from ..chat.replies import PromptTooLong
from ..chat.settings import SAMPLING
from .completions import event_stream, kv_remote, refuse_when_full, submitted, whole
from .errors import context_length_exceeded, invalid
from .openai_api import check_fields, flag, model_of, number, read_generation, text_field, unicode_text
from .openai_replies import Kept, Reply, finish_reason, usage
from .state import ServerState
from .transport import JobEvents, read_json, tenant_of

DEFAULT_MAX_TOKENS = 16  # OpenAI's, for this API
MAX_LOGPROBS = 5  # the likeliest tokens per position, as OpenAI allows here
READ = {"model", "prompt", "stream", "stream_options", "max_tokens", "stop", "n", "echo", "logprobs"}
READ |= {"prompt_cache_key"} | {s.key for s in SAMPLING}  # llama.cpp's top_k, min_p, repeat_penalty too
# Fields this server cannot honour: accepted only when absent, null or one of these values.
NEUTRAL = {
    "suffix": [""],  # text after the completion (insertion): not done here
    "best_of": [1],
    "frequency_penalty": [0],
    "presence_penalty": [0],
    "logit_bias": [{}],
}


@dataclass
class TextRequest:
    model: str
    prompt: str | list[int]  # text, or token ids
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: dict = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    echo: bool = False  # the prompt's text before each completion's
    logprobs: int | None = None  # each token's log-probability and the n likeliest; None: not asked
    prompt_cache_key: str | None = None  # requests share KV only with those of the same key (and tenant)


def parse_text_completion(body: dict) -> TextRequest:
    """A request body checked and read; ApiError (400) names the first field that is wrong."""
    check_fields(body, READ, NEUTRAL)
    request = TextRequest(model_of(body), _prompt(body.get("prompt")))
    read_generation(body, request)
    request.echo = flag(body, "echo", False)
    request.logprobs = number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
    if request.echo and request.logprobs is not None:
        raise invalid(
            "'echo' with 'logprobs' asks for the prompt's log-probabilities, which this server does not "
            "compute; leave one of them out.",
            param="echo",
        )
    request.prompt_cache_key = text_field(body, "prompt_cache_key")
    return request


def _prompt(value) -> str | list[int]:
    """One prompt: a string, or token ids, alone or as a list of one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return unicode_text(value, "prompt")
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise invalid(
            f"'prompt' holds {len(value)} prompts; this server completes one per request (send one "
            "request each, or use 'n' for several completions of one prompt).",
            param="prompt",
        )
    raise invalid("'prompt' must be a string, a list of one string, or a list of token ids.", param="prompt")


# -- what the server sends back ------------------------------------------------------------------------


@dataclass
class TextReply(Reply):
    """What every message of one text completion shares."""

    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))

    def choice(self, index: int, text: str, logprobs: dict | None, finish: str | None = None) -> dict:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def text_completion(self, choices: list[dict], stats: list[GenerationStats], remote: dict | None) -> dict:
        return {**self._head("text_completion"), "choices": choices, "usage": usage(stats, remote)}

    def text_chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {**self._head("text_completion"), "choices": choices, "usage": usage}


class LegacyLogprobs:
    """Each alternative's tokens' log-probabilities as this API gives them, those drawn since it was
    last asked; `start`: where the completion's text begins in the choice's (after an echoed prompt).
    A token's offset counts the whole characters before it, as the text shows them."""

    def __init__(self, job: JobView, tokenizer, n_top: int, start: int = 0):
        self.job, self.tokenizer, self.n_top = job, tokenizer, n_top
        self.sent = [0] * job.n
        self.offsets = [start] * job.n
        self.utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(job.n)]

    def new(self, alt: int) -> dict:
        entries = self.job.stats[alt].logprobs[self.sent[alt] :]  # the scheduler's thread appends meanwhile
        self.sent[alt] += len(entries)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            top: dict[str, float] = {}
            for token, logprob in e.top[: self.n_top]:
                top.setdefault(self._text(token), logprob)  # two tokens of one text: the likelier
            top.setdefault(self._text(e.token), e.logprob)  # the drawn token always, as OpenAI gives it
            out["tokens"].append(self._text(e.token))
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets[alt])
            self.offsets[alt] += len(self.utf8[alt].decode(self.tokenizer.token_bytes(e.token)))
        return out

    def _text(self, token: int) -> str:
        """A token's text; one that holds part of a character is written by its bytes, as OpenAI does
        ("bytes:\\xe2\\x80"), so that no two tokens read the same."""
        data = self.tokenizer.token_bytes(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class _TextStream:
    """A text completion's stream (completions.event_stream): the echoed prompt first, if asked; each
    alternative's text as it comes, with its tokens' log-probabilities if asked; its finish_reason;
    usage if asked for."""

    def __init__(
        self,
        job: JobView,
        reply: TextReply,
        echo: str,
        logprobs: LegacyLogprobs | None,
        include_usage: bool,
        engine: ChatEngine,
    ):
        self.job, self.reply, self.echo, self.logprobs = job, reply, echo, logprobs
        self.include_usage, self.engine = include_usage, engine

    def opening(self) -> list[dict]:
        if not self.echo:
            return []
        return [self.reply.text_chunk([self.reply.choice(i, self.echo, None)]) for i in range(self.job.n)]

    def thinking(self, alt: int, text: str) -> list[dict]:
        return []  # a raw prompt's continuation is never told apart

    def text(self, alt: int, text: str) -> list[dict]:
        return [self.reply.text_chunk([self.reply.choice(alt, text, self._logprobs(alt))])]

    def closing(self, kept: Kept) -> list[dict]:
        out = [
            self.reply.text_chunk([self.reply.choice(i, "", self._logprobs(i), finish_reason(stats))])
            for i, stats in enumerate(self.job.stats)
        ]
        if self.include_usage:
            out.append(self.reply.text_chunk([], usage(self.job.stats, kv_remote(self.engine, self.job))))
        return out

    def _logprobs(self, alt: int) -> dict | None:
        return self.logprobs.new(alt) if self.logprobs is not None else None


async def text_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_text_completion(
        await read_json(request, state.options.max_body, state.options.body_timeout_s)
    )
    state.check_model(req.model)
    engine = state.ready()
    events, tenant = JobEvents(), tenant_of(request)
    job = await run_in_threadpool(submitted, lambda: _submit(engine, req, events, tenant))
    reply = TextReply(req.model, "llama-chat-" + engine.model_info.fingerprint[:12])
    echo = _echoed(engine, req.prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = LegacyLogprobs(job, engine.model_info.tokenizer, req.logprobs, len(echo))
    if req.stream:
        return event_stream(job, events, _TextStream(job, reply, echo, logprobs, req.include_usage, engine))
    if await whole(request, job, events) is None:
        return Response(status_code=499)
    choices = [
        reply.choice(i, echo + job.text(i), logprobs.new(i) if logprobs else None, finish_reason(stats))
        for i, stats in enumerate(job.stats)
    ]
    return JSONResponse(reply.text_completion(choices, job.stats, kv_remote(engine, job)))


def _submit(engine: ChatEngine, req: TextRequest, events: JobEvents, tenant: str | None) -> JobView:
    """The request's completions, as a job of the chat engine; nothing of it is stored."""
    refuse_when_full(engine)  # before a long prompt is tokenized
    try:
        return engine.reply(
            RawText(req.prompt, tenant, req.prompt_cache_key),
            n=req.n,
            settings=req.sampling,
            logprobs=req.logprobs,
            max_tokens=req.max_tokens,
            stop=req.stop,
            store=False,
            on_event=events,
        )
    except PromptTooLong as e:
        raise context_length_exceeded(e.prompt_tokens, e.n_ctx, param="prompt") from None
    except ValueError as e:  # token ids out of the vocabulary, an empty prompt
        raise invalid(f"'prompt' cannot be used: {e}.", param="prompt") from None


def _echoed(engine: ChatEngine, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else engine.model_info.tokenizer.decode(prompt)
