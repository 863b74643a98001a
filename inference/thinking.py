"""A reply's thinking told apart from its answer as the text streams: `<think>…</think>` (Qwen3,
DeepSeek-R1 and its distills, QwQ) and the analysis channel of OpenAI's harmony format (gpt-oss), each
a ThinkingFormat, found from the model's chat template.

A reply is read as a head, thinking, a head again, then the answer. At a head, thinking may open
(`opens`), or the answer's own header stand (`answer_header`, skipped), else the answer begins;
thinking runs up to `closes`. Text that may still turn out to be a marker is held until it is known.
The whitespace around the thinking goes, as llama.cpp's `--reasoning-format deepseek` drops it; the
answer keeps every character after its header. A reply to a prompt that ends inside opened thinking
(a template that writes `<think>` itself, as DeepSeek-R1's does) starts in it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import regex

if TYPE_CHECKING:
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer

_SPACE = regex.compile(r"\s*")


@dataclass(frozen=True)
class ThinkingFormat:
    name: str
    opens: str  # a regex: where thinking starts, at a head
    closes: str  # a regex: where it ends, with the whitespace before it
    answer_header: str | None  # a regex: the answer's header at a head, skipped; None: it has none
    message_key: str  # where a chat template reads a past reply's thinking
    markers: tuple[str, ...]  # text in a chat template that says its model writes this format

    def opening(self, text: str, at: int):
        return _compiled(self.opens).match(text, at, partial=True)

    def closing(self, text: str, at: int):
        return _compiled(self.closes).search(text, at, partial=True)

    def header(self, text: str, at: int):
        return _compiled(self.answer_header).match(text, at, partial=True) if self.answer_header else None

    def opened_by(self, prompt_end: str) -> bool:
        """Whether a prompt ending with this text leaves thinking open: the reply starts inside it."""
        return _compiled(rf"(?:{self.opens})\s*\Z").search(prompt_end) is not None


@functools.cache
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


THINK_TAGS = ThinkingFormat(
    "think",
    opens=r"\s*<think>",
    closes=r"\s*</think>",
    answer_header=None,
    message_key="reasoning_content",
    markers=("<think>", "</think>"),
)
# <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…
HARMONY = ThinkingFormat(
    "harmony",
    opens=r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>",
    closes=r"\s*<\|end\|>",
    answer_header=r"(?:<\|start\|>assistant)?<\|channel\|>final<\|message\|>",
    message_key="thinking",
    markers=("<|channel|>analysis",),
)
FORMATS = (HARMONY, THINK_TAGS)  # a harmony template may name <think> too; never the reverse
PROMPT_END_TOKENS = 8  # a prompt's last tokens, enough to hold what opens thinking (`<think>\n`)


def thinking_format(template: ChatTemplate | None) -> ThinkingFormat | None:
    """The thinking a model with this chat template writes; None: none (or no template)."""
    if template is None:
        return None
    return next((f for f in FORMATS if any(m in template.source for m in f.markers)), None)


@dataclass(frozen=True)
class Piece:
    text: str
    thinking: bool  # of the thinking; else of the answer


_HEAD, _THINKING, _ANSWER = "head", "thinking", "answer"


class ThinkingSplitter:
    """A reply's text fed as it streams, handed back as pieces of thinking and of the answer."""

    def __init__(self, fmt: ThinkingFormat, opened: bool = False):
        self.fmt = fmt
        self.text = ""
        self.at = 0  # the text before it was handed back (or dropped)
        self.state = _THINKING if opened else _HEAD
        self.trim = opened  # whitespace at `at` goes: the start of thinking, what follows its end
        self.thought = False  # thinking was handed back: more of it (harmony's) is set apart from it
        self.apart = False

    def feed(self, text: str) -> list[Piece]:
        """What of the reply so far can be handed back now."""
        self.text += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The rest, once the reply ended: text held as a marker's possible start is text after all;
        thinking cut short loses its trailing whitespace."""
        rest, thinking = self.text[self.at :], self.state == _THINKING
        if thinking or self.trim:
            rest = rest.strip()
        out: list[Piece] = []
        self._hand(out, rest, thinking)
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Move past what can be told now; False when the rest waits for more text."""
        text = self.text
        if self.trim:
            self.at = _SPACE.match(text, self.at).end()
            if self.at == len(text):
                return False
            self.trim = False
        if self.state == _ANSWER:
            self._take(out, len(text), False)
            return False
        if self.state == _HEAD:
            return self._head()
        end = self.fmt.closing(text, self.at)
        self._take(out, len(text) if end is None else end.start(), True)
        if end is None or end.partial:
            return False
        self.at, self.state, self.trim = end.end(), _HEAD, True
        return True

    def _head(self) -> bool:
        """Thinking opens, or the answer's header is skipped, or the answer begins; False: either may
        still come."""
        opening, header = self.fmt.opening(self.text, self.at), self.fmt.header(self.text, self.at)
        if opening is not None and not opening.partial:
            self.at, self.state, self.trim = opening.end(), _THINKING, True
            self.apart = self.thought
        elif header is not None and not header.partial:
            self.at, self.state = header.end(), _ANSWER
        elif opening is not None or header is not None:
            return False
        else:
            self.state = _ANSWER
        return True

    def _take(self, out: list[Piece], upto: int, thinking: bool) -> None:
        if upto > self.at:
            self._hand(out, self.text[self.at : upto], thinking)
            self.at = upto

    def _hand(self, out: list[Piece], text: str, thinking: bool) -> None:
        if not text:
            return
        if thinking and self.apart:
            text, self.apart = "\n\n" + text, False
        out.append(Piece(text, thinking))
        self.thought = self.thought or thinking


def reply_splitter(fmt: ThinkingFormat | None, tokenizer: Tokenizer, prompt: list[int]) -> ThinkingSplitter | None:
    """How a reply to `prompt` is told apart (None: its model writes no thinking); it starts inside
    thinking where the prompt's end opened it."""
    if fmt is None:
        return None
    return ThinkingSplitter(fmt, fmt.opened_by(tokenizer.decode(prompt[-PROMPT_END_TOKENS:])))


def split_thinking(fmt: ThinkingFormat | None, text: str, opened: bool = False) -> tuple[str, str]:
    """A whole reply's (thinking, answer), as the splitter hands them back streaming."""
    if fmt is None:
        return "", text
    splitter = ThinkingSplitter(fmt, opened)
    pieces = splitter.feed(text) + splitter.finish()
    thinking = "".join(p.text for p in pieces if p.thinking)
    return thinking, "".join(p.text for p in pieces if not p.thinking)
