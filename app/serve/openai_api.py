"""OpenAI's Chat Completions as this server reads them: a request checked field by field into a
CompletionRequest (what it sends back: openai_replies.py).

Fields a real client sends are read; OpenAI fields this server cannot honour are accepted only at
their neutral value (no frequency or presence penalty, no logit bias) and refused otherwise, as unknown
fields are, so that a request never silently means something else here than there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..chat.settings import REASONING_EFFORT, SAMPLING, SettingError
from .errors import invalid
from .transport import json_value

MAX_N = 8  # alternatives of one request (each a reply decoded in the same batch)
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # as OpenAI allows
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")

# OpenAI fields that change nothing here whatever they say (we already cache prompts, and store by default).
IGNORED = {"user", "metadata", "service_tier", "safety_identifier", "moderation"}
IGNORED |= {"prompt_cache_retention", "prompt_cache_options"}
# OpenAI fields this server cannot honour: accepted only when absent, null or one of these values.
NEUTRAL = {
    "frequency_penalty": [0],
    "presence_penalty": [0],
    "functions": [[]],
    "function_call": ["none", "auto"],
    "logit_bias": [{}],
    "modalities": [["text"]],
    "audio": [],
    "prediction": [],
    "web_search_options": [],
    "verbosity": [],
}
READ = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop", "n"}
READ |= {
    "store",
    "session",
    "prompt_cache_key",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
}
READ |= {"logprobs", "top_logprobs"}
READ |= {"reasoning_effort", "chat_template_kwargs"}
READ |= {s.key for s in SAMPLING}  # llama.cpp's top_k, min_p, repeat_penalty too


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
    tools: list[dict] | None = None  # OpenAI function definitions, for the chat template; None: none offered
    tool_choice: str = "auto"  # "auto", "required" (a call, constrained), or "none"
    tool_name: str | None = None  # the one function a call must be of (tool_choice names it)
    parallel_tool_calls: bool = False  # a required call may be several; off by default, as llama.cpp's
    json_schema: dict | None = None  # response_format: the reply is JSON valid under it
    logprobs: int | None = None  # each token's log-probability and the n likeliest's; None: not asked


def parse_completion(body: dict, header_session: str | None = None) -> CompletionRequest:
    """A request body checked and read; ApiError (400) names the first field that is wrong."""
    check_fields(body, READ, NEUTRAL)
    request = CompletionRequest(model_of(body), parse_messages(body.get("messages")))
    read_generation(body, request)
    request.store = flag(body, "store", True)
    top = number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if flag(body, "logprobs", False):
        request.logprobs = top or 0
    elif top:
        raise invalid("'top_logprobs' needs 'logprobs' to be true.", param="top_logprobs")
    request.session = _session(body.get("session"), header_session)
    request.prompt_cache_key = text_field(body, "prompt_cache_key")
    _tools(body, request)
    request.parallel_tool_calls = flag(body, "parallel_tool_calls", False)
    request.json_schema = _response_format(body.get("response_format"))
    if request.json_schema is not None and request.tools:
        raise invalid("'response_format' and 'tools' cannot be used together here.", param="response_format")
    if request.session is not None:
        if request.messages[-1]["role"] != "user":
            raise invalid("With a session, the last message must be the user's new one.", param="messages")
        if request.n > 1:
            raise invalid("'n' above 1 cannot be used with a session.", param="n")
        if request.logprobs is not None:
            raise invalid("'logprobs' cannot be used with a session.", param="logprobs")
    return request


def check_fields(body: dict, read: set[str], neutral: dict[str, list]) -> None:
    """Refuse a field not `read` nor ignored, and one of the `neutral` set to what it does not mean."""
    for name in body:
        if name not in read and name not in IGNORED and name not in neutral:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name)
    for name, values in neutral.items():
        if body.get(name) is not None and body[name] not in values:
            raise invalid(f"'{name}' is not supported by this server (leave it out).", param=name)


def model_of(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the name of a model from GET /v1/models.", param="model")
    return model


def read_generation(body: dict, request) -> None:
    """What chat and text completions read alike, into `request`: `stream` and its options, the token
    limit, the sampling settings, the stop strings and `n`."""
    request.stream = flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("'stream_options' may hold only 'include_usage'.", param="stream_options")
        request.include_usage = flag(options, "include_usage", False, "stream_options.include_usage")
    for name in ("max_tokens", "max_completion_tokens"):
        value = number(body, name, 1, 1 << 30, integer=True)
        request.max_tokens = value if value is not None else request.max_tokens
    request.sampling = _sampling(body)
    request.stop = _stop(body.get("stop"))
    request.n = number(body, "n", 1, MAX_N, integer=True) or 1


def _sampling(body: dict) -> dict:
    """The reply settings given, checked as every front end checks them (chat.settings)."""
    given = {}
    for setting in (*SAMPLING, REASONING_EFFORT):  # and gpt-oss's effort, under OpenAI's name
        if body.get(setting.key) is not None:
            try:
                given[setting.key] = setting.check(body[setting.key])
            except SettingError as e:
                raise invalid(f"{e}.", param=setting.key) from None
    if given.get("seed", 0) < 0:
        raise invalid(f"seed must be 0 or more, not {given['seed']}.", param="seed")
    return given | _enable_thinking(body)


def _enable_thinking(body: dict) -> dict:
    """llama.cpp's chat_template_kwargs, as far as a setting says it: enable_thinking (`thinking`)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        where = "chat_template_kwargs"
        raise invalid(f"'{where}' may only hold 'enable_thinking' here.", param=where)
    thinking = flag(kwargs, "enable_thinking", None, "chat_template_kwargs.enable_thinking")
    return {} if thinking is None else {"thinking": "on" if thinking else "off"}


def _tools(body: dict, request: CompletionRequest) -> None:
    """`tools` and `tool_choice` checked into the request (the parameters' schemas are compiled later,
    against the model's vocabulary)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("'tools' must be a list of function definitions.", param="tools")
        request.tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)] or None
    names = [t["function"]["name"] for t in request.tools or []]
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or name not in names:
            raise invalid("'tool_choice' must name a function of 'tools'.", param="tool_choice")
        request.tool_choice, request.tool_name = "required", name
    elif choice is not None:
        if choice not in TOOL_CHOICES:
            raise invalid(
                f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a function.", "tool_choice"
            )
        if choice == "required" and not names:
            raise invalid("'tool_choice' is 'required' but no 'tools' were given.", param="tool_choice")
        request.tool_choice = choice
    if request.tool_choice == "none":
        request.tools = None  # nothing offered: the model answers in text


def _tool(tool, where: str) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise invalid(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}.", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(f"'{where}.function.name' must be 1 to 64 letters, digits, _ or -.", param=where)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"'{where}.function.parameters' must be a JSON schema (an object).", param=where)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{where}.function.description' must be a string.", param=where)
    kept = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": {k: v for k, v in kept.items() if v is not None}}


def _response_format(value) -> dict | None:
    """The JSON schema a reply must follow ({"type": "object"} for any JSON object); None for text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid(
                "'response_format.json_schema.schema' must be a JSON schema.", param="response_format"
            )
        return schema
    raise invalid("'response_format.type' must be text, json_object or json_schema.", param="response_format")


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
        if m.get("function_call"):
            raise invalid(
                "'function_call' is not supported: use 'tool_calls'.", param=f"{where}.function_call"
            )
        if role == "assistant" and m.get("tool_calls"):
            # the template writes the calls back as the model wrote them; content may be null then
            content = "" if m.get("content") is None else _content(m["content"], f"{where}.content")
            calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            out.append({"role": "assistant", "content": content, "tool_calls": calls})
            continue
        message = {"role": ROLES[role], "content": _content(m.get("content"), f"{where}.content")}
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls, their arguments read back into objects for the template."""
    if not isinstance(calls, list):
        raise invalid(f"'{where}' must be a list of tool calls.", param=where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise invalid(f"'{where}[{i}]' must have a function with a name and arguments.", param=where)
        arguments = json_value(arguments, f"'{where}[{i}].function.arguments'", param=where)
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts (other kinds of parts are refused)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"'{where}' may only hold text parts here.", param=where)
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"'{where}' must be a string or a list of text parts.", param=where)
    return unicode_text(content, where)


def unicode_text(value: str, where: str) -> str:
    try:
        value.encode("utf-8")  # JSON may escape lone surrogates, which no tokenizer or database takes
    except UnicodeError:
        raise invalid(f"'{where}' is not valid Unicode text.", param=where) from None
    return value


def flag(body: dict, name: str, default: bool, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{where or name}' must be true or false.", param=where or name)
    return value


def number(body: dict, name: str, low, high, integer: bool):
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
    return [unicode_text(s, "stop") for s in stops if s]


def text_field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(f"'{name}' must be a string.", param=name)
    return None if value is None else unicode_text(value, name)


def _session(body_value, header_value: str | None) -> str | None:
    if body_value is not None and not isinstance(body_value, str):
        raise invalid("'session' must be a session id (a string).", param="session")
    if body_value and header_value and body_value != header_value:
        raise invalid("The body's 'session' and the X-Session-Id header name different sessions.", "session")
    return body_value or header_value or None
