"""Opening the conversation database: pragmas, and schema upgrades as numbered steps on user_version.

A database written by a newer llama-chat (a higher user_version than we know) is refused before
anything is written to it, so an older program never alters what a newer one saved.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import sqlite_utils


class StoreError(Exception):
    """A problem with the conversation store a user can cause: one line naming the thing and the problem."""


def _run_script(conn: sqlite3.Connection, script: str) -> None:
    """Run statements one by one: executescript() would COMMIT the upgrade's transaction half-way."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""


def _v1(conn: sqlite3.Connection) -> None:
    _run_script(
        conn,
        """
        CREATE TABLE models (
            fingerprint TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            architecture TEXT NOT NULL,
            path TEXT,
            added REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            parent_id INTEGER REFERENCES messages(id),
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            token_ids BLOB,
            created REAL NOT NULL,
            stats TEXT
        );
        CREATE INDEX messages_parent ON messages(parent_id);
        CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            head_id INTEGER REFERENCES messages(id),
            model_fingerprint TEXT,
            model_name TEXT,
            system_prompt TEXT,
            sampling TEXT NOT NULL DEFAULT '{}',
            forked_from TEXT REFERENCES sessions(id) ON DELETE SET NULL,
            n_tokens INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE TABLE kv_blocks (
            key BLOB PRIMARY KEY,
            fingerprint TEXT NOT NULL,
            codec TEXT NOT NULL,
            n_tokens INTEGER NOT NULL,
            data BLOB NOT NULL,
            checksum TEXT NOT NULL,
            last_used REAL NOT NULL
        );
        CREATE TABLE session_blocks (
            session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            key BLOB NOT NULL,
            PRIMARY KEY (session_id, position)
        );
        CREATE INDEX session_blocks_key ON session_blocks(key);
        CREATE TABLE session_tails (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            fingerprint TEXT NOT NULL,
            parent_key BLOB,
            tokens BLOB NOT NULL,
            codec TEXT NOT NULL,
            data BLOB NOT NULL,
            checksum TEXT NOT NULL,
            updated REAL NOT NULL
        );
        -- full-text search over messages, laid out as sqlite-utils' enable_fts does, so table.search works
        CREATE VIRTUAL TABLE messages_fts USING FTS5 (content, content="messages");
        CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content);
        END;
        CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
        END;
        CREATE TRIGGER messages_au AFTER UPDATE ON messages BEGIN
            INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content);
            INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content);
        END;
        """,
    )


MIGRATIONS = [_v1]  # step i brings user_version from i to i + 1
SCHEMA_VERSION = len(MIGRATIONS)


def open_database(path: str | Path) -> sqlite_utils.Database:
    """Open (creating if needed) and upgrade the database; refuse one from a newer version."""
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a database")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: not a llama-chat database ({e})") from None
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreError(
            f"{path}: written by a newer llama-chat (schema {version}; this version knows up to "
            f"{SCHEMA_VERSION}); it was left untouched"
        )
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL keeps the database consistent through a crash
        if version < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # another process may have upgraded while we waited for the lock
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](conn)
                    conn.execute(f"PRAGMA user_version = {step + 1}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return sqlite_utils.Database(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise StoreError(f"{path}: cannot use the database ({e})") from None
