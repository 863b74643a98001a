"""Files attached to a message (`ask -f`, `/attach` in `chat`): read, checked, and put in the message.

A file goes in whole, as text, with its name (storage/fragments.py's inline form, which stores its text
once however many messages carry it). Files come first in the message, before what the user typed:
two conversations that start with the same files then share every KV block of them, whatever
question follows (measured in docs/tools.md: benchmarks/attachments.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from llama_chat.storage.fragments import inline

MAX_FILE_BYTES = 1 << 20  # 1 MiB: about 250,000 tokens, already far beyond any context window here
SNIFF_BYTES = 8192  # a NUL byte in the first this many bytes: a binary file (as git and grep decide)


class AttachmentError(ValueError):
    """A file that cannot be attached: one line naming it and why."""


@dataclass
class Attachment:
    name: str  # as the model sees it: the path as given, or "stdin"
    text: str

    def inline(self) -> str:
        return inline(self.name, self.text)


def read_attachment(path: str, stdin=None) -> Attachment:
    """A text file (or stdin, for '-'), refused in one line if it cannot be read, is larger than
    MAX_FILE_BYTES, or is not text (a NUL byte, or not UTF-8)."""
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            data = (stdin or sys.stdin).buffer.read(MAX_FILE_BYTES + 1)
        else:
            with Path(path).open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise AttachmentError(f"{name}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise AttachmentError(f"{name}: larger than {MAX_FILE_BYTES // 2**20} MiB, the limit for an attached file")
    if b"\0" in data[:SNIFF_BYTES]:
        raise AttachmentError(f"{name}: a binary file; only text files can be attached")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AttachmentError(f"{name}: not UTF-8 text; only text files can be attached") from None
    return Attachment(name, text)


def with_attachments(text: str, attachments: list[Attachment]) -> str:
    """A message carrying these files, then the user's text."""
    return "".join(a.inline() for a in attachments) + text
