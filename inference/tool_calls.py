"""Tool calls in the formats llama.cpp's common/chat.cpp reads for our architectures, each chosen from
the chat template as chat.cpp chooses it (the first whose marker the template's source holds):

    Hermes 2 Pro (Qwen2.5, Qwen3, Hermes):  <tool_call>
                                            {"name": "get_weather", "arguments": {"city": "Paris"}}
                                            </tool_call>
    Llama 3.x (3.1, 3.2, 3.3):              {"name": "get_weather", "parameters": {"city": "Paris"}}
    Mistral Nemo:                           [TOOL_CALLS][{"name": "get_weather", "arguments": {...},
                                                          "id": "a1B2c3D4e"}]
    harmony (gpt-oss):                      to=functions.get_weather<|channel|>commentary json<|message|>
                                            {"city": "Paris"}

Here: which format a template speaks, the text a call is written as (what the template renders a
call as, so a continued conversation reuses its KV), the grammar that makes a reply calls (when a call
is required), and a reply's text split into its content and its calls. Streaming: tool_stream.py.

Llama 3.x's builtin tools (`<|python_tag|>brave_search.call(query="...")`, chat.cpp's
LLAMA_3_X_WITH_BUILTIN_TOOLS) are not read: a function offered as a tool is called in JSON, as
llama.cpp's Llama 3.x format calls it; a `<|python_tag|>` before that JSON is taken.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import regex

if TYPE_CHECKING:  # (they load gguf and Jinja2: the app parses calls, and draws its window, before a model)
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer

# Arguments written as the template's tojson writes them back (json.dumps): the round trip renders the
# tokens the model wrote, so the next request reuses their KV.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CALLS = 8  # calls a required reply may make, in a format whose ids the grammar writes
_ID_CHARS = string.ascii_letters + string.digits
_ID = regex.compile(r"[A-Za-z0-9]{9}")  # Mistral Nemo's template refuses any other call id
_ID_KEY, _ANY_ID = json.dumps(', "id": '), r'"\"" /[A-Za-z0-9]{9}/ "\""'  # in Lark


@dataclass
class ToolCall:
    name: str
    arguments: dict  # the JSON object the model wrote
    id: str | None = None  # the id the model wrote (Mistral Nemo); None: the server gives one


@dataclass(frozen=True)
class ToolFormat:
    """How a family of models writes its calls: each call a JSON object {"name", `arguments`}, between
    `call_open` and `call_close`, the calls joined by `between`, all of them between `opening` and
    `closing`. `begins` finds where a reply's calls begin (its match ends where `opening` does)."""

    name: str  # llama.cpp's COMMON_CHAT_FORMAT_* name
    marker: str  # in a template's source: the template speaks this format
    begins: regex.Pattern
    opening: str = ""
    call_open: str = ""
    call_close: str = ""
    between: str = ""
    closing: str = ""
    arguments: str = "arguments"
    with_id: bool = False  # each call carries an id the model writes: 9 letters and digits
    one_call: bool = False  # the template renders one call per reply
    control: str = ""  # the control token `opening` starts with, in the vocabularies that have it
    template_vars: dict = field(default_factory=dict)  # what llama.cpp gives the template besides tools
    call_head: regex.Pattern | None = None  # where a call's arguments begin, group 1 its name; None: JSON's

    def call_text(self, calls: list[dict]) -> str:
        """OpenAI `tool_calls` as the model writes them (and the template renders them)."""
        bodies = []
        for call in calls:
            function = call["function"]
            arguments = function.get("arguments") or "{}"
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            value = {"name": function["name"], self.arguments: arguments}
            if self.with_id:
                value["id"] = call.get("id")
            bodies.append(self.call_open + json.dumps(value, ensure_ascii=False) + self.call_close)
        return self.opening + self.between.join(bodies) + self.closing

    def as_message(self, text: str) -> dict:
        """A reply as the client sends it back: its calls as `tool_calls`, where they parse (and carry
        the ids the template takes), so the template renders the tokens the next request will."""
        parsed = self.split(text)
        if parsed is None or self.with_id and not all(_ID.fullmatch(c.id or "") for c in parsed[1]):
            return {"role": "assistant", "content": text}
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed[1]
        ]
        return {"role": "assistant", "content": parsed[0], "tool_calls": calls}

    def new_id(self) -> str:
        """An id for a call the model wrote none for: what this format's template takes."""
        if self.with_id:
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """The reply's content (before its calls) and its calls; None when it holds no call, or calls
        that do not parse, or text after them (then the whole text is the content)."""
        start = self.begins.search(text)
        if start is None:
            return None
        at, calls, decoder = start.end(), [], json.JSONDecoder()
        while True:
            at = _expect(text, at, self.call_open)
            try:
                value, at = decoder.raw_decode(text, _skip_space(text, at))
            except json.JSONDecodeError:
                return None
            call = _call(value)
            if call is None:
                return None
            calls.append(call)
            at = _expect(text, at, self.call_close)
            if at < 0 or self.one_call:
                break
            separator = self.between.strip() or self.call_open.strip()  # (Hermes: the next call's tag)
            if not separator or not text.startswith(separator, _skip_space(text, at)):
                break
            at = _skip_space(text, at) + (len(separator) if self.between.strip() else 0)
        at = _expect(text, at, self.closing)
        if at < 0 or text[at:].strip():
            return None
        return text[: start.start()].strip(), calls

    def grammar(
        self,
        tools: list[dict],
        name: str | None = None,
        several: bool = False,
        ids: list[str] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> str:
        """A Lark grammar (llguidance's dialect) of replies made of one call (or, `several`, one or more)
        of `tools` (OpenAI function definitions), or of the one named; its arguments valid under its
        parameters, written as the template writes a call back, so the round trip renders the same
        tokens. A format with ids gives call k ids[k] (without ids, any the template takes); the
        opening's control token is that token."""
        rules, heads = [], []
        for i, tool in enumerate(t["function"] for t in tools):
            if name is not None and tool["name"] != name:
                continue
            schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": COMPACT}
            head = self.call_open + f'{{"name": {json.dumps(tool["name"])}, "{self.arguments}": '
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
            heads.append(f"{json.dumps(head)} args_{i}")
        several = several and not self.one_call
        if self.with_id:  # each call's own id: a rule per place, nested (call_0 ("," call_1 ...)?)
            places = (ids or [None] * MAX_CALLS)[: MAX_CALLS if several else 1]
            chain = ""
            for k in reversed(range(len(places))):
                written = json.dumps(json.dumps(places[k])) if places[k] else _ANY_ID
                tail = f"{_ID_KEY} {written} {json.dumps('}' + self.call_close)}"
                rules.append(f"call_{k}: " + " | ".join(f"{head} {tail}" for head in heads))
                chain = f"call_{k}" + (f" ({json.dumps(self.between)} {chain})?" if chain else "")
            calls = chain
        else:
            rules.append(
                "call: " + " | ".join(f"{head} {json.dumps('}' + self.call_close)}" for head in heads)
            )
            calls = f"call ({json.dumps(self.between)} call)*" if several else "call"
        opening = _literal(self.opening, self.control, tokenizer)
        start = " ".join(
            part for part in (opening, calls, json.dumps(self.closing) if self.closing else "") if part
        )
        return "\n".join([f"start: {start}", *rules])


HERMES = ToolFormat(
    "Hermes 2 Pro",
    marker="<tool_call>",
    begins=regex.compile(r"(?=<tool_call>)"),
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    between="\n",
)
# Called only at the start of a reply (chat.cpp's function_regex_start_only): JSON after some text is text.
LLAMA_3_X = ToolFormat(
    "Llama 3.x",
    marker="<|start_header_id|>ipython<|end_header_id|>",
    begins=regex.compile(r'\A\s*(?:<\|python_tag\|>\s*)?(?=\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name")'),
    arguments="parameters",
    one_call=True,  # its template refuses more ("This model only supports single tool-calls at once!")
    template_vars={"tools_in_user_message": False},  # the tools in the system message, as llama.cpp
)
MISTRAL_NEMO = ToolFormat(
    "Mistral Nemo",
    marker="[TOOL_CALLS]",
    begins=regex.compile(r"\[TOOL_CALLS\]\s*\["),
    opening="[TOOL_CALLS][",
    between=", ",
    closing="]",
    with_id=True,
    control="[TOOL_CALLS]",
)


class HarmonyFormat(ToolFormat):
    """gpt-oss's calls (harmony): a message to `functions.NAME` on the commentary channel, its arguments
    the message, one call a reply (the template renders one). Read in either order harmony allows
    (`to=` in the header or after the channel, as chat.cpp reads them, the `<|start|>assistant` that
    follows a thought or not); written, and constrained, as the template renders a call back."""

    def call_text(self, calls: list[dict]) -> str:
        function = calls[0]["function"]
        arguments = function.get("arguments") or "{}"
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        return self._header(function["name"]) + json.dumps(arguments, ensure_ascii=False)

    @staticmethod
    def _header(name: str) -> str:
        return f" to=functions.{name}<|channel|>commentary json<|message|>"

    def split(self, text: str) -> tuple[str, list[ToolCall]] | None:
        head = self.call_head.search(text)
        if head is None:
            return None
        try:
            arguments, end = json.JSONDecoder().raw_decode(text, _skip_space(text, head.end()))
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict) or text[end:].strip() not in ("", "<|call|>"):
            return None
        return text[: head.start()].strip(), [ToolCall(head.group("name"), arguments)]

    def grammar(self, tools, name=None, several=False, ids=None, tokenizer=None) -> str:
        """One call of `tools` (or of the one named), its arguments valid under its parameters, its
        header's markers the tokens the template renders."""
        rules, heads = [], []
        for i, tool in enumerate(t["function"] for t in tools):
            if name is not None and tool["name"] != name:
                continue
            schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": COMPACT}
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
            heads.append(f"{_markers_as_tokens(self._header(tool['name']), tokenizer)} args_{i}")
        return "\n".join(["start: " + " | ".join(heads), *rules])


def _markers_as_tokens(text: str, tokenizer: Tokenizer | None) -> str:
    """`text` in Lark, each `<|…|>` marker that is one token of the vocabulary as that token."""
    pieces = []
    for piece in regex.split(r"(<\|[a-z]+\|>)", text):
        marker = tokenizer is not None and piece.startswith("<|")
        ids = tokenizer.encode(piece, special=True) if marker else []
        pieces.append(f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(piece) if piece else "")
    return " ".join(p for p in pieces if p)


HARMONY = HarmonyFormat(
    "GPT-OSS",
    marker="<|channel|>",
    begins=regex.compile(
        r"(?=(?:<\|start\|>assistant)?[ \t]*(?:to=functions\.|<\|channel\|>commentary to=functions\.))"
    ),
    one_call=True,
    call_head=regex.compile(
        r"(?:<\|start\|>assistant)?\s*(?:to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary"
        r"|<\|channel\|>commentary\s+to=functions\.(?P<name>[^\s<]+))"
        r"\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>"
    ),
)
FORMATS = (HERMES, LLAMA_3_X, MISTRAL_NEMO, HARMONY)  # in the order chat.cpp tries them


def tool_format(template: ChatTemplate) -> ToolFormat | None:
    """The format the template asks for calls in, if it renders `tools` in one this module reads (a
    template without either would drop the tools silently, or ask for a format not read here)."""
    if "tools" not in template.source:
        return None
    return next((f for f in FORMATS if f.marker in template.source), None)


def call_ids(fmt: ToolFormat, several: bool) -> list[str] | None:
    """The ids a required reply's calls will carry, for a format whose model writes them: chosen
    before the reply, so that a stream can send each call's id with its name, as OpenAI's do."""
    return [fmt.new_id() for _ in range(MAX_CALLS if several else 1)] if fmt.with_id else None


def _literal(text: str, control: str, tokenizer: Tokenizer | None) -> str:
    """`text` in Lark; a leading control token as that token (llguidance never writes one as text), so
    the reply holds the token the template renders."""
    if not text:
        return ""
    if control and tokenizer is not None and text.startswith(control):
        from .tokenizer import ATTR_CONTROL  # (loaded with the model, as the tokenizer is)

        ids = tokenizer.encode(control, special=True)
        if len(ids) == 1 and tokenizer.attrs(ids[0]) & ATTR_CONTROL:
            rest = text[len(control) :]
            return f"<[{ids[0]}]>" + (f" {json.dumps(rest)}" if rest else "")
    return json.dumps(text)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _expect(text: str, at: int, literal: str) -> int:
    """Where `literal` (its own spaces loose, as models write them) ends after `at`; -1 if it is not there."""
    if at < 0:
        return -1
    literal = literal.strip()
    if not literal:
        return at
    at = _skip_space(text, at)
    return at + len(literal) if text.startswith(literal, at) else -1


def _call(value) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    call_id = value.get("id") if isinstance(value.get("id"), str) else None
    return ToolCall(value["name"], arguments, call_id) if isinstance(arguments, dict) else None


def split_offered_calls(
    text: str, names: set[str], fmt: ToolFormat = HERMES
) -> tuple[str, list[ToolCall]] | None:
    """The one reading of a reply's calls, for every front end: fmt.split(), or else the calls of tools
    offered (`names`) written as a bare JSON object or in a ```json fence — how small models often
    write one (llama.cpp's Hermes parser reads both: its open_regex takes an optional fence before
    `{"name"`). Only offered tools: such JSON is also what a model writes when asked for JSON. As in
    every format, the calls end the reply: the content is the text before them; None when there is no
    call, or text after the calls (then the whole text is the content)."""
    parsed = fmt.split(text)
    if parsed is not None:
        return parsed
    at = 0
    while (start := LOOSE_CALL.search(text, at)) is not None:
        call, end = loose_call(text, start, names)
        if call is not None:
            break
        if end < 0:
            return None
        at = start.start() + 1  # an offered call may be inside what is not one
    else:
        return None
    content, calls = text[: start.start()].strip(), [call]
    while (at := _skip_space(text, end)) < len(text):  # only calls follow the first
        start = LOOSE_CALL.match(text, at)
        call, end = loose_call(text, start, names) if start is not None else (None, -1)
        if call is None:
            return None
        calls.append(call)
    return content, calls


# Where a call may begin outside the format's own markers: a JSON object with a name, in a fence or bare.
LOOSE_CALL = regex.compile(r'(?P<fence>```(?:json|xml)?\n\s*)?\{\s*"name"\s*:')
# a call's object holds no other (a tool's definition does)
_CALL_KEYS = {"name", "arguments", "parameters", "id"}


def loose_call(text: str, start: regex.Match, names: set[str]) -> tuple[ToolCall | None, int]:
    """The call of an offered tool that a LOOSE_CALL match begins (None: what it begins is not one),
    and where that ends (past the fence's close); end -1: the text ends first (a stream waits)."""
    fenced = start.group("fence") is not None
    brace = start.end("fence") if fenced else start.start()
    end = JsonEnd().find(text, brace)
    if end is None:
        return None, -1
    try:
        value = json.loads(text[brace:end])
    except json.JSONDecodeError:
        return None, end
    call = _call(value) if isinstance(value, dict) and value.keys() <= _CALL_KEYS else None
    if call is not None and call.name not in names:
        call = None
    if fenced:
        close = _skip_space(text, end)
        if text.startswith("```", close):
            return call, close + 3
        if "```".startswith(text[close:]):  # the fence may close yet
            return None, -1
        return None, end  # JSON in a fence with more after it: not a call
    return call, end


class JsonEnd:
    """Where a JSON value written in pieces ends: its brackets counted, outside its strings."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def find(self, text: str, start: int) -> int | None:
        """The index just past the value's end in text[start:], or None: it goes on past it."""
        for i in range(start, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None
