"""Full-text search over the message tree: the newest messages that hold every word, each with the
sessions that reach it. Its cost is that of the hits, not of the archive: FTS5 walks its index newest
first and stops at the limit (ranked by relevance, it would score every match of a common word
first), and a hit's sessions are found from the hit down to their heads, not from every session's
path."""

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
    """(session, message) for each of the newest `limit` messages that hold every word of `text`, once
    for each session that reaches it (forks share messages), the newest session first. `messages`
    reads the messages an SQL query selects, their attached files put back (ChatStore._messages)."""
    words = [w for w in text.replace('"', " ").split() if w]
    if not words:
        return []
    query = " ".join(f'"{w}"' for w in words)
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
