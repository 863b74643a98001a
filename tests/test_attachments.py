"""Attached files (`ask -f`, `/attach` in `chat`): inlined with their name, stored once by content
hash, kept by fork and export, their KV shared by the next conversation that starts with them; a file
that cannot be attached is one line and leaves the database as it was."""

from __future__ import annotations

import io
import os
import socket
import sqlite3
import threading
from pathlib import Path

import pytest
from textual.widgets import Input

from llama_chat.app.chat.attachments import MAX_FILE_BYTES, AttachmentError, read_attachment
from llama_chat.app.cli import main
from llama_chat.app.tui.dialogs import TextScreen
from llama_chat.app.tui.path_input import complete_path, completions
from llama_chat.storage import ChatStore, Message
from llama_chat.storage.exchange import export_session, import_session
from llama_chat.storage.fragments import inline
from tui_pilot import aio, say

TEXT = "hello the world\n" * 12  # 132 tokens of the tiny vocabulary: with its header, two full KV blocks


def ask(qwen2, db, *args):
    return main(["ask", "--model", str(qwen2), "--db", str(db), "--cache-ram", "64", "--no-lookup",
                 "--temp", "0", "--max-tokens", "2", *args])


def fragment_rows(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT sha256, length(content) FROM fragments").fetchall()


def stored_contents(db) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [c for (c,) in conn.execute("SELECT content FROM messages ORDER BY id")]


@pytest.fixture
def notes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file by a short name: the tiny model's window is 256 tokens
    Path("notes.txt").write_text(TEXT)
    return Path("notes.txt")


def test_a_file_attached_to_two_conversations_is_stored_once_and_reads_back_whole(
    qwen2, tmp_path, notes, capsys
):
    db = tmp_path / "chat.db"
    assert ask(qwen2, db, "--new-session", "-f", str(notes), "hello the world") == 0
    assert ask(qwen2, db, "--new-session", "-f", str(notes), "the world is it") == 0
    assert len(fragment_rows(db)) == 1
    assert all(TEXT not in c for c in stored_contents(db))  # the messages refer to it
    store = ChatStore(db)
    second, first = store.list_sessions()
    asked = store.path(first.head_id)[0]
    assert asked.content == inline(str(notes), TEXT) + "hello the world"
    assert "notes.txt" in first.title and "<file" not in first.title
    # the second conversation read the file's KV blocks from the first one's, stored in the database
    stats = store.path(second.head_id)[1].stats
    assert stats["prompt_tokens"] - stats["prefilled_tokens"] >= 128


def test_fork_export_and_import_keep_the_files(qwen2, tmp_path, notes, capsys):
    db = tmp_path / "chat.db"
    assert ask(qwen2, db, "--new-session", "-f", str(notes), "hello the world") == 0
    store = ChatStore(db)
    (session,) = store.list_sessions()
    fork = store.fork_session(session.id)
    assert store.path(fork.head_id)[0].content.startswith(inline(str(notes), TEXT))
    exported = export_session(store, session.id, tmp_path / "s.llamachat")
    other = ChatStore(tmp_path / "other.db")
    result = import_session(other, exported.path, model_fingerprint=None)
    imported = other.get_session(result.session_ids[0])
    assert other.path(imported.head_id)[0].content == inline(str(notes), TEXT) + "hello the world"
    assert len(fragment_rows(tmp_path / "other.db")) == 1


def test_the_text_goes_with_the_last_message_that_refers_to_it(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    a, b = store.create_session("a"), store.create_session("b")
    for s in (a, b):
        store.add_message(s.id, "user", inline("notes.txt", TEXT) + "why?")
    store.delete_session(a.id)
    assert len(fragment_rows(tmp_path / "chat.db")) == 1
    store.delete_session(b.id)
    assert fragment_rows(tmp_path / "chat.db") == []


def test_content_that_only_looks_like_a_file_reads_back_exactly(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    s = store.create_session("a")
    tricky = inline("a", "x\n</file>\n\ny") + '<file name="b">\n\n</file>\n\n' + inline('q"\nz', "é") + "end"
    m = store.add_message(s.id, "user", tricky)
    assert store.message(m.id).content == tricky
    assert store.search("end")[0][1].content == tricky


@pytest.mark.parametrize(
    "data, says",
    [
        (b"x" * (10 << 20), f"larger than {MAX_FILE_BYTES >> 20} MiB"),
        (b"\x7fELF\x02\x01\x00\x00binary", "a binary file"),
        ("caf\u00e9".encode("latin-1"), "not UTF-8"),
    ],
    ids=["10MB", "binary", "latin-1"],
)
def test_a_file_that_cannot_be_attached_is_one_line_and_nothing_is_stored(
    qwen2, tmp_path, notes, capsys, data, says
):
    db = tmp_path / "chat.db"
    assert ask(qwen2, db, "--new-session", "-f", str(notes), "hello the world") == 0
    before = stored_contents(db), fragment_rows(db), [s.id for s in ChatStore(db).list_sessions()]
    capsys.readouterr()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(data)
    assert ask(qwen2, db, "--new-session", "-f", str(notes), "-f", str(bad), "hello") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and says in err
    assert (stored_contents(db), fragment_rows(db), [s.id for s in ChatStore(db).list_sessions()]) == before


def test_a_fifo_a_socket_a_device_or_a_folder_is_refused_at_once(tmp_path, capsys):
    """A FIFO with no writer used to block `ask -f` for ever, silently; a device was read as a file."""
    fifo, sock = tmp_path / "fifo", tmp_path / "sock"
    os.mkfifo(fifo)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(sock))
    tried: list = []
    reading = threading.Thread(
        target=lambda: tried.append(main(["ask", "-f", str(fifo), "hello"])), daemon=True
    )
    reading.start()
    reading.join(30)
    if reading.is_alive():  # let it go: a writer unblocks the open()
        os.close(os.open(fifo, os.O_WRONLY))
    assert tried == [2], "ask -f FIFO waited for a writer"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{fifo}: a FIFO, not a file" in err
    for path, kind in ((sock, "a socket"), ("/dev/zero", "a device"), (tmp_path, "a folder")):
        with pytest.raises(
            AttachmentError, match=f"^{path}: {kind}, not a file; only files can be attached$"
        ):
            read_attachment(str(path))
    listening.close()


def test_stdin_is_attached_as_a_file_and_read_once(monkeypatch):
    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"from a pipe\n")

    assert read_attachment("-", Stdin()).text == "from a pipe\n"
    with pytest.raises(AttachmentError, match="missing.txt: cannot be read"):
        read_attachment("missing.txt")
    assert main(["ask", "-f", "-", "-"]) == 2


def test_chat_attaches_a_file_to_the_next_message(qwen2, tmp_path, notes, monkeypatch, capsys):
    Path("bad.bin").write_bytes(b"\0\1\2")
    lines = "/attach bad.bin\n/attach -\n/attach notes.txt\nhello the world\nthe world\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    db = tmp_path / "chat.db"
    flags = ["--cache-ram", "64", "--temp", "0", "--max-tokens", "2"]
    assert main(["chat", "--model", str(qwen2), "--db", str(db), *flags]) == 0
    err = capsys.readouterr().err
    assert "bad.bin: a binary file; only text files can be attached\n" in err
    assert "/attach: stdin is where the chat reads your lines; give a file's path\n" in err
    store = ChatStore(db)
    (session,) = store.list_sessions()
    asked = [m.content for m in store.path(session.head_id) if m.role == "user"]
    # once, with the next message
    assert asked == [inline("notes.txt", TEXT) + "hello the world", "the world"]
    assert len(fragment_rows(db)) == 1


@aio
async def test_the_app_attaches_a_file_with_f5_named_as_chat_names_it(open_chat, notes, tmp_path):
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("f5")
        assert isinstance(app.screen, TextScreen)
        box = app.screen.query_one(Input)
        assert box.value == f"{tmp_path}/" and box.selection.is_empty  # the folder, not selected
        await pilot.press(*"notes.txt")
        assert box.value == f"{tmp_path}/notes.txt"  # typed after it
        await pilot.press("enter")
        await say(pilot, "hello the world")
        (asked, _) = [m.content for m in app.sessions.read(app.chat.session.id)[1]]
        assert asked == inline("notes.txt", TEXT) + "hello the world"  # as `chat` stores it, no folders
        assert app.chat.flow.attached == []  # sent once
        assert "notes.txt" in app.chat.session.title


@aio
async def test_f5_completes_the_path_with_tab(open_chat, notes, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.txt").write_text("a short guide\n")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere.txt"
    elsewhere.write_text("from another folder\n")
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("f5", *"do", "tab")
        box = app.screen.query_one(Input)
        assert box.value == f"{tmp_path}/docs/"  # a folder: with its slash, ready for what is in it
        await pilot.press("g", "tab")
        assert box.value == f"{tmp_path}/docs/guide.txt" and box.cursor_position == len(box.value)
        await pilot.press("enter", "f5")
        app.screen.query_one(Input).value = str(elsewhere)
        await pilot.press("enter")
        assert [a.name for a in app.chat.flow.attached] == ["docs/guide.txt", elsewhere.name]


def test_a_path_completes_as_far_as_its_candidates_agree(tmp_path):
    for name in ("report-2025.txt", "report-2026.txt", ".hidden", "single.md"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    base = f"{tmp_path}/"
    assert complete_path(base + "si") == base + "single.md"
    assert complete_path(base + "re") == base + "report-202"  # their common beginning
    assert complete_path(base + "report-202") == base + "report-2025.txt"  # then the first of them
    assert complete_path(base + "s") == base + "single.md"  # "sub/" too: the first of them
    assert complete_path(base + "su") == base + "sub/"
    assert complete_path(base + ".h") == base + ".hidden"  # hidden ones when asked for
    assert all(".hidden" not in c for c in completions(base))
    assert complete_path(base + "nothing") is None and complete_path(f"{tmp_path}/no/such/") is None
    assert complete_path("") is None


def test_chat_refuses_a_file_too_long_for_the_window_in_one_line_and_goes_on(
    qwen2, tmp_path, notes, monkeypatch, capsys
):
    Path("long.txt").write_text(TEXT * 3)
    monkeypatch.setattr("sys.stdin", io.StringIO("/attach long.txt\nhello the world\nthe world\n"))
    db = tmp_path / "chat.db"
    flags = ["--cache-ram", "64", "--temp", "0", "--max-tokens", "2"]
    assert main(["chat", "--model", str(qwen2), "--db", str(db), *flags]) == 0
    assert "llama-chat: the prompt is " in capsys.readouterr().err
    store = ChatStore(db)
    (session,) = store.list_sessions()
    assert [m.content for m in store.path(session.head_id) if m.role == "user"] == ["the world"]
    assert fragment_rows(db) == []


def test_a_client_resending_a_conversation_with_a_file_finds_its_session(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    asked = inline("notes.txt", TEXT) + "why?"
    made = store.create_session(origin="api", turn=[Message(0, None, "user", asked, None, 0.0, None)])
    assert store.session_ending_with("api", None, [("user", asked)]).id == made.id
