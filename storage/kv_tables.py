"""The chat store's KV tables: content-addressed blocks, each session's block list and tail. ChatStore
(store.py) holds them as `kv`, on the store's connection: one database, one place with SQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from .connection import StoreConnection
from .records import StoredBlock, StoredTail


class KVTables:
    """KV blocks (shared, or in an import's namespace), each session's block list and its tail. The
    insert_* verbs write inside a transaction their caller holds (a snapshot, an import)."""

    def __init__(self, connection: StoreConnection):
        self.connection = connection
        self.db = connection.db

    def stored_keys(self, keys: list[bytes], namespace: bytes | None = None) -> set[bytes]:
        if not keys:
            return set()
        marks = ",".join("?" * len(keys))
        rows = self.connection.rows(
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
        with self.connection.transaction():
            conn = self.db.conn
            self.insert_blocks([(fingerprint, b) for b in new_blocks], namespace, now)
            conn.execute("DELETE FROM session_blocks WHERE session_id = ?", (session_id,))
            self.insert_block_list(session_id, block_keys)
            if block_keys:
                marks = ",".join("?" * len(block_keys))
                conn.execute(
                    f"UPDATE kv_blocks SET last_used = ? WHERE namespace = ? AND key IN ({marks})",
                    [now, _shared(namespace), *block_keys],
                )
            conn.execute("DELETE FROM session_tails WHERE session_id = ?", (session_id,))
            if tail is not None:
                self.insert_tail(session_id, fingerprint, tail, now)
            conn.execute(
                "UPDATE sessions SET n_tokens = ?, model_fingerprint = ? WHERE id = ?",
                (n_tokens, fingerprint, session_id),
            )

    def insert_blocks(
        self, blocks: Iterable[tuple[str, StoredBlock]], namespace: bytes | None, now: float
    ) -> int:
        """Store (model fingerprint, block)s not stored yet in the namespace, inside the caller's
        transaction, taking one at a time (an import reads each from its file as it goes); returns how
        many were new."""
        before = self.db.conn.total_changes
        self.db.conn.executemany(
            "INSERT OR IGNORE INTO kv_blocks (namespace, key, fingerprint, codec, n_tokens, data, checksum, "
            "last_used, tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
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
            ),
        )
        return self.db.conn.total_changes - before

    def insert_block_list(self, session_id: str, keys: list[bytes]) -> None:
        """A session's full blocks, by key in order, inside the caller's transaction."""
        self.db.conn.executemany(
            "INSERT INTO session_blocks (session_id, position, key) VALUES (?, ?, ?)",
            [(session_id, i, k) for i, k in enumerate(keys)],
        )

    def insert_tail(self, session_id: str, fingerprint: str, tail: StoredTail, now: float) -> None:
        """A session's tail, inside the caller's transaction."""
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
        rows = self.connection.rows(
            "SELECT * FROM kv_blocks WHERE namespace = ? AND key = ? AND fingerprint = ?",
            (_shared(namespace), key, fingerprint),
        )
        if not rows:
            return None
        r = rows[0]
        tokens = np.frombuffer(r["tokens"], dtype=np.int32).tolist()
        return StoredBlock(r["key"], r["n_tokens"], r["codec"], r["data"], r["checksum"], tokens)

    def kept_ids(self, session_id: str) -> tuple[bytes, list[int]] | None:
        """The token ids kept for a session's conversation with the seal they were kept under (the
        session cache's ids_seal says whether they are still the conversation's); None: none kept."""
        rows = self.connection.rows(
            "SELECT seal, ids FROM session_token_ids WHERE session_id = ?", (session_id,)
        )
        return (rows[0]["seal"], np.frombuffer(rows[0]["ids"], dtype=np.int32).tolist()) if rows else None

    def keep_ids(self, session_id: str, seal: bytes, ids: list[int]) -> None:
        """Keep the token ids of a session's conversation under their seal (in place of any kept before)."""
        with self.connection.transaction():
            row = (session_id, seal, _token_blob(ids))
            self.db.conn.execute("INSERT OR REPLACE INTO session_token_ids VALUES (?, ?, ?)", row)

    def drop_block(self, key: bytes, namespace: bytes | None = None) -> None:
        """Forget a block that failed its checksum or its tokens; it will be recomputed from tokens."""
        with self.connection.transaction():
            self.db.conn.execute(
                "DELETE FROM kv_blocks WHERE namespace = ? AND key = ?", (_shared(namespace), key)
            )

    def load_tail(self, session_id: str, fingerprint: str) -> StoredTail | None:
        rows = self.connection.rows(
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
        with self.connection.transaction():
            conn = self.db.conn
            before = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(data)), 0) FROM kv_blocks").fetchone()
            conn.execute(
                "DELETE FROM kv_blocks WHERE (namespace, key) NOT IN "
                "(SELECT COALESCE(s.kv_namespace, x''), b.key "
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
        return self.connection.rows(
            "SELECT (SELECT COALESCE(SUM(LENGTH(data)), 0) FROM kv_blocks) AS blocks, "
            "(SELECT COALESCE(SUM(LENGTH(data)), 0) FROM session_tails) AS tails, "
            "(SELECT COALESCE(MAX(LENGTH(data)), 0) FROM kv_blocks) AS largest_block"
        )[0]

    def block_keys(self, session_id: str) -> list[bytes]:
        """The keys of a session's full KV blocks, in order (some may have been dropped since)."""
        rows = self.connection.rows(
            "SELECT key FROM session_blocks WHERE session_id = ? ORDER BY position", (session_id,)
        )
        return [r["key"] for r in rows]

    def promote_session(self, session_id: str, fingerprint: str, trusted: list[StoredBlock]) -> int:
        """After `sessions verify`: the session leaves its import's namespace and `trusted` (blocks
        that matched their recomputed KV, under their keys computed here) join the shared blocks. Its
        block list and tail, imported too, go; the next snapshot stores them anew. Returns how many
        blocks were new."""
        with self.connection.transaction():
            added = self.insert_blocks([(fingerprint, b) for b in trusted], None, time.time())
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
