"""Whether the database file is as llama-chat last left it, so that opening it need not read every page
of the conversations again to look for damage: a small file beside it (`chat.db-checked`) holds the
main file's identity, size and times as they were after a check, or after llama-chat closed it having
been its only writer. A copy, a restore, a stray write or a program that crashed while writing change
them, and the next open checks the whole file again.

A write within one tick of the file clock after the times were taken would not change them (git's
"racily clean" index entries): a stamp taken that soon after the file's last write is not trusted, and
closing waits out the tick before it stamps."""

from __future__ import annotations

import os
import time
from pathlib import Path

FINE_TICK_NS = 20_000_000  # file times in nanoseconds move with the kernel's clock tick (1/HZ: 10 ms at most)
COARSE_TICK_NS = 2_000_000_000  # file times in whole seconds (FAT: 2 s)


def stamp_path(db: Path) -> Path:
    return db.with_name(db.name + "-checked")


def file_state(db: Path) -> tuple[int, ...] | None:
    """What any write to the file changes: which file it is, its size, its times (None: no file)."""
    try:
        st = os.stat(db)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _tick_ns(mtime_ns: int) -> int:
    return COARSE_TICK_NS if mtime_ns % 1_000_000_000 == 0 else FINE_TICK_NS


def trusted(db: Path) -> bool:
    """Whether the file is as the stamp beside it says, with a stamp taken long enough after the file's
    last write that any later write would show."""
    try:
        *state, taken = (int(n) for n in stamp_path(db).read_text().split())
    except (OSError, ValueError):
        return False
    now = file_state(db)
    return now is not None and tuple(state) == now and taken - now[3] >= _tick_ns(now[3])


def remember(db: Path, settle: bool = False) -> None:
    """Stamp the file as it is now (after a check that found it sound, or after our own last write).
    `settle`: first wait out the tick of the file's last write, so that the stamp is trusted."""
    state = file_state(db)
    if state is None or trusted(db):
        return
    if settle:
        wait_ns = state[3] + _tick_ns(state[3]) - time.time_ns()
        if 0 < wait_ns <= FINE_TICK_NS:
            time.sleep(wait_ns / 1e9)
    taken = time.time_ns()  # before the state is read: a write after that read comes later still
    state = file_state(db)
    if state is None:
        return
    try:
        stamp_path(db).write_text(" ".join(str(n) for n in (*state, taken)) + "\n")
    except OSError:
        pass  # a read-only folder, a full disk: the next open checks the file again, as without a stamp


def forget(db: Path) -> None:
    """Damage was found: the next open checks the whole file."""
    try:
        stamp_path(db).unlink(missing_ok=True)
    except OSError:
        pass
