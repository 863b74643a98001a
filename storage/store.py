"""The conversation store: models, sessions, the message tree and KV blocks — the only place with SQL.

A session is a pointer to a message of the tree (its head) plus settings. Forking, editing a past
message or regenerating a reply makes a new session on a sibling branch; nothing is copied. Messages
never depend on KV: blocks are a cache, written after the messages they belong to, and any block may
be dropped at any time and recomputed from tokens.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .db import (
    BUSY_S,
    DISK_FULL,
    StoreError,
    begin_immediate,
    disk_full,
    is_damage,
    open_database,
    store_error,
)
from .kv_tables import KVTables
from .records import Message, Session

_OF_TENANT = "AND (? IS NULL OR tenant = ?)"  # a tenant's sessions; NULL: every session

# What a title says a session is besides its conversation; one at most, the newest (no "(fork) (edited)")
TITLE_MARKS = ("(fork)", "(regenerated)", "(edited)", "(imported)")


def marked_title(title: str, mark: str) -> str:
    """`title` with `mark` (one of TITLE_MARKS) after it, in place of the mark it had."""
    return f"{unmarked_title(title)} {mark}"


def unmarked_title(title: str) -> str:
    """`title` without the marks at its end."""
    while any(title.endswith(" " + m) for m in TITLE_MARKS):
        title = title.rsplit(" ", 1)[0]
    return title


BULK_TABLES = {"kv_blocks", "session_tails"}  # KV: checked block by block on use (checksums), not on open


class ChatStore(KVTables):
    def __init__(self, path: str | Path):
        self.db_path = Path(path)
        self.db = open_database(self.db_path)
        self._lock = threading.RLock()  # one connection, used from the UI's workers one at a time
        # open_database() opens a file we may not write read-only, and marks the connection so
        self.read_only = bool(self.db.conn.execute("PRAGMA query_only").fetchone()[0])
        # Damaged pages may read as fewer rows, without an error: look before showing or writing anything.
        self.damage = self._quick_check()  # why the file is not fit to be used, once found
        if self.damage:
            self.close()
            raise self._damaged()
        # Called as on_wait(seconds) while another process holds the write lock; it may raise to give up.
        self.on_wait: Callable[[float], None] | None = None

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def transaction(self):
        """All or nothing: a crash or an error inside leaves the database as it was. Waits as long as
        another process holds the write lock (telling on_wait), and refuses a damaged or read-only file."""
        with self._lock:
            self.check_writable()
            conn = self.db.conn
            try:
                begin_immediate(conn, self.on_wait)
            except sqlite3.Error as e:
                raise self._error(e, "nothing was changed") from None
            try:
                yield
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:  # a failed COMMIT (a full disk) leaves it open
                    conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise self._error(e, "nothing was changed") from None
                raise
            self._checkpoint()

    @contextmanager
    def reading(self):
        """One consistent view for several reads, even while another process writes: a read
        transaction, which takes no write lock and works on a read-only file."""
        with self._lock:
            conn = self.db.conn
            conn.execute("BEGIN")  # deferred: the view is fixed by the first read
            try:
                yield
            finally:
                conn.execute("COMMIT")

    def _checkpoint(self) -> None:
        """Copy what was committed into the main file and empty the -wal: a -wal lost or damaged later
        (a crash, a copy made without it) then takes nothing committed with it."""
        conn = self.db.conn
        conn.execute("PRAGMA busy_timeout = 0")  # never wait for it: readers elsewhere may hold the -wal
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error:
            pass  # the commit stands; the next commit or the last connection to close checkpoints
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_S * 1000)}")

    def check_writable(self) -> None:
        """Nothing is written into a read-only or damaged file."""
        if self.read_only:
            full = disk_full(self.db_path)
            why = f"{DISK_FULL if full else 'read-only here (the file or its folder)'}; nothing was changed"
            raise StoreError(f"{self.db_path}: {why}", why, full)
        if self.damage:
            raise self._damaged()

    def _quick_check(self) -> str | None:
        """PRAGMA quick_check of the tables that hold conversations (cheap: the KV tables, the bulk of
        the file, are checked block by block against their checksums as they are read)."""
        conn = self.db.conn
        try:
            tables = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND sql NOT LIKE 'CREATE VIRTUAL%'"
            ).fetchall()
            for (table,) in tables:
                found = (
                    [] if table in BULK_TABLES else conn.execute(f'PRAGMA quick_check("{table}")').fetchall()
                )
                if found and found != [("ok",)]:  # several lines, the first a heading: one line of it
                    detail = " ".join(" ".join(r[0] for r in found).split("***")[-1].split())
                    return f"table {table} is damaged ({detail[:120]})"
        except sqlite3.Error as e:
            return f"it is damaged ({e})"
        return None

    def _damaged(self) -> StoreError:
        why = f"{self.damage}; it was left untouched: `llama-chat sessions check` recovers what can be read"
        return StoreError(f"{self.db_path}: {why}", why)

    def _error(self, e: sqlite3.Error, consequence: str) -> StoreError:
        """One line for a failed query; a damaged file found this way is not written to again."""
        if is_damage(e):
            self.damage = self.damage or str(e)
        return store_error(self.db_path, e, consequence)

    def _insert(self, table: str, row: dict) -> None:
        # plain SQL: sqlite-utils' writers commit on their own, which would end our transaction early
        names = ", ".join(row)
        self.db.conn.execute(
            f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(row))})", list(row.values())
        )

    def _rows(self, sql: str, params=()) -> list[dict]:
        with self._lock:
            try:
                cur = self.db.conn.execute(sql, params)
                names = [d[0] for d in cur.description]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            except sqlite3.Error as e:
                raise self._error(e, "it cannot be read") from None

    # -- models ----------------------------------------------------------------------------------

    def add_model(self, fingerprint: str, name: str, architecture: str, path: str | None) -> None:
        with self.transaction():
            self.db.conn.execute(
                "INSERT INTO models VALUES (?, ?, ?, ?, ?) ON CONFLICT (fingerprint) DO UPDATE SET path = excluded.path",
                (fingerprint, name, architecture, path, time.time()),
            )

    # -- sessions --------------------------------------------------------------------------------

    def create_session(
        self,
        title: str = "New chat",
        *,
        model_fingerprint: str | None = None,
        model_name: str | None = None,
        system_prompt: str | None = None,
        sampling: dict | None = None,
        head_id: int | None = None,
        forked_from: str | None = None,
        n_tokens: int = 0,
        origin: str | None = None,
        turn: list[Message] = (),
        tenant: str | None = None,
        kv_namespace: bytes | None = None,
    ) -> Session:
        """A new session; with a `turn` (messages, oldest first: their id and parent_id are not used), it
        ends with them, created with it in one transaction (a failure leaves no empty session)."""
        now = time.time()
        row = {
            "id": secrets.token_hex(6),
            "title": title,
            "head_id": head_id,
            "model_fingerprint": model_fingerprint,
            "model_name": model_name,
            "system_prompt": system_prompt,
            "sampling": json.dumps(sampling or {}),
            "forked_from": forked_from,
            "n_tokens": n_tokens,
            "created": now,
            "updated": now,
            "origin": origin,
            "tenant": tenant,
            "kv_namespace": kv_namespace,
        }
        with self.transaction():
            self._insert("sessions", row)
            parent = head_id
            for m in turn:
                parent = self._insert_message(parent, m).id
            if turn:
                self._move_head(row["id"], parent)
                row["head_id"] = parent
        return Session.from_row(row)

    def get_session(self, id_or_prefix: str, tenant: str | None = None) -> Session:
        """A session by its id or a unique prefix of it; with a `tenant`, only one of that tenant's (None:
        any, as the machine's owner sees them)."""
        prefix = id_or_prefix.strip().lower()
        if not prefix or any(c not in "0123456789abcdef" for c in prefix):
            raise StoreError(f"unknown session '{id_or_prefix}'")
        rows = self._rows(
            f"SELECT * FROM sessions WHERE id >= ? AND id < ? {_OF_TENANT} LIMIT 2",
            (prefix, prefix + "g", tenant, tenant),
        )
        if not rows:
            raise StoreError(f"unknown session '{id_or_prefix}'")
        if len(rows) > 1 and rows[0]["id"] != prefix:
            raise StoreError(f"session '{id_or_prefix}' is ambiguous: give more of its id")
        return Session.from_row(rows[0])

    def list_sessions(self, tenant: str | None = None) -> list[Session]:
        """Every session, newest first; with a `tenant`, that tenant's only."""
        rows = self._rows(
            f"SELECT * FROM sessions WHERE 1 {_OF_TENANT} ORDER BY updated DESC, created DESC", (tenant, tenant)
        )
        return [Session.from_row(r) for r in rows]

    def session_ending_with(
        self,
        origin: str,
        system_prompt: str | None,
        turns: list[tuple[str, str]],
        tenant: str | None = None,
        kv_namespace: bytes | None = None,
    ) -> Session | None:
        """The newest session made by `origin` whose conversation is exactly `turns` ((role, text),
        oldest first) after `system_prompt`: where a client that resends its history left off. With a
        `tenant`, one of that tenant's; its KV in `kv_namespace` either way."""
        if not turns:
            return None
        role, content = turns[-1]
        rows = self._rows(
            "SELECT s.* FROM sessions s JOIN messages m ON m.id = s.head_id WHERE s.origin = ? "
            f"AND m.role = ? AND m.content = ? AND s.system_prompt IS ? AND s.kv_namespace IS ? {_OF_TENANT} "
            "ORDER BY s.updated DESC",
            (origin, role, content, system_prompt, kv_namespace, tenant, tenant),
        )
        for row in rows:
            session = Session.from_row(row)
            if [(m.role, m.content) for m in self.path(session.head_id)] == turns:
                return session
        return None

    def rename_session(self, session_id: str, title: str) -> None:
        with self.transaction():
            self.db.conn.execute(
                "UPDATE sessions SET title = ?, updated = ? WHERE id = ?", (title, time.time(), session_id)
            )

    def update_session(self, session_id: str, **fields) -> None:
        """Change settings (system_prompt, sampling, title, model_…) of a session."""
        if "sampling" in fields:
            fields["sampling"] = json.dumps(fields["sampling"] or {})
        fields["updated"] = time.time()
        allowed = {"title", "system_prompt", "sampling", "model_fingerprint", "model_name", "updated"}
        if not set(fields) <= allowed:
            raise ValueError(f"cannot update {sorted(set(fields) - allowed)} of a session")
        with self.transaction():
            assignments = ", ".join(f"{name} = ?" for name in fields)
            self.db.conn.execute(
                f"UPDATE sessions SET {assignments} WHERE id = ?", [*fields.values(), session_id]
            )

    def set_head(self, session_id: str, message_id: int | None) -> None:
        """Point a session at another message of the tree (None: the empty conversation)."""
        with self.transaction():
            self.db.conn.execute(
                "UPDATE sessions SET head_id = ?, n_tokens = 0, updated = ? WHERE id = ?",
                (message_id, time.time(), session_id),
            )
            self.db.conn.execute("DELETE FROM session_tails WHERE session_id = ?", (session_id,))

    def fork_session(
        self, session_id: str, at_message: int | None = None, title: str | None = None
    ) -> Session:
        """A new session on the same tree, its head at `at_message` (default: the current head).

        Nothing is copied but the session row and its list of block keys (KV is shared by key); a fork at
        the head also shares the parent's stored tail, so it resumes just as fast."""
        parent = self.get_session(session_id)
        head = parent.head_id if at_message is None else at_message
        if at_message is not None and at_message not in {m.id for m in self.path(parent.head_id)}:
            raise StoreError(f"message {at_message} is not in session {parent.id}")
        row = self._fork_row(parent, head, title)
        with self.transaction():
            self._insert("sessions", row)
            self.db.conn.execute(
                "INSERT INTO session_blocks (session_id, position, key) "
                "SELECT ?, position, key FROM session_blocks WHERE session_id = ?",
                (row["id"], parent.id),
            )
            if head == parent.head_id:
                self.db.conn.execute(
                    "INSERT INTO session_tails SELECT ?, fingerprint, parent_key, tokens, codec, data, checksum, "
                    "updated FROM session_tails WHERE session_id = ?",
                    (row["id"], parent.id),
                )
        return Session.from_row(row)

    @staticmethod
    def _fork_row(parent: Session, head: int | None, title: str | None) -> dict:
        now = time.time()
        return {
            "id": secrets.token_hex(6),
            "title": title or marked_title(parent.title, "(fork)"),
            "head_id": head,
            "model_fingerprint": parent.model_fingerprint,
            "model_name": parent.model_name,
            "system_prompt": parent.system_prompt,
            "sampling": json.dumps(parent.sampling),
            "forked_from": parent.id,
            "n_tokens": parent.n_tokens if head == parent.head_id else 0,
            "created": now,
            "updated": now,
            "kv_namespace": parent.kv_namespace,
            "origin": parent.origin,
            "tenant": parent.tenant,
        }

    def delete_session(self, session_id: str) -> int:
        """Delete a session, and those of its messages no other session reaches; returns how many."""
        session = self.get_session(session_id)
        with self.transaction():
            self.db.conn.execute("DELETE FROM sessions WHERE id = ?", (session.id,))
            reached = set()
            for (head,) in self.db.conn.execute(
                "SELECT head_id FROM sessions WHERE head_id IS NOT NULL"
            ).fetchall():
                reached.update(m.id for m in self.path(head))
            doomed = [m.id for m in self.path(session.head_id) if m.id not in reached]
            # children before parents, for the parent_id foreign key
            for mid in reversed(doomed):
                if self.db.conn.execute(
                    "SELECT 1 FROM messages WHERE parent_id = ? LIMIT 1", (mid,)
                ).fetchone():
                    continue  # an abandoned branch hangs below it; keep the tree whole
                self.db.conn.execute("DELETE FROM messages WHERE id = ?", (mid,))
        return len(doomed)

    # -- messages --------------------------------------------------------------------------------

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        parent_id: int | None = None,
        token_ids: list[int] | None = None,
        stats: dict | None = None,
    ) -> Message:
        """Append a message under `parent_id` (default: the session's head) and move the head to it."""
        with self.transaction():
            if parent_id is None:
                parent_id = self._head(session_id)
            message = self._insert_message(
                parent_id, Message(0, None, role, content, token_ids, time.time(), stats)
            )
            self._move_head(session_id, message.id)
        return message

    def append_turn(
        self, session_id: str, expected_head: int | None, turn: list[Message]
    ) -> tuple[Session, bool]:
        """Append messages (a user turn and its reply), all or nothing, below `expected_head`: the head
        the reply was computed from. If the session moved on meanwhile (another process replied in it),
        they go on a new branch from there instead, so no reply lands under another run's question.
        The messages' id and parent_id are ignored. Returns (the session now ending with them, whether
        it is a new branch)."""
        with self.transaction():
            head = self._head(session_id)
            target = session_id
            if head != expected_head:
                row = self._fork_row(self.get_session(session_id), expected_head, None)
                self._insert("sessions", row)
                target = row["id"]
            parent = expected_head
            for m in turn:
                parent = self._insert_message(parent, m).id
            self._move_head(target, parent)
        return self.get_session(target), target != session_id

    def _head(self, session_id: str) -> int | None:
        row = self.db.conn.execute("SELECT head_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise StoreError(f"unknown session '{session_id}'")
        return row[0]

    def _insert_message(self, parent_id: int | None, m: Message) -> Message:
        """m below parent_id (m's own id and parent_id are not used): the stored message."""
        blob = None if m.token_ids is None else np.asarray(m.token_ids, dtype=np.int32).tobytes()
        cur = self.db.conn.execute(
            "INSERT INTO messages (parent_id, role, content, token_ids, created, stats) VALUES (?, ?, ?, ?, ?, ?)",
            (parent_id, m.role, m.content, blob, m.created, json.dumps(m.stats) if m.stats else None),
        )
        return Message(cur.lastrowid, parent_id, m.role, m.content, m.token_ids, m.created, m.stats)

    def _move_head(self, session_id: str, message_id: int) -> None:
        self.db.conn.execute(
            "UPDATE sessions SET head_id = ?, updated = ? WHERE id = ?", (message_id, time.time(), session_id)
        )

    def message(self, message_id: int) -> Message:
        rows = self._rows("SELECT * FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise StoreError(f"unknown message {message_id}")
        return Message.from_row(rows[0])

    def path(self, head_id: int | None) -> list[Message]:
        """The messages from the root of the tree down to head_id."""
        if head_id is None:
            return []
        rows = self._rows(
            "WITH RECURSIVE up(id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id WHERE m.parent_id IS NOT NULL) "
            "SELECT messages.* FROM up JOIN messages ON messages.id = up.id ORDER BY up.depth DESC",
            (head_id,),
        )
        return [Message.from_row(r) for r in rows]

    def children(self, message_id: int) -> list[Message]:
        return [
            Message.from_row(r)
            for r in self._rows("SELECT * FROM messages WHERE parent_id = ? ORDER BY id", (message_id,))
        ]

    def search(self, text: str, limit: int = 50) -> list[tuple[Session, Message]]:
        """Sessions whose conversation contains the text (full-text search), with each matching message."""
        words = [w for w in text.replace('"', " ").split() if w]
        if not words:
            return []
        query = " ".join(f'"{w}"' for w in words)
        try:
            hits = self._rows(
                "SELECT messages.* FROM messages_fts JOIN messages ON messages.id = messages_fts.rowid "
                "WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                (query, limit),
            )
        except sqlite3.OperationalError as e:
            raise StoreError(f"cannot search for {text!r} ({e})") from None
        found = []
        sessions = self.list_sessions()
        paths = {s.id: {m.id for m in self.path(s.head_id)} for s in sessions}
        for row in hits:
            # a message shared by forks belongs to each of them
            found += [(s, Message.from_row(row)) for s in sessions if row["id"] in paths[s.id]]
        return found
