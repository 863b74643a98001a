"""A reply with tools as it streams (tool_calls.py's formats): its content goes out as it comes, up to
where its calls begin; calls constrained by the format's grammar parse by construction, so each one's
name (and id) goes out once written and its arguments as they come, as OpenAI streams them; other
calls are held until the reply ends and go out whole once they parse, else as content."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_calls import HERMES, ToolFormat


@dataclass
class Delta:
    """A piece of a streamed reply with tools: content, or the start of call `index` (its name, and its
    id when the format's model writes one), or a piece of its arguments (JSON text)."""

    content: str = ""
    index: int = -1
    name: str | None = None
    arguments: str = ""
    id: str | None = None


# A call's text up to its arguments: what the template writes, with any whitespace a model adds.
_HEAD = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"%s"\s*:\s*(?=\S)'


class CallSplitter:
    """fmt.split() as the text streams. `constrained`: the reply follows fmt.grammar(), whose calls
    carry `ids` (formats with ids)."""

    def __init__(self, fmt: ToolFormat = HERMES, constrained: bool = False, ids: list[str] | None = None):
        self.fmt, self.constrained, self.ids = fmt, constrained, ids or []
        self.head = re.compile(_HEAD % re.escape(fmt.arguments))
        self.text = ""  # the reply so far
        self.sent = 0  # how much of it went out as content
        self.calling = False  # the calls began (at `sent`)
        self.at = 0  # constrained: how much of the calls went out
        self.scan: _JsonEnd | None = None  # constrained: the arguments being written; None: a head next
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        """What of `text` can go out now."""
        self.text += text
        if self.calling:
            return self._calls() if self.constrained else []
        start = self.fmt.begins.search(self.text, self.sent, partial=True)
        if start is None:  # nor can this text begin any (a format whose calls come first: never again)
            return self._content(len(self.text))
        out = self._content(start.start())  # a partial match: what may begin the calls waits
        if not start.partial:
            self.calling, self.at = True, start.end()
            out += self._calls() if self.constrained else []
        return out

    def finish(self) -> list[Delta]:
        """What is left: held content, or the calls (none if the held text does not parse)."""
        if not self.calling:
            return self._content(len(self.text))
        if self.constrained:
            return []  # a call cut short (by the token limit): finish_reason says "length"
        parsed = self.fmt.split(self.text[self.sent :])
        if parsed is None:
            return self._content(len(self.text))
        deltas = []
        for index, call in enumerate(parsed[1]):
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            deltas += [Delta(index=index, name=call.name, id=call.id), Delta(index=index, arguments=arguments)]
        return deltas

    def _content(self, upto: int) -> list[Delta]:
        text, self.sent = self.text[self.sent : upto], upto
        return [Delta(text)] if text else []

    def _calls(self) -> list[Delta]:
        out = []
        while True:
            if self.scan is None:
                head = self.head.search(self.text, self.at)
                if head is None:
                    return out
                call_id = self.ids[self.calls] if self.calls < len(self.ids) else None
                out.append(Delta(index=self.calls, name=json.loads(f'"{head.group(1)}"'), id=call_id))
                self.at, self.scan = head.end(), _JsonEnd()
            end = self.scan.find(self.text, self.at)
            upto = len(self.text) if end is None else end
            if upto > self.at:
                out.append(Delta(index=self.calls, arguments=self.text[self.at : upto]))
            self.at = upto
            if end is None:
                return out
            self.scan, self.calls = None, self.calls + 1


class _JsonEnd:
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
