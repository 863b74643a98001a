"""Faults a user meets: a full disk, a held lock, signals, damaged files, two writers, read-only files.

The rule each test checks: a reply the user has seen is stored, or the user is told in one line that
it was not and why; a failed command changes nothing; no traceback; exit codes as shells expect.
Faults are real where the machine allows (signals to a real process, a held BEGIN IMMEDIATE, damaged
copies of a database, a small filesystem, read-only mounts) and simulated by SQLite itself otherwise
(PRAGMA max_page_count is SQLite's own "database or disk is full").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llama_chat.app.chat.engine import ChatEngine, SavedReply
from llama_chat.app.chat.jobs import stream_text
from llama_chat.app.cli import main
from llama_chat.inference import SamplingParams, load_model
from llama_chat.storage import ChatStore, open_database
from llama_chat.storage.connection import StoreConnection

GREEDY = SamplingParams(temperature=0)
PATIENCE_S = 300  # how long a test waits for a child to get somewhere: generous, the machine is shared


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def engine_for(path, db):
    return ChatEngine(load_model(path, block_size=8), ChatStore(db))


def chat(engine, session, text, max_tokens=8):
    return "".join(stream_text(engine.reply(session, text, sampling=GREEDY, max_tokens=max_tokens)))


def roles(db: Path, session_id: str) -> list[str]:
    store = ChatStore(db)
    try:
        return [m.role for m in store.path(store.get_session(session_id).head_id)]
    finally:
        store.close()


def a_database(qwen2, db: Path, turns: int = 1) -> str:
    """A database holding one session with `turns` exchanges; returns the session's id."""
    engine = engine_for(qwen2, db)
    session = engine.new_session("kept")
    for i in range(turns):
        chat(engine, session, f"question {i} about the world")
    engine._store.close()
    return session.id


def one_line_error(err: str) -> str:
    """The error a command printed: exactly one line, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("llama-chat: error:")]
    assert len(lines) == 1, err
    return lines[0]


def digest(*paths: Path) -> list[str | None]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None for p in paths]


# -- a real child process, its output read as it comes ----------------------------------------------

# The model made slow (each forward pass says so on stderr, then waits), so that a test can act while a
# reply is being read or written; the prefill batch made small, so that a short prompt has several.
# Every pass, whichever Model method the scheduler calls, ends in forward.step or forward.read_and_verify
# (tests/conftest.py's forward_passes does the same in-process). Ctrl+C as a shell leaves it to a program
# it starts: a test runner's worker may ignore SIGINT, and a child inherits an ignored signal.
CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from llama_chat.inference import forward, model as llm
slow = float(sys.argv[2])
def slowed(real):
    def run(*args, **kwargs):
        print("(forward)", file=sys.stderr, flush=True)
        time.sleep(slow)
        return real(*args, **kwargs)
    return run
def small_batches(real):
    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.prefill_batch = int(sys.argv[1])
    return init
llm.Model.__init__ = small_batches(llm.Model.__init__)
forward.step = slowed(forward.step)  # a prompt's piece, or the replies' next rows
forward.read_and_verify = slowed(forward.read_and_verify)  # both in one pass
from llama_chat.app.cli import main
sys.exit(main(sys.argv[3:]))
"""


class Child:
    def __init__(self, args: list[str], prefill_batch: int = 512, slow: float = 0.0, prefix=()):
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", CHILD, str(prefill_batch), str(slow), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(pipe, into: list[bytes]) -> None:
        while chunk := pipe.read1(4096):
            into.append(chunk)

    @property
    def stdout(self) -> str:
        return b"".join(self.out).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return b"".join(self.err).decode("utf-8", "replace").replace("(forward)\n", "")

    @property
    def computing(self) -> bool:
        return b"(forward)" in b"".join(self.err)

    def wait_until(self, done, what: str) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not done():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"never saw {what}; rc {self.proc.poll()}\n{self.stderr}")
            time.sleep(0.02)

    def finish(self) -> int:
        rc = self.proc.wait(timeout=PATIENCE_S)
        for t in self.readers:
            t.join(timeout=PATIENCE_S)
        return rc


def cli_args(db: Path, model: Path, *args: str) -> list[str]:
    return ["--db", str(db), "--model", str(model), *args]


# -- 1. a full disk ---------------------------------------------------------------------------------


def test_a_full_disk_stores_the_whole_turn_or_nothing_and_says_so(qwen2, tmp_path, monkeypatch, capsys):
    db = tmp_path / "chat.db"
    with sqlite3.connect(db) as conn:  # small pages: a long reply needs a new (overflow) page
        conn.execute("PRAGMA page_size = 512")
        conn.execute("VACUUM")
    session_id = a_database(qwen2, db)
    with sqlite3.connect(db) as conn:
        conn.execute("VACUUM")  # no free pages left to reuse: the next new page grows the file

    def cramped(path, **options):  # the file may not grow by one page: SQLite's "database or disk is full"
        database = open_database(path, **options)
        pages = database.conn.execute("PRAGMA page_count").fetchone()[0]
        database.conn.execute(f"PRAGMA max_page_count = {pages}")
        return database

    monkeypatch.setattr("llama_chat.storage.connection.open_database", cramped)
    ask = ["ask", "--session", session_id, "--temp", "0", "--max-tokens", "150", "and what then"]
    assert main(cli_args(db, qwen2, *ask)) == 2
    out, err = capsys.readouterr()
    assert out.strip()  # the reply was shown...
    line = one_line_error(err)  # ...and the user is told it was not stored, and why
    assert "the reply was not stored" in line and "disk is full" in line
    new = ["ask", "--new-session", "--temp", "0", "--max-tokens", "150", "hello the world"]
    assert main(cli_args(db, qwen2, *new)) == 2
    assert "the reply was not stored" in one_line_error(capsys.readouterr().err)
    assert [s.id for s in ChatStore(db).list_sessions()] == [session_id]  # no empty session left behind
    monkeypatch.undo()  # space again
    assert roles(db, session_id) == ["user", "assistant"]  # no question left without its answer
    assert main(cli_args(db, qwen2, *ask)) == 0
    assert roles(db, session_id) == ["user", "assistant"] * 2
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MB filesystem of its own (a tmpfs), where this machine lets a test mount one."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small filesystem here")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path, leave: int) -> None:
    """Fill the filesystem up to `leave` bytes free."""
    with open(folder / "filler", "ab") as f:
        free = shutil.disk_usage(folder).free
        f.write(b"\0" * max(0, free - leave))
        f.flush()
        os.fsync(f.fileno())


def test_a_full_filesystem_is_named_as_such_and_can_still_be_read(qwen2, small_filesystem, capsys):
    db = small_filesystem / "chat.db"
    session_id = a_database(qwen2, db)
    fill(small_filesystem, 0)
    base = cli_args(db, qwen2)
    assert main([*base, "sessions", "list"]) == 0  # reading needs no room
    assert session_id in capsys.readouterr().out
    for command in (["ask", "--session", session_id, "and then"], ["sessions", "rename", session_id, "x"]):
        assert main([*base, *command]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "disk is full" in line and "not a llama-chat database" not in line
    (small_filesystem / "filler").unlink()
    assert roles(db, session_id) == ["user", "assistant"]


# -- 2. another process holds the write lock ---------------------------------------------------------


def test_a_held_write_lock_is_waited_for_with_a_message_and_the_reply_is_kept(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    child = Child(
        cli_args(db, qwen2, "ask", "--session", session_id, "--temp", "0", "--max-tokens", "30", "and then"),
        slow=0.1,
    )
    child.wait_until(lambda: child.stdout.strip(), "the reply")  # mid-reply, another process takes the lock
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    child.wait_until(
        lambda: "another process is writing to it" in child.stderr, "a message"
    )  # it says why...
    assert child.proc.poll() is None  # ...and waits, however long that takes
    holder.execute("COMMIT")
    holder.close()
    assert child.finish() == 0, child.stderr
    assert "Traceback" not in child.stderr
    store = ChatStore(db)
    stored = store.path(store.get_session(session_id).head_id)
    assert [m.role for m in stored] == ["user", "assistant"] * 2
    assert stored[-1].content == child.stdout.removesuffix("\n")  # the reply that was shown


# -- 3. signals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signals", "code"),
    [((signal.SIGTERM,), 143), ((signal.SIGHUP,), 129), ((signal.SIGINT,), 130), ((signal.SIGINT,) * 2, 130)],
    ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGINT twice"],
)
def test_a_signal_during_a_reply_stores_what_was_shown_and_exits_as_shells_expect(
    qwen2, tmp_path, signals, code
):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    ask = ["ask", "--session", session_id, "--temp", "0", "--max-tokens", "200", "and then"]
    child = Child(cli_args(db, qwen2, *ask), slow=0.1)
    child.wait_until(lambda: child.stdout.strip(), "the reply")
    for s in signals:
        child.proc.send_signal(s)
    assert child.finish() == code
    assert "Traceback" not in child.stderr
    name = signal.Signals(signals[0]).name
    store = ChatStore(db)
    stored = store.path(store.get_session(session_id).head_id)
    if "the reply was not stored" in child.stderr:  # a second signal while it was being stored: said
        assert [m.role for m in stored] == ["user", "assistant"]
        return
    assert f"stop: cancelled by {name}" in child.stderr
    assert [m.role for m in stored] == ["user", "assistant"] * 2
    assert stored[-1].content == child.stdout.removesuffix("\n")
    assert 0 < len(stored[-1].content) and stored[-1].stats["stop_reason"] == "cancelled"


def test_ctrl_c_in_chat_stops_the_reply_and_the_chat_goes_on(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    # 4 s a reply: a slowed pass for every token (prompt lookup could take many in one pass, and a
    # reply over before the signal arrives leaves SIGINT to the prompt, where it only drops a line)
    chat_cli = ["chat", "--session", session_id, "--temp", "0", "--max-tokens", "40", "--no-lookup"]
    child = Child(cli_args(db, qwen2, *chat_cli), slow=0.1)
    child.proc.stdin.write(b"hello the world\n")
    child.proc.stdin.flush()
    # the reply's text, not input()'s "> " prompt on stdout: a signal at the prompt cancels no reply
    child.wait_until(lambda: child.stdout.replace(">", "").strip(), "the reply")
    child.proc.send_signal(signal.SIGINT)
    child.wait_until(lambda: "stop: cancelled by SIGINT" in child.stderr, "the reply stopped")
    child.proc.stdin.write(b"and then\n")
    child.proc.stdin.close()  # Ctrl+D after the next reply
    assert child.finish() == 0, child.stderr
    assert "Traceback" not in child.stderr
    store = ChatStore(db)
    stored = store.path(store.get_session(session_id).head_id)
    assert [m.content for m in stored if m.role == "user"][1:] == ["hello the world", "and then"]
    assert [m.role for m in stored] == ["user", "assistant"] * 3
    assert stored[3].stats["stop_reason"] == "cancelled" and stored[5].stats["stop_reason"] != "cancelled"


def test_ctrl_c_at_the_chat_prompt_drops_the_line_and_the_chat_goes_on(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    child = Child(cli_args(db, qwen2, "chat", "--session", session_id, "--temp", "0", "--max-tokens", "4"))
    child.wait_until(lambda: "Ctrl+D ends" in child.stderr, "the prompt")
    # as a Ctrl+C pressed a moment after a reply ended; the hint is printed just before input() is
    # reached, so on a busy machine a first signal may land before the prompt waits: pressed again
    deadline = time.monotonic() + PATIENCE_S
    while "(Ctrl+D ends the chat)" not in child.stderr and child.proc.poll() is None:
        assert time.monotonic() < deadline, child.stderr
        child.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    child.wait_until(lambda: "(Ctrl+D ends the chat)" in child.stderr, "the line dropped")
    child.proc.stdin.write(b"and then\n")
    child.proc.stdin.close()
    assert child.finish() == 0, child.stderr
    assert "Traceback" not in child.stderr
    store = ChatStore(db)
    stored = store.path(store.get_session(session_id).head_id)
    assert [m.content for m in stored if m.role == "user"][-1] == "and then"


def test_ctrl_c_during_a_long_prompt_stops_between_prefill_batches(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    prompt = "a long question about the sun and the world " * 4
    ask = ["ask", "--session", session_id, "--temp", "0", "--max-tokens", "20", prompt]
    child = Child(cli_args(db, qwen2, *ask), prefill_batch=8, slow=0.3)
    child.wait_until(lambda: child.computing, "the prefill start")
    child.proc.send_signal(signal.SIGINT)
    assert child.finish() == 130
    assert "stop: cancelled by SIGINT" in child.stderr and "Traceback" not in child.stderr
    store = ChatStore(db)
    session = store.get_session(session_id)
    stored = store.path(session.head_id)
    assert [m.role for m in stored] == ["user", "assistant"] * 2 and stored[-1].content == ""
    prompt_tokens = stored[-1].stats["prompt_tokens"]
    assert stored[-1].stats["prefilled_tokens"] < prompt_tokens - 8  # the rest was never computed
    assert session.n_tokens < prompt_tokens  # and the snapshot did not compute it either


# -- 4. damaged files --------------------------------------------------------------------------------


def crash_image(db: Path, into: Path) -> Path:
    """The files as a crash would leave them: copied while a connection is open."""
    into.mkdir()
    for suffix in ("", "-wal"):
        source = db.with_name(db.name + suffix)
        if source.exists():
            shutil.copyfile(source, into / source.name)
    return into / db.name


def test_a_lost_or_truncated_wal_loses_no_committed_turn(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    engine = engine_for(qwen2, db)
    session = engine.new_session("kept")
    chat(engine, session, "question one")
    chat(engine, session, "question two")
    for damage in ("delete", "truncate"):
        copy = crash_image(db, tmp_path / damage)  # the engine's connection is still open
        wal = copy.with_name(copy.name + "-wal")
        if damage == "delete":
            wal.unlink(missing_ok=True)
        elif wal.exists():
            wal.write_bytes(wal.read_bytes()[: wal.stat().st_size // 2])
        assert roles(copy, session.id) == ["user", "assistant"] * 2, damage


def wal_with_committed_turns(qwen2, tmp_path) -> tuple[Path, str]:
    """A crash image whose -wal holds committed turns not yet in the main file (as any SQLite
    program's crash between its commit and the next checkpoint leaves), the -wal then damaged."""
    db = tmp_path / "live" / "chat.db"
    db.parent.mkdir()
    session_id = a_database(qwen2, db)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    for i in range(6):  # several commits: several frames, each a page of 4096 bytes
        conn.execute("BEGIN")
        head = conn.execute("SELECT head_id FROM sessions WHERE id = ?", (session_id,)).fetchone()[0]
        cur = conn.execute(
            "INSERT INTO messages (parent_id, role, content, created) VALUES (?, ?, ?, 0)",
            (head, "user" if i % 2 == 0 else "assistant", f"turn {i} " + "x" * 3000),
        )
        conn.execute("UPDATE sessions SET head_id = ? WHERE id = ?", (cur.lastrowid, session_id))
        conn.execute("COMMIT")
    copy = crash_image(db, tmp_path / "copy")
    conn.close()
    wal = copy.with_name(copy.name + "-wal")
    data = bytearray(wal.read_bytes())
    data[32 + 24 + 100] ^= 0xFF  # a byte of the first frame's page: every later frame is dropped
    wal.write_bytes(bytes(data))
    return copy, session_id


def test_a_damaged_wal_is_refused_in_one_line_and_left_untouched(qwen2, tmp_path, capsys):
    copy, session_id = wal_with_committed_turns(qwen2, tmp_path)
    files = [copy, copy.with_name(copy.name + "-wal")]
    before = digest(*files)
    for command in (["sessions", "list"], ["ask", "--session", session_id, "hi"]):
        assert main(cli_args(copy, qwen2, *command)) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "-wal file is damaged" in line and "sessions check" in line
    assert digest(*files) == before  # nothing folded into the main file, nothing deleted

    assert main(["--db", str(copy), "sessions", "check"]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and "recovered" in out and ("sqlite3" in out or "copying" in out)
    assert digest(*files) == before
    recovered = copy.with_name("chat.recovered.db")
    assert roles(recovered, session_id) == ["user", "assistant"]  # what the readable part holds


def damage_table(db: Path, table: str) -> None:
    """Overwrite the middle of the table's root page, as a bad sector or a stray write would."""
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    with open(db, "r+b") as f:
        f.seek((root - 1) * size + 8)
        f.write(b"\xa5" * (size // 2))


def test_damaged_pages_give_one_line_and_are_never_written_to(qwen2, tmp_path, capsys):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db, turns=2)
    damage_table(db, "messages")
    before = digest(db)
    base = cli_args(db, qwen2)
    for command in (
        ["sessions", "show", session_id],
        ["ask", "--session", session_id, "hi"],
        ["sessions", "rename", session_id, "new title"],
    ):
        assert main([*base, *command]) == 2, command
        line = one_line_error(capsys.readouterr().err)
        assert "damaged" in line and "sessions check" in line, line
    assert digest(db) == before

    assert main(["--db", str(db), "sessions", "check"]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and "recovered" in out
    recovered = ChatStore(db.with_name("chat.recovered.db"))
    assert [s.id for s in recovered.list_sessions()] == [session_id]  # the session row survived


def test_a_file_is_read_through_for_damage_only_where_damage_may_have_come_in(tmp_path, monkeypatch):
    """Every page of an archive read on each open was the cost of its size: the whole file is checked
    when it is new to us (a copy), changed by another program, or left by a crash, not when llama-chat
    left it last, closed or not (the commands end with it open)."""
    checks = []
    quick_check = StoreConnection._quick_check
    monkeypatch.setattr(StoreConnection, "_quick_check", lambda self: checks.append(1) or quick_check(self))
    db = tmp_path / "chat.db"
    store = ChatStore(db)
    session = store.create_session("kept")
    store.close()
    ChatStore(db).close()
    assert len(checks) == 1  # when it was made, not since
    command = (
        "import sys; from llama_chat.storage import ChatStore; "
        "ChatStore(sys.argv[1]).rename_session(*sys.argv[2:])"
    )
    subprocess.run([sys.executable, "-c", command, str(db), session.id, "renamed"], check=True)
    ChatStore(db).close()
    assert len(checks) == 1
    with sqlite3.connect(db) as conn:  # another program
        conn.execute("UPDATE sessions SET title = 'changed'")
    conn.close()
    ChatStore(db).close()
    ChatStore(db).close()
    assert len(checks) == 2
    shutil.copyfile(db, tmp_path / "copy.db")
    ChatStore(tmp_path / "copy.db").close()
    assert len(checks) == 3
    crashed = ChatStore(db)
    crashed.rename_session(session.id, "written by a process still running, or killed")
    ChatStore(db).close()
    assert len(checks) == 4


def test_damage_with_the_file_times_put_back_is_found(qwen2, tmp_path, capsys):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    before = db.stat()
    damage_table(db, "messages")
    os.utime(db, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert db.stat().st_size == before.st_size
    assert main(["--db", str(db), "sessions", "show", session_id]) == 2
    assert "damaged" in one_line_error(capsys.readouterr().err)


def test_text_that_is_not_utf8_gives_one_line(qwen2, tmp_path, capsys):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE sessions SET system_prompt = CAST(x'c328ff' AS TEXT)")
    assert main(["--db", str(db), "sessions", "show", session_id]) == 2
    assert "damaged" in one_line_error(capsys.readouterr().err)


def test_check_says_ok_on_a_sound_database(qwen2, tmp_path, capsys):
    db = tmp_path / "chat.db"
    a_database(qwen2, db)
    assert main(["--db", str(db), "sessions", "check"]) == 0
    assert "ok" in capsys.readouterr().out
    assert not db.with_name("chat.recovered.db").exists()


# -- 5. two replies in the same session at once -----------------------------------------------------


def test_two_replies_at_once_in_one_session_never_interleave(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    first, second = engine_for(qwen2, db), engine_for(qwen2, db)  # two processes, as far as SQLite knows
    session = first._store.get_session(session_id)
    saved = SavedReply()
    other_ended = threading.Event()
    # the first reply is under way (its first piece out, its scheduler held there)...
    slow = first.reply(
        session,
        "hello the world",
        sampling=GREEDY,
        max_tokens=8,
        saved=saved,
        on_event=lambda e: e.kind == "text" and other_ended.wait(60),
    )
    chat(second, second._store.get_session(session_id), "second question")  # ...when another one ends
    other_ended.set()
    slow.wait()
    shown = slow.text()

    assert saved.branched and saved.session.id != session_id and saved.session.forked_from == session_id
    store = ChatStore(db)
    main_line = store.path(store.get_session(session_id).head_id)
    branch = store.path(saved.session.head_id)
    assert [m.content for m in main_line][2:3] == ["second question"] and len(main_line) == 4
    assert [m.content for m in branch][:2] == [m.content for m in main_line][:2]  # the same start
    assert [m.role for m in branch] == ["user", "assistant"] * 2
    assert branch[2].content == "hello the world" and branch[3].content == shown  # each under its question


def test_a_reply_whose_session_moved_on_meanwhile_goes_on_a_new_branch_and_says_so(qwen2, tmp_path):
    db = tmp_path / "chat.db"
    session_id = a_database(qwen2, db)
    ask = ["ask", "--session", session_id, "--temp", "0", "--max-tokens", "30", "hello the world"]
    child = Child(cli_args(db, qwen2, *ask), slow=0.1)
    child.wait_until(lambda: child.stdout.strip(), "the reply")
    other = sqlite3.connect(db, isolation_level=None)  # another process answers in the same session
    other.execute("BEGIN IMMEDIATE")
    head = other.execute("SELECT head_id FROM sessions WHERE id = ?", (session_id,)).fetchone()[0]
    for role in ("user", "assistant"):
        head = other.execute(
            "INSERT INTO messages (parent_id, role, content, created) VALUES (?, ?, ?, 0)",
            (head, role, f"the other {role}"),
        ).lastrowid
    other.execute("UPDATE sessions SET head_id = ? WHERE id = ?", (head, session_id))
    child.wait_until(lambda: "another process is writing to it" in child.stderr, "the child waiting")
    other.execute("COMMIT")
    assert child.finish() == 0, child.stderr
    assert "stored on a new branch" in child.stderr
    store = ChatStore(db)
    assert [m.content for m in store.path(store.get_session(session_id).head_id)][2:] == [
        "the other user",
        "the other assistant",
    ]
    branch = next(s for s in store.list_sessions() if s.forked_from == session_id)
    stored = store.path(branch.head_id)
    assert [m.role for m in stored] == ["user", "assistant"] * 2
    assert stored[2].content == "hello the world" and stored[3].content == child.stdout.removesuffix("\n")


# -- 6. read-only files ------------------------------------------------------------------------------


def read_only_prefix(path: Path) -> list[str]:
    """A command prefix under which `path` (a file or a folder) cannot be written, even by root: a
    read-only bind mount in a mount namespace of its own. Without root, plain permissions do it."""
    if os.geteuid() != 0:
        for p in [path, *(path.iterdir() if path.is_dir() else [])]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        return []
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a read-only mount")
    script = f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" "{path}" && exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", script, "sh"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("cannot make a read-only mount here")
    return prefix


def run_read_only(path: Path, args: list[str]) -> tuple[int, str, str]:
    child = Child(args, prefix=read_only_prefix(path))
    rc = child.finish()
    return rc, child.stdout, child.stderr


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_database_reads_and_refuses_writes_in_one_line(qwen2, tmp_path, what):
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "chat.db"
    session_id = a_database(qwen2, db)
    before = sorted(os.listdir(folder)), digest(db)
    target = db if what == "file" else folder
    rc, out, err = run_read_only(target, ["--db", str(db), "sessions", "list"])
    assert rc == 0 and session_id in out, err
    exported = tmp_path / "out.llamachat"
    rc, _, err = run_read_only(target, ["--db", str(db), "export", session_id, "-o", str(exported)])
    assert rc == 0 and exported.stat().st_size > 0, err
    for command in (["sessions", "rename", session_id, "new"], ["ask", "--session", session_id, "hi"]):
        rc, out, err = run_read_only(target, cli_args(db, qwen2, *command))
        assert rc == 2, err
        assert "read-only" in one_line_error(err)
        assert out == ""  # no reply computed that could not be stored
    assert (sorted(os.listdir(folder)), digest(db)) == before  # no -wal or -shm left behind


def test_a_database_under_a_read_only_folder_is_one_line(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    rc, _, err = run_read_only(folder, ["--db", str(folder / "sub" / "chat.db"), "sessions", "list"])
    assert rc == 2 and "cannot create its folder" in one_line_error(err)
