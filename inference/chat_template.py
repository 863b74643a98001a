"""Rendering a model's Jinja chat template in a sandbox, the way HuggingFace transformers does."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ModelError

# The format of Qwen and many other instruct models; used when a model's file carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateError(ModelError):
    """A chat template that cannot be compiled or rendered; the message names the template in one line."""


class _RaisedByTemplate(Exception):
    """What the template's own raise_exception() throws; render() turns it into a TemplateError."""


def _raise_exception(message: Any) -> None:
    raise _RaisedByTemplate(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain json.dumps (as transformers).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body.

    transformers uses the tag to find which tokens the assistant wrote, for training masks; for inference the
    body is all that matters.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox: templates can neither change their inputs nor reach Python internals."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja's sandbox answers an unsafe attribute (``x.__class__``) with an undefined value that prints as
        # an empty string; refuse at once instead, so that probing the sandbox is an error, not silence.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Mirrors transformers' _compile_jinja_template: the immutable sandbox, trim_blocks/lstrip_blocks,
    # loop controls, the {% generation %} tag and the same globals and filters.
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# One environment serves every template: it holds no per-template state.
_ENV = _make_environment()


class ChatTemplate:
    """A compiled chat template; render() turns a list of messages into the prompt text."""

    def __init__(
        self, source: str | None, *, bos_token: str = "", eos_token: str = "", name: str = "chat template"
    ) -> None:
        self.source = CHATML_TEMPLATE if source is None else source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        if not self.source.strip():
            # An empty template would render an empty prompt, and the model would answer nothing sensible.
            raise TemplateError(f"{name}: is empty")
        try:
            self._template = _ENV.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            reason = f"{_one_line(e.message or '')} (line {e.lineno})"
            raise TemplateError(f"{name}: does not compile: {reason}") from None
        except Exception as e:  # e.g. RecursionError on absurdly nested input
            raise TemplateError(f"{name}: does not compile: {_reason(e)}") from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`; `extra` adds or overrides template variables (e.g. enable_thinking)."""
        context: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        context.update(extra)
        try:
            return self._template.render(context)
        except _RaisedByTemplate as e:
            raise TemplateError(f"{self.name}: {_one_line(str(e)) or 'raised an exception'}") from None
        except SecurityError as e:
            where = self._where(e)
            raise TemplateError(f"{self.name}: blocked by the sandbox{where}: {_reason(e)}") from None
        except Exception as e:  # a template can fail in any Python way (TypeError, UndefinedError, ...)
            raise TemplateError(f"{self.name}: failed to render{self._where(e)}: {_reason(e)}") from None

    def _where(self, e: BaseException) -> str:
        """Where in the template `e` happened, " at line N (source text)", so the error says where to look."""
        lineno = None
        tb = e.__traceback__
        while tb is not None:
            # Jinja rewrites tracebacks so that frames of template code carry the template's line numbers.
            if tb.tb_frame.f_code.co_filename == "<template>":
                lineno = tb.tb_lineno
            tb = tb.tb_next
        lines = self.source.splitlines()
        if lineno is None or not 1 <= lineno <= len(lines):
            return ""
        text = _one_line(lines[lineno - 1])
        if len(text) > 60:
            text = text[:57] + "..."
        return f" at line {lineno} ({text})" if text else f" at line {lineno}"


def completion_prompt(messages: list[dict]) -> str:
    """The prompt for a base model without a chat template: the messages' text, joined plainly.

    A base model only continues text, so role markers like "User:" would invite it to write both sides of a
    made-up dialogue. Instead the prompt is the system text, then the conversation: each user message starts a
    new paragraph, and each assistant message follows the text before it with nothing in between, because
    it *is* the model's continuation of that text. The prompt therefore ends with the last user text, which
    the model continues, and the next turn's prompt starts with exactly the text the model saw and wrote.
    """
    parts: list[str] = []
    for message in messages:
        text = _content_text(message.get("content"))
        if not text:
            continue
        if parts and message.get("role") != "assistant":
            parts.append("\n\n")
        parts.append(text)
    return "".join(parts)


def content_texts(messages: list[dict]) -> list[str]:
    """The text of every message's content."""
    return [_content_text(m.get("content")) for m in messages]


def map_contents(messages: list[dict], change: Callable[[str], str]) -> list[dict]:
    """Copies of the messages with `change` applied to the text of their contents (a string, or the
    text parts of a list); everything else as it was."""

    def part(p: Any) -> Any:
        return (
            {**p, "text": change(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
        )

    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            m = {**m, "content": change(content)}
        elif isinstance(content, list):
            m = {**m, "content": [change(p) if isinstance(p, str) else part(p) for p in content]}
        out.append(m)
    return out


def _content_text(content: Any) -> str:
    # Content is usually a string, but OpenAI-style messages may carry a list of typed parts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _reason(e: BaseException) -> str:
    text = _one_line(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
