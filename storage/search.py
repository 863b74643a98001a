"""Full-text search over the message tree: the newest messages that hold every word, each with the
sessions that reach it; and the sessions whose title holds every word. Its cost is that of the hits,
not of the archive: FTS5 walks its index newest first and stops at the limit (ranked by relevance, it
would score every match of a common word first), and a hit's sessions are found from the hit down to
their heads, not from every session's path; titles are found by their index of trigrams (db.py)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable

from .connection import StoreConnection
from .db import StoreError
from .records import Message, Session


def find(
    connection: StoreConnection, messages: Callable[[str, tuple], list[Message]], text: str, limit: int
) -> list[tuple[Session, Message]]:
    """(session, message) for each of the newest `limit` messages that hold every word of `text` (or a
    word it begins: "rai" finds "rain"), once for each session that reaches it (forks share messages),
    the newest session first. `messages` reads the messages an SQL query selects, their attached files
    put back (ChatStore._messages)."""
    words = [w for w in text.replace('"', " ").split() if w]
    if not words:
        return []
    query = " ".join(f'"{w}"*' for w in words)  # words that begin so: the sidebar searches as one types
    try:
        hits = messages(
            "SELECT messages.* FROM messages_fts JOIN messages ON messages.id = messages_fts.rowid "
            "WHERE messages_fts MATCH ? ORDER BY messages_fts.rowid DESC LIMIT ?",
            (query, limit),
        )
    except sqlite3.OperationalError as e:
        raise StoreError(f"cannot search for {text!r} ({e})") from None
    by_id = {hit.id: hit for hit in hits}
    rows = connection.rows(  # a hit's sessions: those whose head is the hit or below it
        "WITH RECURSIVE below(rank, hit, id) AS (SELECT key, value, value FROM json_each(?) UNION ALL "
        "SELECT rank, hit, m.id FROM messages m JOIN below ON m.parent_id = below.id) "
        "SELECT hit, sessions.* FROM below JOIN sessions ON sessions.head_id = below.id "
        "ORDER BY rank, sessions.updated DESC, sessions.created DESC",
        (json.dumps(list(by_id)),),
    )
    return [(Session.from_row(row), by_id[row["hit"]]) for row in rows]


TITLE_CANDIDATES = 1000  # titles the index hands over; a word in more: a page of the newest is read sooner


def titled(
    connection: StoreConnection, which: tuple[str, tuple], text: str, limit: int, offset: int
) -> list[dict]:
    """The rows of the sessions `which` selects (an SQL condition and its parameters) whose title holds
    each word of `text` (ASCII letters in any case, as LIKE compares them), newest first: `limit` of
    them (-1: all) from `offset` on. The title index finds the titles holding the words of three letters
    or more (shorter ones have no trigram); where it finds few, only those are read, and where it finds
    many, a common word, the sessions are read newest first, and the page fills in a few."""
    condition, params = which
    words = text.split()
    like = [w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") for w in words]
    condition += "".join(" AND title LIKE ? ESCAPE '\\'" for _ in words)
    params += tuple(f"%{w}%" for w in like)
    indexed = [w for w in words if len(w) >= 3]
    if indexed:
        query = " ".join('"' + w.replace('"', '""') + '"' for w in indexed)
        found = connection.rows(
            "SELECT rowid FROM titles_fts WHERE titles_fts MATCH ? LIMIT ?", (query, TITLE_CANDIDATES + 1)
        )
        if len(found) <= TITLE_CANDIDATES:
            condition += " AND rowid IN (SELECT value FROM json_each(?))"
            params += (json.dumps([r["rowid"] for r in found]),)
    return connection.rows(
        f"SELECT * FROM sessions WHERE {condition} ORDER BY updated DESC, created DESC LIMIT ? OFFSET ?",
        (*params, limit, offset),
    )
