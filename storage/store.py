"""The conversation store: models, sessions, the message tree, and (as `kv`, kv_tables.py) the KV blocks —
with kv_tables.py the only place with SQL.

A session is a pointer to a message of the tree (its head) plus settings. Forking, editing a past
message or regenerating a reply makes a new session on a sibling branch; nothing is copied. Messages
never depend on KV: blocks are a cache, written after the messages they belong to, and any block may
be dropped at any time and recomputed from tokens.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from . import fragments, search
from .connection import StoreConnection
from .db import Progress, StoreError
from .kv_tables import KVTables
from .records import Message, Session, StoredBlock, StoredTail, marked_title

_OF_TENANT = "AND (? IS NULL OR tenant = ?)"  # a tenant's sessions; NULL: every session


class ChatStore:
    """Models, sessions and the message tree; the KV tables are `kv`."""

    def __init__(self, path: str | Path, progress: Progress | None = None):
        """The database at `path`, upgraded if it is older (telling `progress` of a long upgrade)."""
        self.connection = StoreConnection(path, progress)  # raises StoreError for a damaged file
        self.db_path = self.connection.db_path
        self.db = self.connection.db
        self.kv = KVTables(self.connection)  # KV blocks, each session's block list and tail

    def close(self) -> None:
        self.connection.close()

    def transaction(self):
        """All or nothing (StoreConnection.transaction)."""
        return self.connection.transaction()

    def reading(self):
        """One consistent view for several reads (StoreConnection.reading)."""
        return self.connection.reading()

    def check_writable(self) -> None:
        """Nothing is written into a read-only or damaged file."""
        self.connection.check_writable()

    @property
    def on_wait(self) -> Callable[[float], None] | None:
        """Called as on_wait(seconds) while another process holds the write lock; it may raise to give up."""
        return self.connection.on_wait

    @on_wait.setter
    def on_wait(self, callback: Callable[[float], None] | None) -> None:
        self.connection.on_wait = callback

    # -- models ----------------------------------------------------------------------------------

    def add_model(self, fingerprint: str, name: str, architecture: str, path: str | None) -> None:
        with self.transaction():
            self.db.conn.execute(
                "INSERT INTO models VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (fingerprint) DO UPDATE SET path = excluded.path",
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
            self.connection.insert("sessions", row)
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
        rows = self.connection.rows(
            f"SELECT * FROM sessions WHERE id >= ? AND id < ? {_OF_TENANT} LIMIT 2",
            (prefix, prefix + "g", tenant, tenant),
        )
        if not rows:
            raise StoreError(f"unknown session '{id_or_prefix}'")
        if len(rows) > 1 and rows[0]["id"] != prefix:
            raise StoreError(f"session '{id_or_prefix}' is ambiguous: give more of its id")
        return Session.from_row(rows[0])

    def list_sessions(
        self,
        tenant: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        *,
        origin: str | None = None,
        other_origins: bool = False,
        titled: str = "",
    ) -> list[Session]:
        """The sessions, newest first (a page: `limit` of them from `offset` on); with a `tenant`, that
        tenant's only; with an `origin`, only those it made (`other_origins`: all but those); `titled`:
        only those whose title holds each of its words (ASCII letters in any case; search.titled)."""
        which = f"1 {_OF_TENANT} AND (? IS NULL OR (origin IS ?) != ?)"
        params = (tenant, tenant, origin, origin, other_origins)
        rows = search.titled(self.connection, (which, params), titled, -1 if limit is None else limit, offset)
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
        content = fragments.cut(content)[0]  # as it is stored: its attached files' texts apart
        rows = self.connection.rows(
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
            self.connection.insert("sessions", row)
            self.db.conn.execute(
                "INSERT INTO session_blocks (session_id, position, key) "
                "SELECT ?, position, key FROM session_blocks WHERE session_id = ?",
                (row["id"], parent.id),
            )
            if head == parent.head_id:
                self.db.conn.execute(
                    "INSERT INTO session_tails SELECT ?, fingerprint, parent_key, tokens, codec, data, "
                    "checksum, updated FROM session_tails WHERE session_id = ?",
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
                self.connection.insert("sessions", row)
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
        content, attached = fragments.cut(m.content)  # each attached file's text once, in `fragments`
        cur = self.db.conn.execute(
            "INSERT INTO messages (parent_id, role, content, token_ids, created, stats, reasoning) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (parent_id, m.role, content, blob, m.created, json.dumps(m.stats) if m.stats else None,
             m.reasoning),
        )
        fragments.save(self.db.conn, cur.lastrowid, attached)
        return Message(**{**vars(m), "id": cur.lastrowid, "parent_id": parent_id})

    def _messages(self, sql: str, params=()) -> list[Message]:
        """The messages `sql` selects (rows of the messages table), their attached files put back."""
        with self.connection.lock:  # one view of the messages and their files
            rows = fragments.restore(self.connection.rows, self.connection.rows(sql, params))
        return [Message.from_row(r) for r in rows]

    def _move_head(self, session_id: str, message_id: int) -> None:
        self.db.conn.execute(
            "UPDATE sessions SET head_id = ?, updated = ? WHERE id = ?", (message_id, time.time(), session_id)
        )

    def message(self, message_id: int) -> Message:
        found = self._messages("SELECT * FROM messages WHERE id = ?", (message_id,))
        if not found:
            raise StoreError(f"unknown message {message_id}")
        return found[0]

    def path(self, head_id: int | None) -> list[Message]:
        """The messages from the root of the tree down to head_id."""
        if head_id is None:
            return []
        return self._messages(
            "WITH RECURSIVE up(id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id "
            "WHERE m.parent_id IS NOT NULL) "
            "SELECT messages.* FROM up JOIN messages ON messages.id = up.id ORDER BY up.depth DESC",
            (head_id,),
        )

    def children(self, message_id: int) -> list[Message]:
        return self._messages("SELECT * FROM messages WHERE parent_id = ? ORDER BY id", (message_id,))

    def message_tree(self, root_id: int) -> list[Message]:
        """Every message under root_id, itself included, parents before children."""
        return self._messages(  # ids grow, so a parent's id is below its children's
            "WITH RECURSIVE down(id) AS (SELECT ? UNION ALL "
            "SELECT m.id FROM messages m JOIN down ON m.parent_id = down.id) "
            "SELECT messages.* FROM down JOIN messages ON messages.id = down.id ORDER BY messages.id",
            (root_id,),
        )

    def search(self, text: str, limit: int = 50) -> list[tuple[Session, Message]]:
        """Sessions whose conversation contains the text, with each matching message (search.py)."""
        return search.find(self.connection, self._messages, text, limit)

    # -- import (storage/exchange/ reads and checks the files) ---------------------------------------

    def add_imported(
        self,
        messages: list[Message],
        sessions: list[Session],
        blocks: Iterable[tuple[str, StoredBlock]],
        block_lists: dict[str, list[bytes]],
        tails: dict[str, StoredTail],
        namespace: bytes | None,
        tenant: str | None = None,
    ) -> tuple[dict[str, str], int]:
        """Add sessions read from a file, in one transaction, under new ids; nothing is overwritten.

        Ids in the arguments are the file's: messages' id and parent_id (parents first), sessions'
        id, head_id and forked_from; block_lists and tails are keyed by the file's session id.
        blocks are (model fingerprint, block), stored in the import's own `namespace`, which the
        sessions get; one already stored there under its key is kept as it is.
        Returns ({file session id: new id}, how many blocks were new)."""
        now = time.time()
        with self.transaction():
            conn = self.db.conn
            new_message: dict[int, int] = {}
            for m in messages:
                parent = None if m.parent_id is None else new_message[m.parent_id]
                new_message[m.id] = self._insert_message(parent, m).id
            new_session: dict[str, str] = {}
            for s in sessions:
                new_id = secrets.token_hex(6)
                while conn.execute("SELECT 1 FROM sessions WHERE id = ?", (new_id,)).fetchone():
                    new_id = secrets.token_hex(6)
                new_session[s.id] = new_id
                self.connection.insert(
                    "sessions",
                    {
                        "id": new_id,
                        "title": s.title,
                        "head_id": None if s.head_id is None else new_message[s.head_id],
                        "model_fingerprint": s.model_fingerprint,
                        "model_name": s.model_name,
                        "system_prompt": s.system_prompt,
                        "sampling": json.dumps(s.sampling),
                        "forked_from": None,  # set below, once every session of the file exists
                        "n_tokens": s.n_tokens,
                        "created": s.created,
                        "updated": now,  # an imported session comes first in the list
                        "kv_namespace": namespace,
                        "tenant": tenant,
                    },
                )
            for s in sessions:
                if s.forked_from is not None:
                    conn.execute(
                        "UPDATE sessions SET forked_from = ? WHERE id = ?",
                        (new_session[s.forked_from], new_session[s.id]),
                    )
            added = self.kv.insert_blocks(blocks, namespace, now)
            for file_id, keys in block_lists.items():
                self.kv.insert_block_list(new_session[file_id], keys)
            fingerprints = {s.id: s.model_fingerprint for s in sessions}
            for file_id, tail in tails.items():
                self.kv.insert_tail(new_session[file_id], fingerprints[file_id], tail, now)
        return new_session, added
