"""`llama-chat sessions check`: find damage in a database file and recover what can be read into a new one.

The damaged file is never opened for writing: SQLite's first connection would fold a damaged -wal's
readable part into the main file and delete the rest. Everything here works on a copy.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .db import StoreError, open_database, wal_damage


@dataclass
class CheckReport:
    problems: list[str] = field(default_factory=list)  # empty: the file is sound
    recovered_to: Path | None = None
    method: str = ""  # how it was recovered
    sessions: int = 0
    messages: int = 0


def check_database(path: Path, out: Path | None = None) -> CheckReport:
    """PRAGMA integrity_check on a copy of the file (and its -wal); when damaged, recover into `out`."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no database there")
    report = CheckReport()
    damage = wal_damage(path)
    if damage:
        report.problems.append(damage)
    with tempfile.TemporaryDirectory(prefix="llama-chat-check-") as tmp:
        copy = _copy_with_wal(path, Path(tmp))
        try:
            conn = sqlite3.connect(copy)
            report.problems += [
                r[0] for r in conn.execute("PRAGMA integrity_check").fetchall() if r[0] != "ok"
            ]
            conn.close()
        except sqlite3.DatabaseError as e:
            report.problems.append(str(e))
        if not report.problems:
            return report
        report.recovered_to = out or _free_name(path)
        report.method = recover(copy, report.recovered_to)
    store = sqlite3.connect(report.recovered_to)
    report.sessions = store.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
    report.messages = store.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    store.close()
    return report


def recover(damaged: Path, out: Path) -> str:
    """Everything readable of `damaged` into a new database `out`; returns how it was done.

    SQLite's recovery (the sqlite3 command's .recover) reads pages directly and finds rows a damaged
    b-tree no longer reaches; where that command is missing or built without it, rows are copied one
    by one, stepping over what cannot be read."""
    if out.exists():
        raise StoreError(f"{out}: already exists; give another file to recover into")
    if _recover_with_sqlite3_command(damaged, out):
        method = "the sqlite3 command's .recover"
    else:
        out.unlink(missing_ok=True)
        _copy_readable_rows(damaged, out)
        method = "copying the rows that could be read (the sqlite3 command with .recover is not available)"
    _mend(out)
    open_database(out).conn.close()  # a llama-chat database again: schema checked or upgraded
    return method


def _recover_with_sqlite3_command(damaged: Path, out: Path) -> bool:
    command = shutil.which("sqlite3")
    if command is None:
        return False
    found = subprocess.run(
        [command, str(damaged), ".recover"], capture_output=True, text=True, errors="replace"
    )
    if found.returncode != 0 or "error" in found.stderr.lower():
        return False  # e.g. a build without the sqlite_dbpage table .recover needs
    conn = sqlite3.connect(out)
    try:
        conn.executescript(found.stdout)
    except sqlite3.Error:
        return False
    finally:
        conn.close()
    return True


def _copy_readable_rows(damaged: Path, out: Path) -> None:
    src = sqlite3.connect(damaged)
    src.text_factory = lambda b: b.decode("utf-8", "replace")  # a damaged string is kept, marked, not lost
    dst = open_database(out).conn  # today's schema: a damaged file of an older one comes back upgraded
    dst.execute("PRAGMA foreign_keys = OFF")  # a message's parent may be among what was lost
    try:
        # Every table but the full-text indexes, which their triggers fill as messages and sessions come in.
        tables = dst.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'messages_fts%' "
            "AND name NOT LIKE 'titles_fts%' AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        for (table,) in tables:
            try:
                theirs = {r[1] for r in src.execute(f'PRAGMA table_info("{table}")')}
            except sqlite3.DatabaseError:
                continue  # its schema is lost with the page that held it
            names = [r[1] for r in dst.execute(f'PRAGMA table_info("{table}")') if r[1] in theirs]
            if not names:
                continue
            marks = ", ".join("?" * len(names))
            dst.execute("BEGIN")
            dst.executemany(
                f"INSERT OR IGNORE INTO {table} ({', '.join(names)}) VALUES ({marks})",
                _readable_rows(src, table, names),
            )
            dst.execute("COMMIT")
    finally:
        src.close()
        dst.close()


def _readable_rows(conn: sqlite3.Connection, table: str, names: list[str]):
    """The rows of `table` that can be read, in rowid order, stepping over damaged pages."""
    last = -(2**63)
    query = f"SELECT rowid, {', '.join(names)} FROM {table} WHERE rowid > ? ORDER BY rowid"
    while True:
        try:
            for row in conn.execute(query, (last,)):
                last = row[0]
                yield row[1:]
            return
        except sqlite3.DatabaseError:
            step = 1  # find where rows can be read again, further and further on
            while True:
                if step > 2**40:
                    return
                try:
                    conn.execute(f"{query} LIMIT 1", (last + step,)).fetchall()
                    break
                except sqlite3.DatabaseError:
                    step *= 2
            last += step


def _mend(out: Path) -> None:
    """References to what was lost point nowhere instead: a message whose parent is gone starts its
    tree, a session whose head is gone is empty, and a session's blocks are recomputed as needed.
    The full-text indexes are built again from the messages and titles that came back."""
    conn = sqlite3.connect(out)
    with conn:
        conn.execute("UPDATE messages SET parent_id = NULL WHERE parent_id NOT IN (SELECT id FROM messages)")
        conn.execute("UPDATE sessions SET head_id = NULL WHERE head_id NOT IN (SELECT id FROM messages)")
        conn.execute(
            "UPDATE sessions SET forked_from = NULL WHERE forked_from NOT IN (SELECT id FROM sessions)"
        )
        conn.execute("DELETE FROM session_blocks WHERE session_id NOT IN (SELECT id FROM sessions)")
        conn.execute("DELETE FROM session_tails WHERE session_id NOT IN (SELECT id FROM sessions)")
        conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'titles_fts'").fetchone():
            conn.execute("INSERT INTO titles_fts (titles_fts) VALUES ('rebuild')")  # (an older file has none)
    conn.close()


def _copy_with_wal(path: Path, folder: Path) -> Path:
    copy = folder / path.name
    shutil.copyfile(path, copy)
    wal = path.with_name(path.name + "-wal")
    if wal.exists():
        shutil.copyfile(wal, folder / wal.name)
    return copy


def _free_name(path: Path) -> Path:
    n = 0
    while True:
        candidate = path.with_name(f"{path.stem}.recovered{'-' + str(n) if n else ''}{path.suffix}")
        if not candidate.exists():
            return candidate
        n += 1
