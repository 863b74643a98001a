"""The chat store's KV tables: content-addressed blocks, each session's block list and tail, and the
rows an export reads and an import writes. Mixed into ChatStore (store.py), whose transaction() and
_rows() they use: one database, one connection, one place with SQL.
"""

from __future__ import annotations

import json
import secrets
import time

import numpy as np

from .records import Message, Session, StoredBlock, StoredTail


class KVTables:
    # -- KV blocks -------------------------------------------------------------------------------

    def stored_keys(self, keys: list[bytes], namespace: bytes | None = None) -> set[bytes]:
        if not keys:
            return set()
        marks = ",".join("?" * len(keys))
        rows = self._rows(
            f"SELECT key FROM kv_blocks WHERE namespace = ? AND key IN ({marks})", [_shared(namespace), *keys]
        )
        return {r["key"] for r in rows}

    def save_snapshot(
        self,
        session_id: str,
        fingerprint: str,
        block_keys: list[bytes],
        new_blocks: list[StoredBlock],
        tail: StoredTail | None,
        n_tokens: int,
        namespace: bytes | None = None,
    ) -> None:
        """In one transaction: blocks not stored yet (in the session's namespace), the session's block
        list and its tail."""
        now = time.time()
        with self.transaction():
            conn = self.db.conn
            self._insert_blocks([(fingerprint, b) for b in new_blocks], namespace, now)
            conn.execute("DELETE FROM session_blocks WHERE session_id = ?", (session_id,))
            conn.executemany(
                "INSERT INTO session_blocks (session_id, position, key) VALUES (?, ?, ?)",
                [(session_id, i, k) for i, k in enumerate(block_keys)],
            )
            if block_keys:
                marks = ",".join("?" * len(block_keys))
                conn.execute(
                    f"UPDATE kv_blocks SET last_used = ? WHERE namespace = ? AND key IN ({marks})",
                    [now, _shared(namespace), *block_keys],
                )
            conn.execute("DELETE FROM session_tails WHERE session_id = ?", (session_id,))
            if tail is not None:
                self._insert_tail(session_id, fingerprint, tail, now)
            conn.execute(
                "UPDATE sessions SET n_tokens = ?, model_fingerprint = ? WHERE id = ?",
                (n_tokens, fingerprint, session_id),
            )

    def _insert_blocks(
        self, blocks: list[tuple[str, StoredBlock]], namespace: bytes | None, now: float
    ) -> int:
        """Store (model fingerprint, block)s not stored yet in the namespace; returns how many were new."""
        before = self.db.conn.total_changes
        self.db.conn.executemany(
            "INSERT OR IGNORE INTO kv_blocks (namespace, key, fingerprint, codec, n_tokens, data, checksum, "
            "last_used, tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    _shared(namespace),
                    b.key,
                    fp,
                    b.codec,
                    b.n_tokens,
                    b.data,
                    b.checksum,
                    now,
                    _token_blob(b.tokens),
                )
                for fp, b in blocks
            ],
        )
        return self.db.conn.total_changes - before

    def _insert_tail(self, session_id: str, fingerprint: str, tail: StoredTail, now: float) -> None:
        self.db.conn.execute(
            "INSERT INTO session_tails VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                session_id,
                fingerprint,
                tail.parent_key,
                _token_blob(tail.tokens),
                tail.codec,
                tail.data,
                tail.checksum,
                now,
            ),
        )

    def load_block(self, key: bytes, fingerprint: str, namespace: bytes | None = None) -> StoredBlock | None:
        rows = self._rows(
            "SELECT * FROM kv_blocks WHERE namespace = ? AND key = ? AND fingerprint = ?",
            (_shared(namespace), key, fingerprint),
        )
        if not rows:
            return None
        r = rows[0]
        tokens = np.frombuffer(r["tokens"], dtype=np.int32).tolist()
        return StoredBlock(r["key"], r["n_tokens"], r["codec"], r["data"], r["checksum"], tokens)

    def drop_block(self, key: bytes, namespace: bytes | None = None) -> None:
        """Forget a block that failed its checksum or its tokens; it will be recomputed from tokens."""
        with self.transaction():
            self.db.conn.execute(
                "DELETE FROM kv_blocks WHERE namespace = ? AND key = ?", (_shared(namespace), key)
            )

    def load_tail(self, session_id: str, fingerprint: str) -> StoredTail | None:
        rows = self._rows(
            "SELECT * FROM session_tails WHERE session_id = ? AND fingerprint = ?", (session_id, fingerprint)
        )
        if not rows:
            return None
        r = rows[0]
        tokens = np.frombuffer(r["tokens"], dtype=np.int32).tolist()
        return StoredTail(r["parent_key"], tokens, r["codec"], r["data"], r["checksum"])

    def gc(self, budget_bytes: int | None = None) -> dict:
        """Remove blocks no session needs; then, over the budget, the least recently used ones too
        (sessions stay usable: what is missing is recomputed)."""
        with self.transaction():
            conn = self.db.conn
            before = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM kv_blocks").fetchone()
            conn.execute(
                "DELETE FROM kv_blocks WHERE (namespace, key) NOT IN (SELECT COALESCE(s.kv_namespace, x''), b.key "
                "FROM session_blocks b JOIN sessions s ON s.id = b.session_id)"
            )
            if budget_bytes is not None:
                total = 0
                doomed = []
                for key, size in conn.execute(
                    "SELECT key, LENGTH(data) FROM kv_blocks ORDER BY last_used DESC, key"
                ):
                    total += size
                    if total > budget_bytes:
                        doomed.append((key,))
                conn.executemany("DELETE FROM kv_blocks WHERE key = ?", doomed)
            after = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM kv_blocks").fetchone()
        return {
            "blocks_removed": before[0] - after[0],
            "bytes_freed": before[1] - after[1],
            "blocks": after[0],
            "bytes": after[1],
        }

    def kv_bytes(self) -> dict:
        """Bytes of stored KV: shared blocks, per-session tails, and the largest single block."""
        return self._rows(
            "SELECT (SELECT COALESCE(SUM(LENGTH(data)), 0) FROM kv_blocks) AS blocks, "
            "(SELECT COALESCE(SUM(LENGTH(data)), 0) FROM session_tails) AS tails, "
            "(SELECT COALESCE(MAX(LENGTH(data)), 0) FROM kv_blocks) AS largest_block"
        )[0]

    # -- export and import (storage/exchange.py writes and checks the files) ---------------------

    def message_tree(self, root_id: int) -> list[Message]:
        """Every message under root_id, itself included, parents before children."""
        rows = self._rows(
            "WITH RECURSIVE down(id) AS (SELECT ? UNION ALL "
            "SELECT m.id FROM messages m JOIN down ON m.parent_id = down.id) "
            "SELECT messages.* FROM down JOIN messages ON messages.id = down.id ORDER BY messages.id",
            (root_id,),
        )
        return [Message.from_row(r) for r in rows]  # ids grow, so a parent's id is below its children's

    def block_keys(self, session_id: str) -> list[bytes]:
        """The keys of a session's full KV blocks, in order (some may have been dropped since)."""
        rows = self._rows(
            "SELECT key FROM session_blocks WHERE session_id = ? ORDER BY position", (session_id,)
        )
        return [r["key"] for r in rows]

    def add_imported(
        self,
        messages: list[Message],
        sessions: list[Session],
        blocks: list[tuple[str, StoredBlock]],
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
                blob = None if m.token_ids is None else np.asarray(m.token_ids, dtype=np.int32).tobytes()
                cur = conn.execute(
                    "INSERT INTO messages (parent_id, role, content, token_ids, created, stats) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        None if m.parent_id is None else new_message[m.parent_id],
                        m.role,
                        m.content,
                        blob,
                        m.created,
                        json.dumps(m.stats) if m.stats else None,
                    ),
                )
                new_message[m.id] = cur.lastrowid
            new_session: dict[str, str] = {}
            for s in sessions:
                new_id = secrets.token_hex(6)
                while conn.execute("SELECT 1 FROM sessions WHERE id = ?", (new_id,)).fetchone():
                    new_id = secrets.token_hex(6)
                new_session[s.id] = new_id
                self._insert(
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
            added = self._insert_blocks(blocks, namespace, now)
            for file_id, keys in block_lists.items():
                conn.executemany(
                    "INSERT INTO session_blocks (session_id, position, key) VALUES (?, ?, ?)",
                    [(new_session[file_id], i, k) for i, k in enumerate(keys)],
                )
            fingerprints = {s.id: s.model_fingerprint for s in sessions}
            for file_id, tail in tails.items():
                self._insert_tail(new_session[file_id], fingerprints[file_id], tail, now)
        return new_session, added

    def promote_session(self, session_id: str, fingerprint: str, trusted: list[StoredBlock]) -> int:
        """After `sessions verify`: the session leaves its import's namespace and `trusted` (blocks
        that matched their recomputed KV, under their keys computed here) join the shared blocks. Its
        block list and tail, imported too, go; the next snapshot stores them anew. Returns how many
        blocks were new."""
        with self.transaction():
            added = self._insert_blocks([(fingerprint, b) for b in trusted], None, time.time())
            conn = self.db.conn
            conn.execute("UPDATE sessions SET kv_namespace = NULL WHERE id = ?", (session_id,))
            conn.execute("DELETE FROM session_tails WHERE session_id = ?", (session_id,))
            conn.execute("DELETE FROM session_blocks WHERE session_id = ?", (session_id,))
        return added


def _shared(namespace: bytes | None) -> bytes:
    """A namespace as stored: b"" for the blocks every session shares."""
    return namespace or b""


def _token_blob(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()
