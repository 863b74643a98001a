"""Attached files stored once: a message keeps a file's text as a reference to a row of `fragments`,
keyed by the text's SHA-256, and reads back whole (simonw's `llm` keeps its -f fragments the same way).

A file goes into a message in its inline form (`inline`), which is what the model reads. When a
message is stored, the text of each inline file is cut out of its content and kept once in
`fragments`; `message_fragments` says where it goes back (a character offset in what is left). Reading
puts it back, so every reader — the chat template, export, the transcript — sees the message as it was
written, and ten conversations that attach one file store its text once. The cut is exact whatever
the text holds, so reading always gives back what was written.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

# One file as a message carries it: its name, then its text, fenced so the model sees where it ends.
_OPEN = '<file name="{name}">\n'
_CLOSE = "\n</file>\n\n"
_INLINE = re.compile(r'<file name="([^"\n]*)">\n(.*?)\n</file>\n\n', re.DOTALL)


def inline(name: str, text: str) -> str:
    """A file's text as it goes into a message, with its name (quotes and line breaks in the name
    become spaces: they would end the header)."""
    name = " ".join(name.replace('"', " ").split())
    return _OPEN.format(name=name) + text + _CLOSE


def brief(content: str) -> str:
    """The content with each inline file as its name in brackets (for a title, a one-line summary)."""
    return _INLINE.sub(lambda m: f"[{m.group(1)}] ", content)


def parts(content: str) -> list[tuple[str | None, str]]:
    """The content in order as (name, text) for each inline file and (None, text) for what is between
    (empty pieces left out): how a screen shows each file apart from what the user wrote."""
    out: list[tuple[str | None, str]] = []
    at = 0
    for match in _INLINE.finditer(content):
        out += [(None, content[at : match.start()])] if match.start() > at else []
        out.append((match.group(1), match.group(2)))
        at = match.end()
    return out + ([(None, content[at:])] if at < len(content) else [])


@dataclass
class Fragment:
    offset: int  # where the text goes back, in the content that is stored
    sha256: str
    text: str


def cut(content: str) -> tuple[str, list[Fragment]]:
    """The content to store, and the texts of its inline files, each with where it goes back."""
    kept, fragments, at = [], [], 0
    size = 0  # of what is kept so far
    for match in _INLINE.finditer(content):
        start, end = match.span(2)
        if start == end:
            continue  # an empty file: nothing to share
        kept.append(content[at:start])
        size += start - at
        text = content[start:end]
        fragments.append(Fragment(size, hashlib.sha256(text.encode("utf-8")).hexdigest(), text))
        at = end
    kept.append(content[at:])
    return "".join(kept), fragments


def save(conn: sqlite3.Connection, message_id: int, fragments: list[Fragment]) -> None:
    """Within the caller's transaction: the texts not stored yet, and where they go in the message."""
    for position, f in enumerate(fragments):
        conn.execute("INSERT OR IGNORE INTO fragments (sha256, content) VALUES (?, ?)", (f.sha256, f.text))
        conn.execute(
            "INSERT INTO message_fragments (message_id, position, offset, sha256) VALUES (?, ?, ?, ?)",
            (message_id, position, f.offset, f.sha256),
        )


def restore(read: Callable[[str, list], list[dict]], rows: list[dict]) -> list[dict]:
    """Message rows (id, content) with the texts of their files put back where they were cut out;
    read(sql, params) runs a query (the store's, which turns a failure into one line)."""
    ids = [r["id"] for r in rows]
    found: dict[int, list[tuple[int, str]]] = {}
    for start in range(0, len(ids), 500):  # SQLite bounds the parameters of one statement
        chunk = ids[start : start + 500]
        for piece in read(
            "SELECT mf.message_id, mf.offset, f.content FROM message_fragments mf "
            "JOIN fragments f ON f.sha256 = mf.sha256 "
            f"WHERE mf.message_id IN ({', '.join('?' * len(chunk))}) ORDER BY mf.message_id, mf.position",
            chunk,
        ):
            found.setdefault(piece["message_id"], []).append((piece["offset"], piece["content"]))
    for row in rows:
        if row["id"] in found:
            row["content"] = _put_back(row["content"], found[row["id"]])
    return rows


def _put_back(content: str, pieces: list[tuple[int, str]]) -> str:
    out, at = [], 0
    for offset, text in pieces:
        out += [content[at:offset], text]
        at = offset
    out.append(content[at:])
    return "".join(out)


# The tables (storage/db.py creates them): a text is dropped with the last message that refers to it.
SCHEMA = """
    CREATE TABLE fragments (
        sha256 TEXT PRIMARY KEY,
        content TEXT NOT NULL
    );
    CREATE TABLE message_fragments (
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        offset INTEGER NOT NULL,
        sha256 TEXT NOT NULL REFERENCES fragments(sha256),
        PRIMARY KEY (message_id, position)
    );
    CREATE INDEX message_fragments_sha256 ON message_fragments(sha256);
    CREATE TRIGGER message_fragments_ad AFTER DELETE ON message_fragments
    WHEN NOT EXISTS (SELECT 1 FROM message_fragments WHERE sha256 = old.sha256) BEGIN
        DELETE FROM fragments WHERE sha256 = old.sha256;
    END;
"""
