"""One conversation seen the same from two processes: the app under Pilot, and `llama-chat ask
--session` run beside it on the same database (a real second process, on the tiny model)."""

from __future__ import annotations

import asyncio
import sys

from llama_chat.app.chat.attachments import Attachment
from llama_chat.app.tui.widgets import ChatInput
from tui_pilot import (
    aio,
    idle,
    notices,
    roles_and_text,
    say,
    stored_path,
    tree_labels,
    type_fast,
    until,
    views,
)

ASK = "import sys; from llama_chat.app.cli import main; sys.exit(main(sys.argv[1:]))"


async def ask_elsewhere(db, model, session_id: str, text: str) -> None:
    """`llama-chat ask --session` in another process, to its end (the app runs meanwhile)."""
    args = ["--db", str(db), "--model", str(model), "ask", "--session", session_id]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ASK, *args, "--temp", "0", "--max-tokens", "6", text,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()


@aio
async def test_a_turn_asked_in_another_process_shows_and_the_next_reply_follows_it(
    open_chat, qwen2, tmp_path
):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        session = app.chat.session
        await ask_elsewhere(tmp_path / "chat.db", qwen2, session.id, "a question from the terminal")
        await until(pilot, lambda: len(views(app)) == 4, what="the other process's turn")
        assert roles_and_text(app) == stored_path(app)
        assert views(app)[2].content == "a question from the terminal"
        # the chat is drawn first, the notice given after it
        told = "2 new messages from another window"
        await until(pilot, lambda: any(told in n for n in notices(app)), what="the notice")
        await say(pilot, "and one from the app")
        assert roles_and_text(app) == stored_path(app)  # after the other turn, as shown
        asked = [text for _, text in roles_and_text(app)][2::2]
        assert asked == ["a question from the terminal", "and one from the app"]
        assert app.chat.session.id == session.id  # no branch: it went on from what the screen showed


@aio
async def test_a_message_sent_before_the_other_turn_showed_is_given_back(open_chat, qwen2, tmp_path):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        session = app.chat.session
        app.chat.other_windows.polling.pause()  # as if the other process stored its turn just before Enter
        await ask_elsewhere(tmp_path / "chat.db", qwen2, session.id, "a question from the terminal")
        app.chat.flow.attached.append(Attachment("notes.txt", "one line\n"))
        chat_input = app.chat.query_one(ChatInput)
        await type_fast(pilot, "and one from the app", lambda: chat_input.text == "and one from the app")
        await pilot.press("enter")
        await until(pilot, lambda: any(n.startswith("Not sent") for n in notices(app)), what="the refusal")
        await idle(pilot)
        assert roles_and_text(app) == stored_path(app)  # the other turn shown, nothing of ours asked
        assert [text for _, text in roles_and_text(app)][2] == "a question from the terminal"
        assert len(views(app)) == 4
        assert chat_input.text == "and one from the app"  # given back, with its file
        assert [a.name for a in app.chat.flow.attached] == ["notes.txt"]
        await pilot.press("enter")
        await until(pilot, lambda: len(views(app)) == 6, what="the message and its reply")
        await idle(pilot)
        assert roles_and_text(app) == stored_path(app) and app.chat.session.id == session.id
        assert views(app)[4].content.endswith("and one from the app") and "notes.txt" in views(app)[4].content


@aio
async def test_a_reply_overtaken_by_another_process_says_which_branch_it_went_to(
    open_chat, qwen2, tmp_path, forward_passes
):
    async with open_chat(max_tokens=100) as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        session = app.chat.session
        forward_passes.delay = 0.3  # the app's reply is still written when the other process stores its own
        chat_input = app.chat.query_one(ChatInput)
        await type_fast(pilot, "tell me more", lambda: chat_input.text == "tell me more")
        await pilot.press("enter")
        await until(pilot, lambda: len(views(app)) == 4 and views(app)[3].content, what="tokens")
        await ask_elsewhere(tmp_path / "chat.db", qwen2, session.id, "meanwhile, in the terminal")
        assert app.chat.replies, "the app's reply ended before the other process stored its turn"
        await pilot.press("escape")
        await idle(pilot)
        branch = app.chat.session
        assert branch.id != session.id and branch.forked_from == session.id
        assert any("a new branch of it, “tell me more”" in n for n in notices(app))
        assert (1, "● tell me more") in tree_labels(app)  # as the sidebar lists it
        assert roles_and_text(app) == stored_path(app, branch.id)  # the branch: what the screen showed
        assert stored_path(app, session.id)[2][1] == "meanwhile, in the terminal"  # the other stays its own
