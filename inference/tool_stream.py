"""A reply with tools as it streams (tool_calls.py's formats): its content goes out as it comes, up to
where its calls begin; calls constrained by the format's grammar parse by construction, so each one's
name (and id) goes out once written and its arguments as they come, as OpenAI streams them; other
calls are held until the reply ends and go out whole once they parse (split_offered_calls, as a reply
sent whole is read), else as content. JSON that may be a call of an offered tool (bare or fenced) is
held until it closes: then it is a call, or content that goes out."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .tool_calls import HERMES, LOOSE_CALL, JsonEnd, ToolFormat, loose_call, split_offered_calls


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
    """split_offered_calls() as the text streams: calls in `fmt`, or of the tools `offered` in JSON.
    `constrained`: the reply follows fmt.grammar(), whose calls carry `ids` (formats with ids)."""

    def __init__(
        self,
        fmt: ToolFormat = HERMES,
        constrained: bool = False,
        ids: list[str] | None = None,
        offered: set[str] = frozenset(),
    ):
        self.fmt, self.constrained, self.ids, self.offered = fmt, constrained, ids or [], offered
        self.head = fmt.call_head or re.compile(_HEAD % re.escape(fmt.arguments))
        self.text = ""  # the reply so far
        self.sent = 0  # how much of it went out as content
        self.scan = 0  # where calls may begin: what begins before it was found to be content
        self.calling = False  # the calls began (at `sent`)
        self.at = 0  # constrained: how much of the calls went out
        self.value: JsonEnd | None = None  # constrained: the arguments being written; None: a head next
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        """What of `text` can go out now."""
        self.text += text
        out = [] if self.calling else self._content_until_calls()
        if self.calling and self.constrained:
            out += self._calls()
        return out

    def finish(self) -> list[Delta]:
        """What is left: held content, or the calls (none if the held text does not parse)."""
        if not self.calling:
            return self._content(len(self.text))
        if self.constrained:
            return []  # a call cut short (by the token limit): finish_reason says "length"
        parsed = split_offered_calls(self.text[self.sent :], self.offered, self.fmt)
        if parsed is None:
            return self._content(len(self.text))
        deltas = [Delta(parsed[0])] if parsed[0] else []  # (JSON that was no call, before a tagged one)
        for index, call in enumerate(parsed[1]):
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            deltas += [
                Delta(index=index, name=call.name, id=call.id),
                Delta(index=index, arguments=arguments),
            ]
        return deltas

    def _content_until_calls(self) -> list[Delta]:
        """The content up to where the calls begin (then `calling`), or may yet begin: what may be the
        start of the format's calls, or JSON that may be an offered call, waits."""
        while True:
            self.scan = max(self.scan, self.sent)
            start = self.fmt.begins.search(self.text, self.scan, partial=True)
            loose = (
                LOOSE_CALL.search(self.text, self.scan, partial=True)
                if self.offered and not self.constrained
                else None
            )
            if loose is not None and (start is None or loose.start() < start.start()):
                call, end = (None, -1) if loose.partial else loose_call(self.text, loose, self.offered)
                if call is None and end >= 0:  # JSON, not a call: content, and calls may begin inside it
                    self.scan = loose.start() + 1
                    continue
                out = self._content(loose.start())
                self.calling = call is not None
                return out
            if start is None:  # nor can this text begin any (a format whose calls come first: never again)
                return self._content(len(self.text))
            out = self._content(start.start())  # a partial match: what may begin the calls waits
            if not start.partial:
                self.calling, self.at = True, start.end()
            return out

    def _content(self, upto: int) -> list[Delta]:
        text, self.sent = self.text[self.sent : upto], upto
        return [Delta(text)] if text else []

    def _calls(self) -> list[Delta]:
        out = []
        while True:
            if self.value is None:
                head = self.head.search(self.text, self.at)
                if head is None:
                    return out
                call_id = self.ids[self.calls] if self.calls < len(self.ids) else None
                out.append(Delta(index=self.calls, name=json.loads(f'"{head.group(1)}"'), id=call_id))
                self.at, self.value = head.end(), JsonEnd()
            end = self.value.find(self.text, self.at)
            upto = len(self.text) if end is None else end
            if upto > self.at:
                out.append(Delta(index=self.calls, arguments=self.text[self.at : upto]))
            self.at = upto
            if end is None:
                return out
            self.value, self.calls = None, self.calls + 1
