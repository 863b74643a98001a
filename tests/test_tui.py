"""The chat driven through Pilot on a tiny model: sending, streaming, stopping, sessions, branches;
checked against the store (the tools around it: test_tui_tools.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from textual.widgets import Input, ProgressBar, TextArea

from llama_chat.app.chat.titles import title_from_text
from llama_chat.app.config import State
from llama_chat.app.tui import sidebar
from llama_chat.app.tui.dialogs import AlternativesScreen, ConfirmScreen, SettingsScreen, TextScreen
from llama_chat.app.tui.sidebar import BRANCH_WORDS, SessionTree
from llama_chat.app.tui.widgets import ChatInput, MessageView, fitting
from llama_chat.storage import ChatStore, Message, Session
from tui_pilot import (
    aio,
    chat_app,
    idle,
    notices,
    ready,
    released,
    roles_and_text,
    say,
    stored_path,
    tree_labels,
    type_while_replying,
    until,
    views,
)


@pytest.fixture
def slow_decode(forward_passes):
    """slow_decode(s): each forward pass (a prompt's piece, the replies' next rows, or both in one pass)
    also waits s seconds, as a real model's matrix maths would."""

    def slow(delay: float) -> None:
        forward_passes.delay = delay

    return slow


# -- sending and streaming ---------------------------------------------------------------------------


@aio
async def test_a_message_streams_in_and_everything_is_stored(open_chat, qwen2, slow_decode):
    slow_decode(0.02)
    appended = []
    async with open_chat(max_tokens=12) as pilot:
        app = pilot.app
        original_append = MessageView.append

        async def spy(view, text):
            appended.append((view, text))
            await original_append(view, text)

        MessageView.append = spy
        try:
            await say(pilot, "hello the world")
        finally:
            MessageView.append = original_append
        shown = roles_and_text(app)
        assert shown == stored_path(app)  # what is on screen is what was stored
        assert [r for r, _ in shown] == ["user", "assistant"] and shown[0][1] == "hello the world"
        reply_view = views(app)[1]
        assert len(appended) > 1 and {v for v, _ in appended} == {reply_view}  # streamed in pieces
        assert "".join(t for _, t in appended) == reply_view.content != ""
        assert all(v.message is not None for v in views(app))  # ids known: forkable, editable
        status = app.chat.status.fields
        assert status["model"] == "tiny-qwen2" and "decode" in status["speed"]
        assert status["context"].startswith("ctx ") and status["context"].endswith("/256")
        assert tree_labels(app) == [(0, "● hello the world")]


@aio
async def test_a_reply_streamed_as_code_without_a_fence_ends_drawn_as_code():
    from textual.app import App
    from textual.widgets.markdown import MarkdownBlock, MarkdownFence

    code = "def half(x):\n    # the lower half\n    return x // 2\n\n# Try it\nprint(half(7))\n"

    class OneMessage(App):
        def compose(self):
            yield MessageView("assistant")

    async with OneMessage().run_test() as pilot:
        view = pilot.app.query_one(MessageView)
        for piece in ("Here:\n\n", code[:20], code[20:]):
            await view.append(piece)
        await view.finish()
        await pilot.pause()
        markdown = view.query_one("Markdown")
        blocks = [type(b).__name__ for b in view.query(MarkdownBlock) if b.parent is markdown]
        assert blocks == ["MarkdownParagraph", "MarkdownFence"]  # no heading made of the comment
        assert view.query_one(MarkdownFence).code == code.rstrip("\n")  # line for line, indented as written
        assert view.content == "Here:\n\n" + code  # what is stored and copied: the text as written


@aio
async def test_the_context_count_grows_while_a_reply_streams(open_chat, slow_decode):
    slow_decode(0.02)
    async with open_chat(max_tokens=30) as pilot:
        app = pilot.app
        shown = []
        status_set = app.chat.status.set

        def spy(**fields):
            if "context" in fields and app.chat.replies:
                shown.append(int(fields["context"].split()[1].split("/")[0].replace(",", "")))
            status_set(**fields)

        app.chat.status.set = spy
        await say(pilot, "hello the world")
        assert len(set(shown)) > 2 and shown == sorted(shown)  # it moved, up, while the reply was written
        assert app.chat.status.fields["context"] == f"ctx {shown[-1]:,}/256"


def test_the_status_line_keeps_what_fits_on_one_line():
    fields = {
        "model": "qwen2.5-coder-0.5b-instruct-q4_k_m",
        "context": "ctx 393/4,096",
        "speed": "prefill 86 tok/s · decode 6.9 tok/s",
        "resumed": "393 tokens restored in 163 ms",
    }
    rest = "ctx 393/4,096 · prefill 86 tok/s · decode 6.9 tok/s · 393 tokens restored in 163 ms"
    assert fitting(fields, 200) == "qwen2.5-coder-0.5b-instruct-q4_k_m · " + rest
    assert fitting(fields, 118) == "qwen2.5-coder-0.5b-instruct-q4_… · " + rest  # the name cut to the room
    assert fitting(fields, 68) == "qwen2.5-coder… · ctx 393/4,096 · prefill 86 tok/s · decode 6.9 tok/s"
    assert fitting(fields, 60) == "ctx 393/4,096 · prefill 86 tok/s · decode 6.9 tok/s"  # no room for it
    working = fitting({**fields, "work": "writing a reply (Esc stops)"}, 68)
    assert working.startswith("writing a reply (Esc stops) · ") and len(working) <= 68


@aio
async def test_the_model_is_named_as_its_file(open_chat, qwen2, tmp_path):
    """The GGUF's general.name can name another build: the default Q4_K_M file says "… AWQ"."""
    renamed = tmp_path / "my-build-q4_k_m.gguf"
    shutil.copyfile(qwen2, renamed)
    async with open_chat(model=renamed) as pilot:
        app = pilot.app
        assert app.chat.engine.model_info.name == "tiny-qwen2"  # what the file says of itself
        assert app.chat.status.fields["model"] == "my-build-q4_k_m"


@aio
async def test_ctrl_j_adds_a_line_and_enter_sends(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press(*"one", "ctrl+j", *"two")
        assert app.chat.query_one(ChatInput).text == "one\ntwo"
        await pilot.press("enter")
        await until(pilot, lambda: views(app), what="the send")
        await idle(pilot)
        assert stored_path(app)[0] == ("user", "one\ntwo")
        assert app.chat.query_one(ChatInput).text == ""


@aio
async def test_a_message_sent_while_the_model_loads_waits_for_it(open_chat):
    async with open_chat(wait=False) as pilot:
        app = pilot.app
        await pilot.press(*"early", "enter")  # at once, before the model is ready
        await until(pilot, lambda: views(app), what="the send")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant"]


@aio
async def test_a_chat_given_settings_while_the_model_loads_is_made_as_one_made_after(open_chat, monkeypatch):
    import threading

    from llama_chat.app.chat import engine as chat_engine
    from llama_chat.app.tui import chat_screen

    monkeypatch.setattr(chat_engine, "recommended_system_prompt", lambda path: "Be brief.")
    loaded, load = threading.Event(), chat_screen.open_engine
    monkeypatch.setattr(chat_screen, "open_engine", lambda *a: (loaded.wait(timeout=60), load(*a))[1])
    async with open_chat(wait=False) as pilot:
        app = pilot.app
        await until(pilot, lambda: "loading" in app.chat.status.fields.get("work", ""), what="the load")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
        app.screen.query_one("#top_k", Input).value = "7"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.sessions.list() == []  # kept with the new chat until its first message stores it
        loaded.set()
        await ready(pilot)
        await say(pilot, "early")
        early = app.sessions.get(app.chat.session.id)
        await pilot.press("ctrl+n")
        await say(pilot, "late")
        late = app.sessions.get(app.chat.session.id)
        fingerprint = app.chat.engine.model_info.fingerprint
    assert early.model_fingerprint == late.model_fingerprint == fingerprint
    assert early.system_prompt == late.system_prompt == "Be brief."  # the model's, as no other was set
    assert early.sampling["top_k"] == 7 and "top_k" not in late.sampling


@aio
async def test_while_the_model_loads_the_status_line_says_so_not_that_a_reply_is_written(
    open_chat, monkeypatch
):
    import threading

    from llama_chat.app.tui import chat_screen

    loaded, load = threading.Event(), chat_screen.open_engine

    def slow_load(options, progress):
        loaded.wait(timeout=60)
        return load(options, progress)

    monkeypatch.setattr(chat_screen, "open_engine", slow_load)
    async with open_chat(wait=False) as pilot:
        app = pilot.app
        await until(pilot, lambda: "loading" in app.chat.status.fields.get("work", ""), what="the load")
        await pilot.press(*"early", "enter")
        await until(pilot, lambda: views(app), what="the send")
        await pilot.pause(0.2)
        assert app.chat.status.fields["work"] == "loading tiny-qwen2.gguf"  # not "writing a reply"
        loaded.set()
        await until(
            pilot,
            lambda: (
                app.chat.status.fields.get("work", "").startswith("writing a reply") or not app.chat.replies
            ),
            what="the reply",
        )
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant"]


@aio
async def test_keys_typed_as_the_app_starts_go_to_the_message_box(open_chat):
    from textual import events

    async with open_chat(wait=False) as pilot:
        app = pilot.app
        app.chat.set_focus(None)  # as the screen is first shown, before anything took the focus
        app.chat.post_message(events.ScreenResume())  # Textual focuses the screen's AUTO_FOCUS then
        await pilot.pause()
        await pilot.press(*"early")
        assert app.chat.query_one(ChatInput).text == "early"
        assert app.chat.sidebar.search.value == ""


@aio
async def test_a_first_load_shows_its_progress_and_the_screen_works_meanwhile(open_chat, monkeypatch):
    from llama_chat.app.tui.widgets import StatusLine

    shown = []
    progress = StatusLine.progress
    monkeypatch.setattr(StatusLine, "progress", lambda self, *a: (shown.append(a), progress(self, *a))[1])
    async with open_chat(wait=False) as pilot:  # a fresh cache: the weights are prepared now
        app = pilot.app
        await pilot.press(*"typed while loading")
        await ready(pilot)
        assert app.chat.query_one(ChatInput).text == "typed while loading"
        assert "work" not in app.chat.status.fields  # the bar is gone once loaded
    loader = [a for a in shown if a[0].endswith("tiny-qwen2.gguf") and not a[0].startswith("loading")]
    assert loader and any(total and done < total for _, done, total in loader)  # the loader's own steps


@aio
async def test_the_status_bar_shows_its_percent_sign_whole(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        app.chat.status.progress("loading a model", 64, 100)
        await pilot.pause()
        bar = app.chat.status.query_one(ProgressBar)
        percent = bar.query_one("#percentage")  # ProgressBar's own part
        assert str(percent.render()) == "64%" and bar.region.contains_region(percent.region)


@aio
async def test_escape_stops_the_reply_at_once_and_keeps_it(open_chat, slow_decode):
    slow_decode(0.05)
    async with open_chat(max_tokens=100) as pilot:
        app = pilot.app
        await pilot.press(*"hello the world", "enter")  # greedy: 120 tokens, no early end
        await until(pilot, lambda: len(views(app)) == 2 and views(app)[1].content, what="tokens")
        await pilot.press("escape")
        await idle(pilot)
        view = views(app)[1]
        assert view.note == "stopped"
        stored = app.sessions.messages(app.chat.session)[-1]
        assert stored.role == "assistant" and stored.content == view.content != ""
        assert stored.stats["stop_reason"] == "cancelled" and stored.stats["generated_tokens"] < 100


@aio
async def test_ctrl_c_stops_a_reply_and_on_an_idle_prompt_says_how_to_quit(open_chat, slow_decode):
    slow_decode(0.05)
    async with open_chat(max_tokens=100) as pilot:
        app = pilot.app
        await pilot.press(*"hello the world", "enter")
        await until(pilot, lambda: len(views(app)) == 2 and views(app)[1].content, what="tokens")
        await pilot.press("ctrl+c")
        await idle(pilot)
        assert views(app)[1].note == "stopped" and app.is_running  # the reply stopped, the app goes on
        stored = app.sessions.messages(app.chat.session)[-1]
        assert stored.stats["stop_reason"] == "cancelled" and stored.content == views(app)[1].content
        assert not any("quit" in n for n in notices(app))
        await pilot.press("ctrl+c")  # nothing to stop: as before, it says how to quit
        await pilot.pause()
        assert any("Press" in n and "to quit" in n for n in notices(app)) and app.is_running


def test_keys_typed_before_the_app_started_keep_enter_as_enter():
    """A terminal in its ordinary mode turns Enter into a line feed as it arrives (see early_keys.py)."""
    import os
    import pty
    import select

    from llama_chat.app.tui.early_keys import typed_keys

    terminal, app_side = pty.openpty()
    try:
        os.write(terminal, "héllo\rmore".encode())  # Enter, then keys of a second line not ended
        select.select([app_side], [], [], 10)
        assert [event.key for event in typed_keys(app_side)] == [*"héllo", "enter", *"more"]
    finally:
        os.close(terminal)
        os.close(app_side)


@aio
async def test_quitting_during_a_reply_stores_what_was_written(open_chat, tmp_path, slow_decode):
    slow_decode(0.05)
    async with open_chat(max_tokens=100) as pilot:
        app = pilot.app
        await pilot.press(*"hello the world", "enter")  # greedy: 120 tokens, no early end
        await until(pilot, lambda: len(views(app)) == 2 and views(app)[1].content, what="tokens")
        await pilot.press("ctrl+q")
    session = ChatStore(tmp_path / "chat.db").list_sessions()[0]
    messages = ChatStore(tmp_path / "chat.db").path(session.head_id)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].content


@aio
async def test_enter_on_an_empty_input_answers_a_message_left_without_reply(open_chat, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("interrupted")
    store.add_message(session.id, "user", "hello the world")  # e.g. a crash before the reply
    async with open_chat() as pilot:
        app = pilot.app
        await pilot.press("enter")
        await until(pilot, lambda: len(views(app)) == 2, what="the reply")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant"]


# -- sessions: automatic, resumed -----------------------------------------------------------------


@aio
async def test_starting_again_returns_to_the_same_conversation_resumed(open_chat, tmp_path):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        await say(pilot, "and then")
        first_id, shown = app.chat.session.id, roles_and_text(app)
        await pilot.press("ctrl+q")
    assert State().last_session(tmp_path / "chat.db") == first_id

    async with open_chat() as pilot:
        again = pilot.app
        await until(pilot, lambda: "resumed" in again.chat.status.fields, what="the resume line")
        assert again.chat.session.id == first_id and roles_and_text(again) == shown
        resumed = again.chat.status.fields["resumed"]  # every token back, nothing recomputed:
        assert re.fullmatch(r"[1-9][\d,]* tokens restored in \d+ ms", resumed), resumed


@aio
async def test_a_very_long_conversation_opens_on_its_newest_messages(open_chat, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("long")
    for i in range(75):
        store.add_message(session.id, "user", f"question {i}")
        store.add_message(session.id, "assistant", f"answer {i}")
    async with open_chat() as pilot:
        app = pilot.app
        shown = roles_and_text(app)
        assert len(shown) == 100 and shown[-1] == ("assistant", "answer 74") and shown[0][1] == "question 25"
        assert "50 earlier messages" in str(app.chat.query_one(".system-prompt").content)
        await say(pilot, "and then")
        assert roles_and_text(app) == stored_path(app)[-102:]
        assert all(v.message is not None for v in views(app))


@aio
async def test_new_chat_is_stored_with_its_first_message(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "first chat")
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.session is None and views(app) == []
        assert len(app.sessions.list()) == 1  # an empty chat is not stored
        await say(pilot, "second chat")
        titles = [s.title for s in app.sessions.list()]
        assert titles == ["second chat", "first chat"]
        assert tree_labels(app) == [(0, "● second chat"), (0, "first chat")]


@aio
async def test_selecting_a_chat_in_the_sidebar_opens_it(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "first chat")
        first = app.chat.session.id
        await pilot.press("ctrl+n")
        await say(pilot, "second chat")
        tree = app.chat.query_one(SessionTree)
        tree.focus()
        tree.move_cursor(next(n for n in tree.root.children if n.data.session_id == first))
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.id == first, what="the switch")
        await idle(pilot)
        assert roles_and_text(app) == stored_path(app, first)
        assert tree_labels(app)[1] == (0, "● first chat")


@aio
async def test_the_sidebar_reads_the_newest_chats_and_more_as_it_nears_its_end(
    open_chat, tmp_path, monkeypatch
):
    monkeypatch.setattr(sidebar, "PAGE", 40)  # (a page is more than the list shows at once)
    store = ChatStore(tmp_path / "chat.db")
    for i in range(100):
        store.create_session(f"chat {i}")
    store.close()
    async with open_chat(size=(110, 20)) as pilot:
        app = pilot.app
        assert tree_labels(app)[:2] == [(0, "● chat 99"), (0, "chat 98")] and len(tree_labels(app)) == 40
        app.chat.query_one(SessionTree).focus()
        for shown in (80, 100):
            await pilot.press("end")
            await until(pilot, lambda n=shown: len(tree_labels(app)) == n, what=f"{shown} chats")
        await idle(pilot)
        newest_first = ["● chat 99", *(f"chat {i}" for i in range(98, -1, -1))]
        assert [label for _, label in tree_labels(app)] == newest_first


@aio
async def test_titles_show_as_typed_not_as_markup(tmp_path, qwen2):
    title = "[@click=app.quit]quit[/] [bold red]x[/]"
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session(title)
    store.add_message(session.id, "user", "hi")
    store.add_message(session.id, "assistant", "hello")
    store.close()
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=(110, 34), notifications=True) as pilot:  # (Pilot shows none by default)
        await ready(pilot)
        assert tree_labels(app) == [(0, f"● {title}")] and app.title == f"llama-chat · {title}"
        await pilot.press("ctrl+o")  # a fork, whose notice names the chat
        await until(pilot, lambda: list(app.screen.query("Toast")), what="the notice")
        await idle(pilot)
        shown = [toast.render().plain for toast in app.screen.query("Toast")]
        assert shown == [f"Forked into “{title} (fork)”"]
        assert tree_labels(app) == [(0, title), (1, "● (fork) · after msg 2")]
    released(app)


@aio
async def test_rename(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        await pilot.press("f2")
        assert isinstance(app.screen, TextScreen)
        await pilot.press(*"Greetings", "enter")  # the old title is selected: typing replaces it
        await idle(pilot)
        assert app.sessions.get(app.chat.session.id).title == "Greetings"
        assert tree_labels(app) == [(0, "● Greetings")]


@aio
async def test_delete_asks_first(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "keep me")
        await pilot.press("ctrl+n")
        await say(pilot, "delete me")
        doomed = app.chat.session.id
        app.chat.query_one(SessionTree).focus()
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("escape")  # changed my mind
        await idle(pilot)
        assert len(app.sessions.list()) == 2
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("y")
        await idle(pilot)
        assert [s.title for s in app.sessions.list()] == ["keep me"]
        assert app.chat.session.id != doomed and roles_and_text(app)[0] == ("user", "keep me")
        assert tree_labels(app) == [(0, "● keep me")]


# -- branching -----------------------------------------------------------------------------------


@aio
async def test_the_fork_key_forks_at_the_head_and_opens_the_branch(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        parent = app.chat.session
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.chat.session.id != parent.id, what="the fork")
        await idle(pilot)
        child = app.chat.session
        assert child.forked_from == parent.id and child.head_id == parent.head_id
        assert roles_and_text(app) == stored_path(app, parent.id)
        assert tree_labels(app) == [(0, "hello the world"), (1, "● (fork) · after msg 2")]
        await say(pilot, "only in the fork")
        assert len(stored_path(app)) == 4 and len(stored_path(app, parent.id)) == 2  # parent untouched


async def fork_two_exchanges_at(pilot, ups: int) -> tuple[Session, Message]:
    """Two exchanges, then ↑ `ups` times from the input and Ctrl+O: the parent, the message selected."""
    app = pilot.app
    await ready(pilot)
    await say(pilot, "hello the world")
    await say(pilot, "and then")
    parent = app.chat.session
    await pilot.press(*["up"] * ups)
    selected = app.focused.message
    await pilot.press("ctrl+o")
    await until(pilot, lambda: app.chat.session.id != parent.id, what="the fork")
    await idle(pilot)
    return parent, selected


@aio
async def test_the_fork_key_on_a_selected_earlier_message_forks_there(open_chat):
    async with open_chat(wait=False) as pilot:
        app = pilot.app
        parent, first_reply = await fork_two_exchanges_at(pilot, 3)  # last reply, "and then", first reply
        assert first_reply.role == "assistant" and app.chat.session.head_id == first_reply.id
        assert roles_and_text(app) == stored_path(app, parent.id)[:2]
        assert any("after this reply" in n for n in notices(app))
        await pilot.press(*"typed next")  # goes to the input, not to the message selected before
        assert app.chat.query_one(ChatInput).text == "typed next"


@aio
async def test_the_fork_key_on_a_message_of_yours_forks_before_it_with_its_text_to_send(open_chat):
    async with open_chat(wait=False) as pilot:
        app = pilot.app
        parent, selected = await fork_two_exchanges_at(pilot, 2)  # the last reply, then "and then"
        assert (selected.role, selected.content) == ("user", "and then")
        assert stored_path(app) == stored_path(app, parent.id)[:2]  # the branch ends on a reply
        assert roles_and_text(app) == stored_path(app)
        assert app.chat.query_one(ChatInput).text == "and then"  # ready to change and send
        assert any("before your message" in n for n in notices(app))
        await pilot.press(*" now", "enter")
        await until(pilot, lambda: len(views(app)) == 4, what="the send")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant", "user", "assistant"]
        assert stored_path(app)[2] == ("user", "and then now")
        assert len(stored_path(app, parent.id)) == 4  # the original keeps its own turn


@aio
async def test_editing_a_past_message_makes_a_sibling_branch(open_chat):
    async with open_chat() as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        await say(pilot, "and then")
        parent = app.chat.session
        before = stored_path(app)
        await pilot.press("up", "up", "up", "up")  # the first user message
        first = views(app)[0]
        assert app.focused is first
        await pilot.press("e")
        assert isinstance(app.screen, TextScreen)
        app.screen.query_one(TextArea).load_text("hello the sun")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: app.chat.session.id != parent.id, what="the branch")
        await idle(pilot)
        branch = app.chat.session
        assert [m for m in stored_path(app)][0] == ("user", "hello the sun") and len(stored_path(app)) == 2
        assert roles_and_text(app) == stored_path(app)
        assert stored_path(app, parent.id) == before  # history kept
        assert branch.forked_from == parent.id
        assert app.focused is app.chat.query_one(ChatInput)  # the message edited is gone: back to typing
        new_first = app.sessions.messages(branch)[0]
        assert new_first.parent_id == first.message.parent_id  # a sibling of the old message
        assert (1, "● hello the sun") in tree_labels(app)  # named by its own message


@aio
async def test_regenerate_makes_a_sibling_reply(open_chat):
    async with open_chat(sampling={"temperature": 1.0, "seed": 1}) as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        parent = app.chat.session
        old = app.sessions.message(parent.head_id)
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.chat.session.id != parent.id, what="the branch")
        await idle(pilot)
        new = app.sessions.message(app.chat.session.head_id)
        assert new.id != old.id and new.parent_id == old.parent_id and new.role == "assistant"
        assert app.sessions.get(parent.id).head_id == old.id  # the first reply is still there
        assert roles_and_text(app) == stored_path(app)
        assert (1, f"● {title_from_text(new.content, BRANCH_WORDS)}") in tree_labels(app)  # its own words


@aio
async def test_regenerate_three_offers_three_branches(open_chat):
    async with open_chat(sampling={"temperature": 1.0, "seed": 3}) as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        parent = app.chat.session
        user_id = app.sessions.message(parent.head_id).parent_id
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, AlternativesScreen), what="the alternatives")
        alternatives = app.screen.alternatives
        assert len(alternatives) == 3
        await pilot.press("2")
        await until(pilot, lambda: app.chat.session.id == alternatives[1][0], what="the switch")
        await idle(pilot)
        assert views(app)[-1].content == alternatives[1][1]
        branches = [s for s in app.sessions.list() if s.forked_from == parent.id]
        assert len(branches) == 3
        assert all(app.sessions.message(s.head_id).parent_id == user_id for s in branches)
        labels = [label.removeprefix("● ") for depth, label in tree_labels(app) if depth == 1]
        made = sorted(branches, key=lambda s: s.created)  # listed in the order they were made
        replies = [app.sessions.message(s.head_id).content for s in made]
        assert labels == [title_from_text(reply, BRANCH_WORDS) for reply in replies]  # each its own reply's
        assert len(set(labels)) == 3


@aio
async def test_esc_stops_regenerate_three_and_keeps_what_was_written(open_chat, slow_decode):
    async with open_chat(sampling={"temperature": 1.0, "seed": 3}, max_tokens=200) as pilot:
        app = pilot.app
        await say(pilot, "hello the world")
        slow_decode(0.05)  # 200 tokens would take 10 s
        await pilot.press("ctrl+t")
        await until(pilot, lambda: app.chat.replies, what="the alternatives to start")
        await pilot.pause(0.3)
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, AlternativesScreen), what="the alternatives")
        assert len(app.screen.alternatives) == 3 and not app.chat.replies
        stored = [
            app.sessions.message(app.sessions.get(s).head_id).stats for s, _ in app.screen.alternatives
        ]
        assert all(s["stop_reason"] == "cancelled" and s["generated_tokens"] < 200 for s in stored)


@aio
async def test_a_long_prompt_shows_its_prefill_as_a_bar(open_chat):
    async with open_chat(max_tokens=4) as pilot:
        app = pilot.app
        app.chat.engine._model.prefill_batch = 4
        shown = []
        progress = app.chat.status.progress

        def spy(label, done=None, total=None):
            shown.append((label, done, total))
            progress(label, done, total)

        app.chat.status.progress = spy
        await say(pilot, "hello the world, then the water and the sun")
        bars = [(d, t) for label, d, t in shown if label == "reading the conversation"]
        assert bars and bars[-1][0] == bars[-1][1] > 4  # reached the end of a prompt of several batches
        assert not app.chat.status.query_one(ProgressBar).display  # gone once the reply is written


# -- responsiveness --------------------------------------------------------------------------------


@aio
async def test_keys_typed_while_a_reply_streams_reach_the_input(open_chat, slow_decode):
    """Type while a reply streams: each key reaches the input before the next is typed, and the reply
    goes on. A real model's decode step is emulated by a wait that releases the GIL; the tiny model's
    Python work per token still runs. How fast keys answer is the bench's `app_key_ms`, not asserted: a busy
    machine is no bug."""
    slow_decode(0.02)
    async with open_chat(max_tokens=120) as pilot:
        app = pilot.app
        typed = await type_while_replying(pilot, "hello the world", "abcdefghijkl", 0.03)  # a fast typist
        streamed = len(views(app)[1].content)
        await idle(pilot)
        assert typed == app.chat.query_one(ChatInput).text == "abcdefghijkl"
        assert len(views(app)[1].content) > streamed  # the reply went on while we typed


def test_the_window_needs_none_of_the_model_code_to_open():
    """The chats are drawn before the model loads: the app's modules load none of numba's kernels, the
    Redis client or llguidance (seconds of imports), nor what reads a model's file and renders its chat
    template (gguf, PyYAML, Jinja2); the model's worker loads them."""
    heavy = ("numba", "redis", "llguidance", "gguf", "yaml", "jinja2")
    script = f"import sys, llama_chat.app.tui; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
