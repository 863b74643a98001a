"""The conversation database as the store uses it: one connection and its lock, all-or-nothing
transactions that wait out another process's write lock, consistent reads, and one line for each failure.
A file found damaged, on opening or by a failed query, is not written to again."""

from __future__ import annotations

import sqlite3
import threading
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from . import checked
from .db import (
    BUSY_S,
    DISK_FULL,
    Progress,
    StoreError,
    begin_immediate,
    disk_full,
    is_damage,
    open_database,
    store_error,
)

BULK_TABLES = {"kv_blocks", "session_tails"}  # KV: checked block by block on use (checksums), not on open


class StoreConnection:
    """An open database file: ChatStore and its KV tables (kv_tables.py) share one."""

    def __init__(self, path: str | Path, progress: Progress | None = None):
        self.db_path = Path(path)
        self.db = open_database(self.db_path, progress=progress)  # upgraded if older, telling progress
        self.lock = threading.RLock()  # one connection, used from the UI's workers one at a time
        # open_database() opens a file we may not write read-only, and marks the connection so
        self.read_only = bool(self.db.conn.execute("PRAGMA query_only").fetchone()[0])
        # Damaged pages may read as fewer rows, without an error: look before showing or writing anything,
        # unless the file is as llama-chat last left it (checked.py): reading every page is the cost of
        # the archive's size, not of the question.
        self.damage = None  # why the file is not fit to be used, once found
        if not checked.trusted(self.db_path):
            self.damage = self._quick_check()
            if self.damage:
                self.db.conn.close()
                raise self._damaged()
            if not self.read_only:
                checked.remember(self.db_path)
        # the file as this connection last wrote or saw it (None: never to be stamped sound, checked.py)
        self._left = [None if self.read_only else checked.file_state(self.db_path)]
        # one dropped without close() (the commands end so) or open at exit is stamped as one closed
        self._dropped = weakref.finalize(self, _stamp_as_left, self.db_path, self._left)
        # Called as on_wait(seconds) while another process holds the write lock; it may raise to give up.
        self.on_wait: Callable[[float], None] | None = None

    def close(self) -> None:
        """Close the file; stamped as sound (checked.py) when no one else wrote to it since this
        connection last did or looked."""
        ours = self._left[0] is not None and checked.file_state(self.db_path) == self._left[0]
        self._dropped.detach()
        self.db.conn.close()  # the last connection to close copies the -wal in: our own writes
        if ours:
            checked.remember(self.db_path, settle=True)

    @contextmanager
    def transaction(self):
        """All or nothing: a crash or an error inside leaves the database as it was. Waits as long as
        another process holds the write lock (telling on_wait), and refuses a damaged or read-only file."""
        with self.lock:
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
            self._left[0] = checked.file_state(self.db_path)

    @contextmanager
    def reading(self):
        """One consistent view for several reads, even while another process writes: a read
        transaction, which takes no write lock and works on a read-only file."""
        with self.lock:
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
            self._left[0] = None
            checked.forget(self.db_path)
        return store_error(self.db_path, e, consequence)

    def data_version(self) -> int:
        """SQLite's PRAGMA data_version: a number that changes when another connection (another
        process) commits to the file, and never for this connection's own commits. Reads no table."""
        return self.rows("PRAGMA data_version")[0]["data_version"]

    def insert(self, table: str, row: dict) -> None:
        names = ", ".join(row)
        self.db.conn.execute(
            f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(row))})", list(row.values())
        )

    def rows(self, sql: str, params=()) -> list[dict]:
        with self.lock:
            try:
                cur = self.db.conn.execute(sql, params)
                names = [d[0] for d in cur.description]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            except sqlite3.Error as e:
                raise self._error(e, "it cannot be read") from None


def _stamp_as_left(path: Path, left: list) -> None:
    """Stamp the file of a connection dropped without close() (checked.py) when nothing else wrote to
    it since the connection did and its -wal holds nothing, so that closing it copies nothing in."""
    wal = checked.file_state(path.with_name(path.name + "-wal"))
    if left[0] is not None and checked.file_state(path) == left[0] and (wal is None or wal[2] == 0):
        checked.remember(path, settle=True)
