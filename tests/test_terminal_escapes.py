"""Text this program did not write — titles set through the API, imported titles and messages, names,
the arguments that errors repeat — is printed with its control characters escaped, so that none can
set the terminal's title, clear the screen or move the cursor: in `sessions list`, `show`, `search`,
`export --markdown` and replies on the terminal, `chat` and the error lines. A transcript written
to a file or a pipe is the text as it is."""

from __future__ import annotations

import json

import pytest

from llama_chat.app.cli import main
from llama_chat.storage import ChatStore
from llama_chat.storage.exchange import export_session
from served import Served

TITLE = "\u001b]0;OWNED\u0007\u001b[2J"  # sets the window's title, then clears the screen
TITLE_SHOWN = "\\x1b]0;OWNED\\x07\\x1b[2J"
BODY = "line one\n\tindented \u009b31m red \r over\u007f"  # C1's CSI on its own, a carriage return, DEL
BODY_SHOWN = "line one\n\tindented \\x9b31m red \\x0d over\\x7f"
CONTROLS = ("\x1b", "\x07", "\x9b", "\r", "\x7f")


def printed(capsys, argv: list[str]) -> str:
    main(argv)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert not any(c in text for c in CONTROLS), repr(text)
    return text


@pytest.fixture
def imported(tmp_path, capsys) -> tuple[list[str], str]:
    """The arguments that open a database holding a session imported from a hostile file, and its id."""
    other = ChatStore(tmp_path / "other.db")
    session = other.create_session(TITLE, model_name=TITLE, system_prompt=BODY)
    other.add_message(session.id, "user", "the world " + BODY)
    other.add_message(session.id, "assistant", BODY)
    export_session(other, session.id, tmp_path / "gift.llamachat", with_kv=False)
    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*db, "import", str(tmp_path / "gift.llamachat")]) == 0
    return db, capsys.readouterr().out.split()[-1]


def test_a_title_set_through_the_api_is_printed_escaped(tmp_path, qwen2, capsys):
    s = Served(tmp_path / "chat.db", qwen2).wait_ready()
    try:
        status, _, _ = s.raw("POST", "/v1/sessions", json.dumps({"title": TITLE}).encode())
    finally:
        s.stop()
    assert status in (200, 201)
    assert TITLE_SHOWN in printed(capsys, ["--db", str(tmp_path / "chat.db"), "sessions", "list"])


def test_an_imported_session_is_printed_escaped(imported, capsys):
    db, sid = imported
    assert TITLE_SHOWN in printed(capsys, [*db, "sessions", "list"])
    shown = printed(capsys, [*db, "sessions", "show", sid])
    assert shown.count(TITLE_SHOWN) == 2  # the title, the model's name
    assert shown.count(BODY_SHOWN) == 3  # the system prompt, both messages: their lines kept
    found = printed(capsys, [*db, "sessions", "search", "world"])
    assert TITLE_SHOWN in found and "\\x9b31m" in found


def test_a_transcript_on_the_terminal_is_escaped(imported, capsys, monkeypatch):
    db, sid = imported
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert printed(capsys, [*db, "export", "--markdown", sid]).count(BODY_SHOWN) == 3


def test_a_transcript_written_to_a_file_or_a_pipe_is_the_text_as_it_is(imported, tmp_path, capsys):
    db, sid = imported
    assert main([*db, "export", "--markdown", sid, "-o", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_bytes().decode().count(BODY) == 3
    capsys.readouterr()
    assert main([*db, "export", "--markdown", sid]) == 0  # (stdout is not a terminal here)
    assert capsys.readouterr().out.count(BODY) == 3


def test_an_error_line_repeating_an_argument_is_escaped(tmp_path, capsys):
    db = ["--db", str(tmp_path / "chat.db")]
    ChatStore(tmp_path / "chat.db").create_session("x")
    assert "llama-chat: error: " in printed(capsys, [*db, "sessions", "show", TITLE])


def test_json_output_escapes_c1_and_still_parses(imported, capsys):
    db, sid = imported
    main([*db, "sessions", "show", "--json", sid])
    out = capsys.readouterr().out
    assert not any(c in out for c in CONTROLS)
    assert json.loads(out)["messages"][1]["content"] == BODY
