"""Rendering a model's Jinja chat template in a sandbox, the way HuggingFace transformers does."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .errors import ModelError

# The format of Qwen and many other instruct models; used when a model's file carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Bounds on one render, so that a hostile template in a GGUF fails in one line instead of running for
# minutes or taking gigabytes. Steps are loop iterations, calls, filters and tests (nested range()
# loops, recursion); characters are every string or list a template builds, reads in a call or a
# comparison, or writes (repetition, the new part of a concatenation, slices, replace(), the output);
# the time limit catches what neither counts (a string grown a little at every step is copied whole
# each time). Real templates use a few thousand steps, a few times their messages' length in
# characters, and milliseconds.
MAX_STEPS = 1_000_000
TIME_LIMIT_S = 10.0
MACRO_STEPS = 16  # a macro call takes as long as this many loop steps
MAX_CHARS = 64 << 20  # plus CHARS_PER_INPUT for each character of the messages
CHARS_PER_INPUT = 16
MAX_ARGUMENT = 100_000  # the largest count or width a call may ask for (Jinja's own cap on range())


class TemplateError(ModelError):
    """A chat template that cannot be compiled or rendered; the message names the template in one line."""


class _OverBudget(Exception):
    """A render that went past one of the bounds above; render() names the template and the bound."""


class _Budget:
    """What one render may still spend: steps, characters and time."""

    def __init__(self, chars: int, seconds: float):
        self.steps = MAX_STEPS
        self.chars = self.limit = chars
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise _OverBudget(f"more than {MAX_STEPS:,} loop steps and calls")
        if time.monotonic() >= self.deadline:
            raise _OverBudget(f"still running after {self.seconds:g} s")

    def afford(self, size: int) -> None:
        if size > self.chars:
            raise _OverBudget(f"it would build more than {self.limit:,} characters")

    def charge(self, size: int) -> None:
        self.afford(size)
        self.chars -= size

    def spend(self, value: Any) -> Any:
        self.charge(_size(value))
        return value


# The budget of the render running in this thread; a context variable, out of the template's reach.
_BUDGET: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _size(value: Any) -> int:
    """Characters (or items) a value holds, as far as building it costs; 0 for anything else."""
    if isinstance(value, str | bytes | list | tuple | dict):
        return len(value)
    return 0


def _check_size(number: int) -> int:
    if number > MAX_ARGUMENT:
        raise _OverBudget(f"asks for a size of {number:,} (at most {MAX_ARGUMENT:,})")
    return number


def _check_format(fmt: str) -> None:
    """A format string's widths and precisions count as sizes asked for: '%999999999s', '{:>999999999}'."""
    for digits in re.findall(r"\d{6,}", fmt):  # only long runs of digits can be over the cap
        _check_size(int(digits))


def _largest_argument(values: Iterable[Any]) -> int:
    """The largest size among a call's arguments (a count, a width, a string's length), once none of
    the numbers asks for more than the cap."""
    largest = 0
    for v in values:
        number = abs(v) if isinstance(v, int) and not isinstance(v, bool) else 0
        largest = max(largest, _check_size(number), _size(v))
    return largest


def _guarded_call(value: Any, run: Callable[[], Any], arguments: list[Any], name: str, steps: int = 1) -> Any:
    """Run a call, filter or test on `value` within the budget: what it can make at most (its value's
    size times its largest argument: replace(), join(), indent(), center()) must fit before it runs;
    reading the value and what it made are spent."""
    budget = _BUDGET.get()
    budget.step(steps)
    if name in ("format", "format_map") and isinstance(value, str):
        _check_format(value)
    budget.afford(_size(value) * (1 + _largest_argument(arguments)))
    budget.spend(value)
    return budget.spend(run())


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    """A loop's items, each one step."""
    budget = _BUDGET.get()
    for item in iterable:
        budget.step()
        yield item


def _spent(value: Any) -> Any:
    return _BUDGET.get().spend(value)


def _concat(*parts: Any) -> str:
    """`a ~ b ~ ...`, spending what is new: all but the longest part (a string grown piece by piece
    spends each piece once; one doubled at each step spends its whole length)."""
    texts = [str(p) for p in parts]  # as Jinja's own `~` does
    sizes = [len(t) for t in texts]
    _BUDGET.get().charge(sum(sizes) - max(sizes, default=0))
    return "".join(texts)


class _Metered(NodeTransformer):
    """Makes loops count their items, and `~`, slices and comparisons spend the characters they build
    or read: plain Jinja runs them without calling anything the sandbox could watch."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, "_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        first, *rest = node.nodes
        return jinja2.nodes.Filter(first, "_concat", rest, [], None, None, lineno=node.lineno)

    def visit_Getitem(self, node: jinja2.nodes.Getitem) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        return _spending(node) if isinstance(node.arg, jinja2.nodes.Slice) else node  # a slice is a copy

    def visit_Compare(self, node: jinja2.nodes.Compare) -> jinja2.nodes.Node:
        # `a in b` and `a == b` read both strings: each operand spends its size as it is evaluated
        node = self.generic_visit(node)
        node.expr = _spending(node.expr)
        for operand in node.ops:
            operand.expr = _spending(operand.expr)
        return node


def _spending(node: jinja2.nodes.Expr) -> jinja2.nodes.Expr:
    return jinja2.nodes.Filter(node, "_spent", [], [], None, None, lineno=node.lineno)


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
    """The immutable sandbox: templates can neither change their inputs nor reach Python internals,
    and spend no more than a render's budget."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if operator == "*":
            times = right if isinstance(right, int) else left if isinstance(left, int) else 1
            budget.charge((_size(left) + _size(right)) * max(times, 0))  # 'A' * 4000000000
        elif operator == "+":
            budget.charge(min(_size(left), _size(right)))  # what is new, as for `~`
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            budget.charge(max(right, 0) * abs(left).bit_length() // 8)  # the result's bytes
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            _largest_argument(right if isinstance(right, tuple) else [right])  # '%*s' % (999999999, x)
            return budget.spend(super().call_binop(context, operator, left, right))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop: count those too
            args = (_counted(args[0]), *args[1:])
        # a bound method's object is what it works on ('x'.center(n)); str.format comes wrapped by Jinja
        method = getattr(__obj, "__wrapped__", __obj)
        run = functools.partial(super().call, __context, __obj, *args, **kwargs)
        target, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        steps = MACRO_STEPS if isinstance(__obj, Macro) else 1
        return _guarded_call(target, run, [*args, *kwargs.values()], name, steps)

    def getitem(self, obj: Any, argument: Any) -> Any:
        item = super().getitem(obj, argument)
        return _spent(item) if isinstance(argument, slice) else item  # a slice is a copy

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
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.tests = {name: _guarded_filter(name, f) for name, f in env.tests.items()}
    del env.globals["lipsum"]  # pages of made-up Latin, slow to make: no chat template writes any
    env.filters["_counted"] = _counted
    env.filters["_spent"] = _spent
    env.filters["_concat"] = _concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _guarded_filter(name: str, f: Callable) -> Callable:
    """A filter (or test) that runs within the render's budget, as calls do."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # (context or environment,) value

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        value = args[skip - 1] if len(args) >= skip else None
        arguments = [*args[skip:], *kwargs.values()]
        return _guarded_call(value, lambda: f(*args, **kwargs), arguments, name)

    return guarded


# One environment serves every template: it holds no per-template state.
_ENV = _make_environment()


class ChatTemplate:
    """A compiled chat template; render() turns a list of messages into the prompt text."""

    time_limit_s = TIME_LIMIT_S  # how long one render may run

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
            self._template = _ENV.from_string(_Metered().visit(_ENV.parse(self.source)))
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
        budget = _Budget(
            MAX_CHARS + CHARS_PER_INPUT * sum(map(len, content_texts(messages))), self.time_limit_s
        )
        token = _BUDGET.set(budget)
        try:
            return "".join(budget.spend(piece) for piece in self._template.generate(context))
        except _OverBudget as e:
            raise TemplateError(f"{self.name}: stopped{self._where(e)}: {e}") from None
        except _RaisedByTemplate as e:
            raise TemplateError(f"{self.name}: {_one_line(str(e)) or 'raised an exception'}") from None
        except SecurityError as e:
            where = self._where(e)
            raise TemplateError(f"{self.name}: blocked by the sandbox{where}: {_reason(e)}") from None
        except Exception as e:  # a template can fail in any Python way (TypeError, UndefinedError, ...)
            raise TemplateError(f"{self.name}: failed to render{self._where(e)}: {_reason(e)}") from None
        finally:
            _BUDGET.reset(token)

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
