"""Opening the conversation database: pragmas, and schema upgrades as numbered steps on user_version.

A database written by a newer llama-chat (a higher user_version than we know) is refused before
anything is written to it, so an older program never alters what a newer one saved.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

from . import fragments

Progress = Callable[[str, int, int], None]  # progress(label, done, total) of a long step


class StoreError(Exception):
    """A problem with the conversation store a user can cause: one line naming the thing and the problem.

    `brief`, where the database itself failed (not what was asked of it, e.g. an unknown session):
    that line without the file's path, for those who must not see it (a server's clients);
    `full`: the problem is a full disk."""

    def __init__(self, message: str, brief: str | None = None, full: bool = False):
        super().__init__(message)
        self.brief = brief
        self.full = full


def _run_script(conn: sqlite3.Connection, script: str) -> None:
    """Run statements one by one: executescript() would COMMIT the upgrade's transaction half-way."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""


def _v1(conn: sqlite3.Connection, progress: Progress | None) -> None:
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
        -- full-text search over messages (search.py), kept in step by triggers
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


def _v2(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """KV blocks carry their token ids, checked on every hit, and a namespace: '' for blocks computed
    (or verified) here, which every session shares; an import's own for the blocks it brought, which
    only its sessions and their forks (sessions.kv_namespace) read until `sessions verify`. Blocks
    stored so far are dropped: they have no tokens to check, and some may come from files imported
    before imports had namespaces. KV is a cache; they are recomputed when next needed."""
    _run_script(
        conn,
        """
        ALTER TABLE sessions ADD COLUMN kv_namespace BLOB;
        DROP TABLE kv_blocks;
        CREATE TABLE kv_blocks (
            namespace BLOB NOT NULL,
            key BLOB NOT NULL,
            fingerprint TEXT NOT NULL,
            codec TEXT NOT NULL,
            n_tokens INTEGER NOT NULL,
            data BLOB NOT NULL,
            checksum TEXT NOT NULL,
            last_used REAL NOT NULL,
            tokens BLOB NOT NULL,
            PRIMARY KEY (namespace, key)
        );
        """,
    )


def _v3(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """Sessions say who made them: NULL for a person (the TUI, the CLI), 'api' for a conversation a
    client of `llama-chat serve` sent without naming a session."""
    conn.execute("ALTER TABLE sessions ADD COLUMN origin TEXT")


def _v4(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """Sessions say whose they are: NULL for the machine's owner (the TUI, the CLI, a server with one API
    key), else the name of the tenant of `llama-chat serve` whose key made them; no other tenant sees them."""
    conn.execute("ALTER TABLE sessions ADD COLUMN tenant TEXT")


def _v5(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """Attached files: their texts stored once, by content hash, and referred to by messages
    (storage/fragments.py)."""
    _run_script(conn, fragments.SCHEMA)


def _v6(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """Each session keeps the token ids of its conversation, sealed with the digest of what they were made
    from (app/chat/resume.py) and of themselves: a resume need not tokenize it again. Only a cache: ids
    under another seal are ignored and made again; none are kept yet (the next reply's snapshot keeps
    them)."""
    _run_script(
        conn,
        """
        CREATE TABLE session_token_ids (
            session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
            seal BLOB NOT NULL,
            ids BLOB NOT NULL
        );
        """,
    )


def _v7(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """Indexes that keep an archive's cost that of the question, not of the archive's size: the sessions
    whose head a message is (search finds a hit's sessions from the hit down to their heads), and the
    sessions newest first (a page of them)."""
    _run_script(
        conn,
        """
        CREATE INDEX IF NOT EXISTS sessions_head ON sessions(head_id);
        CREATE INDEX IF NOT EXISTS sessions_newest ON sessions(updated DESC, created DESC);
        """,
    )


def _v8(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """A reply keeps its thinking (a reasoning model's `<think>`, harmony's analysis channel) apart
    from its answer: NULL where it has none."""
    conn.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT")


def _v9(conn: sqlite3.Connection, progress: Progress | None) -> None:
    """An index of the sessions' titles (FTS5, by trigrams: any run of three or more characters of a
    title is found without reading every title; storage/search.py), kept in step by triggers, as the
    messages' is. It follows the sessions' rowids, which VACUUM keeps. The titles stored so far are
    indexed in batches, told to `progress`: a large archive takes seconds."""
    _run_script(
        conn,
        """
        CREATE VIRTUAL TABLE IF NOT EXISTS titles_fts
            USING FTS5 (title, content="sessions", tokenize="trigram");
        CREATE TRIGGER IF NOT EXISTS sessions_ai AFTER INSERT ON sessions BEGIN
            INSERT INTO titles_fts (rowid, title) VALUES (new.rowid, new.title);
        END;
        CREATE TRIGGER IF NOT EXISTS sessions_ad AFTER DELETE ON sessions BEGIN
            INSERT INTO titles_fts (titles_fts, rowid, title) VALUES ('delete', old.rowid, old.title);
        END;
        CREATE TRIGGER IF NOT EXISTS sessions_au AFTER UPDATE OF title ON sessions BEGIN
            INSERT INTO titles_fts (titles_fts, rowid, title) VALUES ('delete', old.rowid, old.title);
            INSERT INTO titles_fts (rowid, title) VALUES (new.rowid, new.title);
        END;
        INSERT INTO titles_fts (titles_fts) VALUES ('delete-all');
        """,
    )
    total = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
    done, after = 0, -(2**63)
    while batch := conn.execute(
        "SELECT rowid, title FROM sessions WHERE rowid > ? ORDER BY rowid LIMIT ?", (after, INDEX_BATCH)
    ).fetchall():
        conn.executemany("INSERT INTO titles_fts (rowid, title) VALUES (?, ?)", batch)
        after, done = batch[-1][0], done + len(batch)
        if progress:
            progress("indexing the chats' titles", done, total)


MIGRATIONS = [_v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9]  # step i brings user_version from i to i + 1
SCHEMA_VERSION = len(MIGRATIONS)
INDEX_BATCH = 10_000  # rows indexed between two reports of a step's progress

DISK_FULL = "the disk is full"
BUSY_S = 1.0  # SQLite's own wait for a lock, per try; ChatStore.transaction() keeps trying, and says so
LOW_SPACE = 1 << 20  # bytes free under which an I/O error is put down to a full disk
WAL_MAGIC, WAL_VERSION = 0x377F0682, 3007000  # from SQLite's file format: the -wal header
WAL_HEADER, WAL_FRAME_HEADER = 32, 24


def describe(e: BaseException) -> str:
    """What went wrong with the database file, in a few words a user can act on: SQLite's own message
    names the symptom ("disk I/O error"), not the cause (a full disk) nor what to do (a damaged file)."""
    code = getattr(e, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF  # extended codes carry the primary one in the low byte
    if primary == sqlite3.SQLITE_FULL or getattr(e, "errno", None) == errno.ENOSPC:
        return DISK_FULL
    if primary == sqlite3.SQLITE_BUSY:
        return "another process holds its write lock"
    if primary in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM) or isinstance(e, PermissionError):
        return "it is read-only here"
    if is_damage(e):
        return f"it is damaged ({e}); `llama-chat sessions check` recovers what can be read"
    return str(e)


def is_damage(e: BaseException) -> bool:
    """Whether an error means damaged pages: SQLite's own codes, or text that is not UTF-8 (Python's
    sqlite3 raises that one itself, with no SQLite code: "Could not decode to UTF-8 column …")."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    return code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB) or "decode to UTF-8" in str(e)


def store_error(path: Path, e: BaseException, consequence: str = "nothing was changed") -> StoreError:
    """The one line for a failed database operation: the file, why, and what it means for the user."""
    why = describe(e)
    if why == str(e) and getattr(e, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_IOERR and disk_full(path):
        why = DISK_FULL  # SQLite only knows that a write (of its -shm, its -wal) failed
    return StoreError(f"{path}: {why}; {consequence}", f"{why}; {consequence}", why == DISK_FULL)


def begin_immediate(conn: sqlite3.Connection, on_wait: Callable[[float], None] | None = None) -> None:
    """Start a write transaction, waiting as long as another process holds the write lock: SQLite's
    own wait (busy_timeout) ends in an error, which would lose a reply already shown. on_wait(seconds)
    hears of the wait after each try, and may raise to give up."""
    waited = 0.0
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")  # SQLite itself waits BUSY_S for the lock
            return
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                raise
        waited += BUSY_S
        if on_wait is not None:
            on_wait(waited)


def disk_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path.parent).free < LOW_SPACE
    except OSError:
        return False


def writable(path: Path) -> bool:
    """Whether we may write the database and the -wal/-shm files beside it (SQLite creates those)."""
    folder_ok = os.access(path.parent, os.W_OK)
    return folder_ok and (not path.exists() or os.access(path, os.W_OK))


def wal_damage(path: Path) -> str | None:
    """Why the -wal file beside the database is damaged, or None when it is absent or sound.

    SQLite silently ignores a WAL from its first bad frame on, and the first connection to close then
    writes that shortened history into the main file: committed turns vanish without a word. So the
    file is checked here, before SQLite sees it. A torn last frame is not damage (a crash while writing
    it leaves that, and SQLite rightly ignores it); a bad frame with frames of the same generation after
    it, or a bad header, is."""
    wal = path.with_name(path.name + "-wal")
    try:
        data = wal.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"its -wal file cannot be read ({e.strerror})"
    if not data:
        return None
    if len(data) < WAL_HEADER:
        return "its -wal file is truncated"
    magic, version, page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", data[:WAL_HEADER])
    if magic not in (WAL_MAGIC, WAL_MAGIC | 1) or version != WAL_VERSION:
        return "its -wal file has a damaged header"
    order = ">" if magic & 1 else "<"  # the checksums' byte order, named by the magic's last bit
    sums = _wal_checksum(data[:24], order, (0, 0))
    if sums != (c1, c2):
        return "its -wal file has a damaged header"
    frame = WAL_FRAME_HEADER + page_size
    n_frames = (len(data) - WAL_HEADER) // frame
    bad = None
    for i in range(n_frames):
        at = WAL_HEADER + i * frame
        _, _, fsalt1, fsalt2, f1, f2 = struct.unpack(">6I", data[at : at + WAL_FRAME_HEADER])
        if (fsalt1, fsalt2) != (salt1, salt2):
            break  # frames of an earlier generation, left after a checkpoint: not part of the log
        if bad is not None:
            return f"its -wal file is damaged at frame {bad + 1} of {n_frames}"
        sums = _wal_checksum(data[at : at + 8] + data[at + WAL_FRAME_HEADER : at + frame], order, sums)
        if sums != (f1, f2):
            bad = i
    return None


def _wal_checksum(data: bytes, order: str, sums: tuple[int, int]) -> tuple[int, int]:
    """SQLite's WAL checksum (a Fletcher-like sum over pairs of 32-bit words), continued from `sums`."""
    s0, s1 = sums
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    for x0, x1 in zip(words[::2], words[1::2], strict=True):
        s0 = (s0 + x0 + s1) & 0xFFFFFFFF
        s1 = (s1 + x1 + s0) & 0xFFFFFFFF
    return s0, s1


def _connect(path: Path, read_only: bool) -> sqlite3.Connection:
    if not read_only:
        return sqlite3.connect(path, timeout=BUSY_S, check_same_thread=False, isolation_level=None)
    # Read-only: nothing may be created beside the file. With no -wal content to read, `immutable`
    # opens it without a -shm; otherwise SQLite needs the -shm to read the -wal.
    wal = path.with_name(path.name + "-wal")
    has_wal = wal.exists() and wal.stat().st_size > 0
    uri = f"{path.absolute().as_uri()}?mode=ro" + ("" if has_wal else "&immutable=1")
    return sqlite3.connect(uri, uri=True, timeout=BUSY_S, check_same_thread=False, isolation_level=None)


class Database:
    """An open database file: its connection, `conn` (plain sqlite3: the store writes its own SQL, and
    a library over it would only add its imports to every command's start and the app's)."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn


def open_database(
    path: str | Path, read_only: bool | None = None, progress: Progress | None = None
) -> Database:
    """Open (creating if needed) and upgrade the database, all or nothing, telling `progress` of a
    long upgrade; refuse one from a newer version, and one whose -wal file is damaged. A database we
    may not write, or cannot for a full disk, is opened read-only (and marked so: PRAGMA query_only)."""
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a database")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"{path}: cannot create its folder ({e.strerror})") from None
    read_only = not writable(path) if read_only is None else read_only
    if read_only and not path.exists():
        raise StoreError(f"{path}: no database there, and its folder is read-only")
    damage = wal_damage(path)
    if damage:
        raise StoreError(
            f"{path}: {damage}; it was left untouched: `llama-chat sessions check` recovers what can be read"
        )
    try:
        conn = _connect(path, read_only)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as e:
        if not read_only and path.exists() and disk_full(path):
            return open_database(path, read_only=True)  # reading needs no room, writing SQLite's -shm does
        if e.sqlite_errorcode & 0xFF == sqlite3.SQLITE_NOTADB:
            raise StoreError(f"{path}: not a llama-chat database ({e})") from None
        raise store_error(path, e, "it cannot be opened") from None
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreError(
            f"{path}: written by a newer llama-chat (schema {version}; this version knows up to "
            f"{SCHEMA_VERSION}); it was left untouched"
        )
    if read_only and version < SCHEMA_VERSION:
        conn.close()
        raise StoreError(f"{path}: read-only here, and its schema needs an upgrade to be read")
    try:
        if not read_only:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL keeps the database consistent through a crash
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_S * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if version < SCHEMA_VERSION:
            begin_immediate(conn)
            try:
                # another process may have upgraded while we waited for the lock
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](conn, progress)
                    conn.execute(f"PRAGMA user_version = {step + 1}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        if read_only:
            conn.execute("PRAGMA query_only = ON")  # the connection itself says so: see ChatStore.read_only
        return Database(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise store_error(path, e, "it cannot be used") from None
