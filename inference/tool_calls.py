"""Tool calls in the Hermes format that Qwen2.5, Qwen3 and Hermes models are trained on (llama.cpp's
common/chat.cpp calls it COMMON_CHAT_FORMAT_HERMES_2_PRO): the chat template renders the tools, the
model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Here: whether a template speaks it, the grammar that makes a reply one or more such calls (when a
call is required), and the reply's text split into its content and its calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .chat_template import ChatTemplate

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Arguments written as the template's tojson writes them back (json.dumps): the round trip renders the
# tokens the model wrote, so the next request reuses their KV.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    name: str
    arguments: dict  # the JSON object the model wrote


def call_text(calls: list[dict]) -> str:
    """OpenAI `tool_calls` as the model writes them (what Qwen's template renders them as)."""
    bodies = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        bodies.append(f"{OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CLOSE}")
    return "\n".join(bodies)


def takes_tools(template: ChatTemplate) -> bool:
    """The template renders `tools` and asks for calls in this format (a template without either would
    drop the tools silently, or ask for a format this module does not read)."""
    return "tools" in template.source and OPEN in template.source


def call_grammar(tools: list[dict], name: str | None = None, several: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) of replies made of one call (or, `several`, one or more) of
    `tools` (OpenAI function definitions), or of the one named; its arguments valid under its parameters.
    Written as the template writes a call back, so the round trip renders the same tokens."""
    rules, choices = [], []
    for i, tool in enumerate(t["function"] for t in tools):
        if name is not None and tool["name"] != name:
            continue
        schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": COMPACT}
        head = f'{OPEN}\n{{"name": {json.dumps(tool["name"])}, "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + CLOSE)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        choices.append(f"call_{i}")
    start = 'start: call ("\\n" call)*' if several else "start: call"
    return "\n".join([start, "call: " + " | ".join(choices), *rules])


def split_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    """The reply's content (before its first call) and its calls; None when it holds no call, or one
    that is not a JSON object with a name and object arguments (then the whole text is the content)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    content, rest, calls = text[:start], text[start:], []
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(OPEN) or CLOSE not in rest:
            return None
        body, rest = rest[len(OPEN) :].split(CLOSE, 1)
        call = _call(body)
        if call is None:
            return None
        calls.append(call)
    return content.strip(), calls


# Small models often write a call as a JSON object in a Markdown fence instead; llama.cpp's Hermes
# parser takes that form too (its open_regex: an optional ```json fence before `{"name"`).
_FENCED = re.compile(r"```(?:json|xml)?\n\s*(\{.*?\})\s*```", re.DOTALL)


def split_offered_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    """split_calls(), or else the fenced JSON calls in the text, of tools offered (`names`) only: a
    fence of JSON is also what a model writes when asked for JSON, not a call. The content is the text
    before the first call."""
    parsed = split_calls(text)
    if parsed is not None:
        return parsed
    fenced = [(m.start(), _call(m.group(1))) for m in _FENCED.finditer(text)]
    calls = [(at, call) for at, call in fenced if call is not None and call.name in names]
    if not calls:
        return None
    return text[: calls[0][0]].strip(), [call for _, call in calls]


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


@dataclass
class Delta:
    """A piece of a streamed reply with tools: content, or the start of call `index` (its name), or a
    piece of its arguments (JSON text)."""

    content: str = ""
    index: int = -1
    name: str | None = None
    arguments: str = ""


# A call's text up to its arguments: what the template writes, with any whitespace a model adds.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class CallSplitter:
    """split_calls() as the text streams: content goes out as it comes, up to the first call. Calls
    constrained by call_grammar (`constrained`) parse by construction, so each one's name goes out
    once written and its arguments as they come, as OpenAI streams them; other calls are held until
    the reply ends and go out whole once they parse, else as content."""

    def __init__(self, constrained: bool = False) -> None:
        self.constrained = constrained
        self.held = ""  # text that is, or may be the start of, a call
        self.calling = False
        self.at = 0  # constrained: how much of `held` went out
        self.state = "open"  # constrained: "open" (next: a call), "head" (its name), "arguments"
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        """What of `text` can go out now."""
        if self.calling:
            self.held += text
            return self._calls() if self.constrained else []
        text = self.held + text
        at = text.find(OPEN)
        if at >= 0:
            self.calling, self.held = True, text[at:]
            return _content(text[:at]) + (self._calls() if self.constrained else [])
        keep = _partial_open(text)  # "<tool" at the end may be a call beginning
        self.held = text[len(text) - keep :] if keep else ""
        return _content(text[: len(text) - keep])

    def finish(self) -> list[Delta]:
        """What is left: held content, or the calls (none if the held text does not parse)."""
        if not self.calling:
            return _content(self.held)
        if self.constrained:
            return []  # a call cut short (by the token limit): finish_reason says "length"
        parsed = split_calls(self.held)
        if parsed is None:
            return _content(self.held)
        deltas = []
        for index, call in enumerate(parsed[1]):
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            deltas += [Delta(index=index, name=call.name), Delta(index=index, arguments=arguments)]
        return deltas

    def _calls(self) -> list[Delta]:
        out = []
        while True:
            rest = self.held[self.at :]
            if self.state == "open":
                stripped = rest.lstrip()
                if not stripped.startswith(OPEN):
                    return out
                self.at += len(rest) - len(stripped) + len(OPEN)
                self.state = "head"
            elif self.state == "head":
                head = _HEAD.match(rest)
                if head is None:
                    return out
                out.append(Delta(index=self.calls, name=json.loads(f'"{head.group(1)}"')))
                self.at += head.end()
                self.state = "arguments"
            else:
                close = rest.find(CLOSE)
                if close >= 0:  # the arguments end with the call object's closing brace
                    out.append(Delta(index=self.calls, arguments=rest[:close].rstrip()[:-1]))
                    self.at += close + len(CLOSE)
                    self.calls += 1
                    self.state = "open"
                    continue
                last = rest.rfind("}")  # may be the call object's closing brace: it waits
                cut = last if last >= 0 and CLOSE.startswith(rest[last + 1 :].lstrip()) else len(rest)
                if cut:
                    out.append(Delta(index=self.calls, arguments=rest[:cut]))
                self.at += cut
                return out


def _content(text: str) -> list[Delta]:
    return [Delta(text)] if text else []


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` are a proper start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
