"""Text from outside a chat template kept from becoming control tokens: every string of the messages
and the tools a template renders (contents, tool names, descriptions, schemas, enums, call arguments,
tool results) has its control-token text hidden while the template runs, and tokenized as plain text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import regex

from .errors import ModelError

# Unicode's private-use code points: no tokenizer gives them a meaning, so they can stand in for text.
_PRIVATE_USE = (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE))


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value: itself, or the keys and items of its dicts and lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings(item)


class ControlTextShield:
    """Control-token text (``<|im_start|>``) anywhere in what a template is given, hidden behind
    private-use characters while it renders, so that only the template's own markup becomes control
    tokens: no message, tool definition or call can forge a turn. Tokenizer.encode(..., shield=) turns
    the hidden text back into text, tokenized as llama.cpp tokenizes with parse_special off.

    Each hidden token text gets a private-use character found in none of the strings, so what was
    written comes back exactly; the template sees no control text in them (nor their length).
    """

    def __init__(self, control_texts: list[str], outside: Any):
        joined = "\n".join(strings(outside))
        present = [t for t in control_texts if t in joined]
        taken = set(joined) if present else set()
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in taken)
        self._placeholder = dict(zip(present, free, strict=False))
        if len(self._placeholder) < len(present):
            raise ModelError(
                "a message uses every private-use character; it cannot be told from the template"
            )
        self._text = {ord(ch): text for text, ch in self._placeholder.items()}
        # longest first, as llama.cpp cuts special tokens out of a text
        alternatives = sorted(present, key=len, reverse=True)
        self._pattern = regex.compile("|".join(map(regex.escape, alternatives))) if alternatives else None

    def hide(self, value: Any) -> Any:
        """A copy of a JSON-like value with the control text of each of its strings (keys too) hidden."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: self._placeholder[m.group()], value)
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(item) for item in value]
        return value

    @property
    def placeholders(self) -> dict[str, str]:
        """Each control text hidden, and the character that stands for it."""
        return dict(self._placeholder)

    def hides_in(self, text: str) -> bool:
        return bool(self._text) and any(ch in text for ch in self._placeholder.values())

    def reveal(self, text: str) -> str:
        return text.translate(self._text)
