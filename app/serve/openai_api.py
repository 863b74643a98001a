"""OpenAI's Chat Completions as this server reads and writes them: a request checked field by field
into a CompletionRequest, and the shapes of replies, chunks and usage that clients expect.

Fields a real client sends are read; OpenAI fields this server cannot honour are accepted only at
their neutral value (no tools, no logprobs, plain text) and refused otherwise, as unknown fields are,
so that a request never silently means something else here than there.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field

from llama_chat.inference import GenerationStats
from llama_chat.storage import StoreError

from ..chat.settings import SAMPLING, SettingError
from .errors import invalid

MAX_N = 8  # alternatives of one request (each a reply decoded in the same batch)
MAX_STOP = 4  # stop strings, as OpenAI allows
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# OpenAI fields that change nothing here whatever they say (we already cache prompts, and store by default).
IGNORED = {"user", "metadata", "service_tier", "safety_identifier", "parallel_tool_calls", "moderation"}
IGNORED |= {"prompt_cache_retention", "prompt_cache_options"}
# OpenAI fields this server cannot honour: accepted only when absent, null or one of these values.
NEUTRAL = {
    "frequency_penalty": [0],
    "presence_penalty": [0],
    "logprobs": [False],
    "top_logprobs": [0],
    "tools": [[]],
    "tool_choice": ["none", "auto"],
    "functions": [[]],
    "function_call": ["none", "auto"],
    "logit_bias": [{}],
    "response_format": [{"type": "text"}],
    "modalities": [["text"]],
    "audio": [],
    "prediction": [],
    "web_search_options": [],
    "reasoning_effort": [],
    "verbosity": [],
}
READ = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop", "n"}
READ |= {"store", "session", "prompt_cache_key", *(s.key for s in SAMPLING)}  # llama.cpp's top_k, min_p, repeat_penalty too


@dataclass
class CompletionRequest:
    model: str
    messages: list[dict]  # {"role": system/user/assistant, "content": text}, as the chat template wants
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None: as much as the context window leaves
    sampling: dict = field(default_factory=dict)  # the settings given: a session keeps its own others
    stop: list[str] = field(default_factory=list)
    n: int = 1
    session: str | None = None  # a stored session to append the last user message to
    store: bool = True  # keep the conversation (and its KV) in the database
    prompt_cache_key: str | None = None  # requests share KV only with those of the same key (and tenant)


def parse_completion(body: dict, header_session: str | None = None) -> CompletionRequest:
    """A request body checked and read; ApiError (400) names the first field that is wrong."""
    for name in body:
        if name not in READ and name not in IGNORED and name not in NEUTRAL:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name)
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise invalid(f"'{name}' is not supported by this server (leave it out).", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the name of a model from GET /v1/models.", param="model")
    request = CompletionRequest(model, parse_messages(body.get("messages")))
    request.stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("'stream_options' may hold only 'include_usage'.", param="stream_options")
        request.include_usage = _flag(options, "include_usage", False, "stream_options.include_usage")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _number(body, name, 1, 1 << 30, integer=True)
        request.max_tokens = value if value is not None else request.max_tokens
    request.sampling = _sampling(body)
    request.stop = _stop(body.get("stop"))
    request.n = _number(body, "n", 1, MAX_N, integer=True) or 1
    request.store = _flag(body, "store", True)
    request.session = _session(body.get("session"), header_session)
    request.prompt_cache_key = text_field(body, "prompt_cache_key")
    if request.session is not None:
        if request.messages[-1]["role"] != "user":
            raise invalid("With a session, the last message must be the user's new one.", param="messages")
        if request.n > 1:
            raise invalid("'n' above 1 cannot be used with a session.", param="n")
    return request


def _sampling(body: dict) -> dict:
    """The sampling settings given, checked as every front end checks them (chat.settings)."""
    given = {}
    for setting in SAMPLING:
        if body.get(setting.key) is not None:
            try:
                given[setting.key] = setting.check(body[setting.key])
            except SettingError as e:
                raise invalid(f"{e}.", param=setting.key) from None
    if given.get("seed", 0) < 0:
        raise invalid(f"seed must be 0 or more, not {given['seed']}.", param="seed")
    return given


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages.", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{where}' must be an object with 'role' and 'content'.", param=where)
        role = m.get("role")
        if role not in ROLES:
            supported = ", ".join(ROLES)
            raise invalid(f"'{where}.role' must be one of {supported}, not {role!r}.", param=f"{where}.role")
        if m.get("tool_calls") or m.get("function_call"):
            raise invalid("Tool calls are not supported by this server.", param=f"{where}.tool_calls")
        out.append({"role": ROLES[role], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (other kinds of parts are refused)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"'{where}' may only hold text parts here.", param=where)
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"'{where}' must be a string or a list of text parts.", param=where)
    return _text(content, where)


def _text(value: str, where: str) -> str:
    try:
        value.encode("utf-8")  # JSON may escape lone surrogates, which no tokenizer or database takes
    except UnicodeError:
        raise invalid(f"'{where}' is not valid Unicode text.", param=where) from None
    return value


def _flag(body: dict, name: str, default: bool, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{where or name}' must be true or false.", param=where or name)
    return value


def _number(body: dict, name: str, low, high, integer: bool):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise invalid(f"'{name}' must be {kind} from {low} to {high}, not {value!r}.", param=name)
    return value


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) for s in stops):
        raise invalid(f"'stop' must be a string or a list of at most {MAX_STOP} strings.", param="stop")
    return [_text(s, "stop") for s in stops if s]


def text_field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(f"'{name}' must be a string.", param=name)
    return None if value is None else _text(value, name)


def _session(body_value, header_value: str | None) -> str | None:
    if body_value is not None and not isinstance(body_value, str):
        raise invalid("'session' must be a session id (a string).", param="session")
    if body_value and header_value and body_value != header_value:
        raise invalid("The body's 'session' and the X-Session-Id header name different sessions.", "session")
    return body_value or header_value or None


# -- what the server sends back ------------------------------------------------------------------------


@dataclass
class Kept:
    """Where a reply was stored: its session (None: nowhere), and why not where it was to be (a full
    disk: then the client holds the only copy)."""

    session: str | None = None
    error: StoreError | None = None

    def fields(self) -> dict:
        """What a completion, its last chunks and its usage chunk say of it."""
        out = {"session": self.session, "stored": self.session is not None}
        if self.error is not None:
            out["store_error"] = f"The reply was not stored: {self.error.brief or 'see the server log'}."
        return out

    @property
    def error_code(self) -> str | None:
        """The X-Store-Error header of a reply not stored where it was to be."""
        if self.error is None:
            return None
        return "disk_full" if self.error.full else "storage_error"


@dataclass
class Reply:
    """What every message of one completion shares."""

    model: str
    system_fingerprint: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, object_type: str) -> dict:
        return {
            "id": self.id,
            "object": object_type,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def completion(
        self, texts: list[str], stats: list[GenerationStats], kept: Kept, kv_remote: dict | None = None
    ) -> dict:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason(s),
            }
            for i, (text, s) in enumerate(zip(texts, stats, strict=True))
        ]
        return {
            **self._head("chat.completion"), "choices": choices, "usage": usage(stats, kv_remote), **kept.fields()
        }

    def chunk(self, index: int, delta: dict, finish: str | None = None, **extra) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None, **extra}

    def usage_chunk(self, stats: list[GenerationStats], kept: Kept, kv_remote: dict | None = None) -> dict:
        return {
            **self._head("chat.completion.chunk"), "choices": [], "usage": usage(stats, kv_remote), **kept.fields()
        }


def finish_reason(stats: GenerationStats) -> str:
    """OpenAI's names: "length" when the token limit (or the context window) ended it, else "stop"."""
    return "length" if stats.stop_reason == "length" else "stop"


def usage(stats: list[GenerationStats], kv_remote: dict | None = None) -> dict:
    """Tokens of the prompt (counted once for n alternatives), of the replies, and how many of the
    prompt's came from the KV cache (RAM, the database or the remote tier) rather than being computed;
    with a remote tier, its numbers as `kv_remote` (clients ignore a field they do not know)."""
    prompt = stats[0].prompt_tokens
    completion = sum(s.generated_tokens for s in stats)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": prompt - stats[0].prefilled_tokens},
    }
    if kv_remote is not None:
        out["kv_remote"] = kv_remote
    return out
