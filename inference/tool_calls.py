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


def takes_tools(template: ChatTemplate) -> bool:
    """The template renders `tools` and asks for calls in this format (a template without either would
    drop the tools silently, or ask for a format this module does not read)."""
    return "tools" in template.source and OPEN in template.source


def call_grammar(tools: list[dict], name: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect) of replies made of one or more calls of `tools` (OpenAI
    function definitions), or of the one named; each call's arguments valid under its parameters schema.
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
    return "\n".join(['start: call ("\\n" call)*', "call: " + " | ".join(choices), *rules])


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


class CallSplitter:
    """split_calls() as the text streams: content goes out as it comes, up to the first call; what
    follows is held until the reply ends (a call is sent whole, once it is known to parse)."""

    def __init__(self) -> None:
        self.held = ""  # text that is, or may be the start of, a call
        self.calling = False

    def feed(self, text: str) -> str:
        """The content of `text` that can go out now."""
        if self.calling:
            self.held += text
            return ""
        text = self.held + text
        at = text.find(OPEN)
        if at >= 0:
            self.calling, self.held = True, text[at:]
            return text[:at]
        keep = _partial_open(text)  # "<tool" at the end may be a call beginning
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left of the content, and the calls (none if the held text does not parse)."""
        if not self.calling:
            return self.held, []
        parsed = split_calls(self.held)
        return ("", parsed[1]) if parsed is not None else (self.held, [])


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` are a proper start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
