"""Files attached to a message (`ask -f`, `/attach` in `chat`): read, checked, and put in the message.

A file goes in whole, as text, with its name (storage/fragments.py's inline form, which stores its text
once however many messages carry it). Files come first in the message, before what the user typed:
two conversations that start with the same files then share every KV block of them, whatever
question follows (measured in docs/tools.md: benchmarks/attachments.py).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from llama_chat.storage.fragments import inline

MAX_FILE_BYTES = 1 << 20  # 1 MiB: about 250,000 tokens, already far beyond any context window here
SNIFF_BYTES = 8192  # a NUL byte in the first this many bytes: a binary file (as git and grep decide)


class AttachmentError(ValueError):
    """A file that cannot be attached: one line naming it and why."""


@dataclass
class Attachment:
    name: str  # as the model sees it: the path as given (the app: named_in), or "stdin"
    text: str

    def inline(self) -> str:
        return inline(self.name, self.text)


def named_in(path: Path, folder: Path) -> str:
    """The name a file picked by its whole path goes by, as `chat` started in `folder` names it when
    typed there: its path from `folder` when it is below it, else its file name alone (the folders
    above it tell the model nothing about the file)."""
    path = Path(os.path.abspath(path))
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else path.name


def read_attachment(path: str, stdin=None, name: str | None = None) -> Attachment:
    """A text file (or stdin, for '-'), refused in one line if it cannot be read, is not a regular file
    (a FIFO, a socket, a device, a folder), is larger than MAX_FILE_BYTES, or is not text (a NUL byte,
    or not UTF-8). It goes by `name` (default: the path as given)."""
    given = name
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            data = (stdin or sys.stdin).buffer.read(MAX_FILE_BYTES + 1)
        else:
            with _open_regular_file(path) as f:
                data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        kind = _not_a_file(path)
        if kind:  # (a socket cannot even be opened)
            raise AttachmentError(f"{name}: {kind}, not a file; only files can be attached") from None
        raise AttachmentError(f"{name}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise AttachmentError(
            f"{name}: larger than {MAX_FILE_BYTES // 2**20} MiB, the limit for an attached file"
        )
    if b"\0" in data[:SNIFF_BYTES]:
        raise AttachmentError(f"{name}: a binary file; only text files can be attached")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AttachmentError(f"{name}: not UTF-8 text; only text files can be attached") from None
    return Attachment(given or name, text)


def _open_regular_file(path: str) -> BinaryIO:
    """The file at `path`, opened without waiting: a FIFO with no writer would block open() for ever,
    and a device would be read as if it were a file. OSError for anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file")
    return f


def _not_a_file(path: str) -> str | None:
    """What is at `path` when it is there but not a regular file: "a FIFO", "a socket", ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a folder"))  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), None)


def with_attachments(text: str, attachments: list[Attachment]) -> str:
    """A message carrying these files, then the user's text."""
    return "".join(a.inline() for a in attachments) + text
