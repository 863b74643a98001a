"""The TUI driven through Pilot on a tiny model: every action a user has, checked against the store."""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import sys
import time

import pytest
from textual import events
from textual.geometry import Region
from textual.widgets import Input, ProgressBar, TextArea

from llama_chat.app.cli import main
from llama_chat.app.config import Config, State
from llama_chat.app.screens import AlternativesScreen, ConfirmScreen, HelpScreen, SettingsScreen, TextScreen
from llama_chat.app.tui import ChatApp
from llama_chat.app.widgets import ChatInput, MessageView, SessionTree
from llama_chat.inference import Model
from llama_chat.storage import ChatStore, Message, Session

SIZE = (110, 34)


def aio(test):
    """Run an async test in its own event loop (no pytest async plugin needed)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def qwen2(tiny_model_paths):
    return tiny_model_paths["qwen2"]


def greedy_config(tmp_path, **settings) -> Config:
    """Greedy replies of a few tokens: the same text on every run."""
    settings = {"sampling": {"temperature": 0}, "max_tokens": 8, **settings}
    return Config(path=tmp_path / "config" / "llama-chat" / "config.toml", **settings)


def chat_app(tmp_path, model, **settings) -> ChatApp:
    return ChatApp(tmp_path / "chat.db", model=str(model), config=greedy_config(tmp_path, **settings))


@pytest.fixture
def slow_decode(monkeypatch):
    """Each forward pass (a prefill batch, a decode step, a checked draft, a batch of replies) also
    waits, as a real model's matrix maths would (without holding the GIL)."""

    def slow(delay: float):
        def slowed(method):
            @functools.wraps(method)
            def waiting(self, *args, **kwargs):
                time.sleep(delay)
                return method(self, *args, **kwargs)

            return waiting

        for name in ("forward", "verify_draft", "verify_rows", "decode_batch"):
            monkeypatch.setattr(Model, name, slowed(getattr(Model, name)))

    return slow


async def until(pilot, condition, timeout: float = 120.0, what: str = "the condition") -> None:
    """Wait for the condition; the timeout only stops a hung test, it is no limit on speed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    """The model is loaded, the last session resumed, and nothing is running."""
    app = pilot.app
    await until(pilot, lambda: app.chat.engine_ready.is_set(), what="the model")
    await idle(pilot)


async def idle(pilot) -> None:
    app = pilot.app
    await until(
        pilot,
        lambda: app.chat.reply is None and not app.chat.busy and all(w.is_finished for w in app.workers),
        what="the workers",
    )
    await pilot.pause()


async def say(pilot, text: str) -> None:
    """Type a message, send it, wait for the whole reply."""
    pilot.app.chat.query_one(ChatInput).focus()
    await pilot.press(*text, "enter")
    await until(pilot, lambda: pilot.app.chat.reply is not None or pilot.app.chat.views(), what="the send")
    await idle(pilot)


def roles_and_text(app) -> list[tuple[str, str]]:
    return [(v.role, v.content) for v in app.chat.views()]


def stored_path(app, session_id=None) -> list[tuple[str, str]]:
    store = app.store
    session = store.get_session(session_id or app.chat.session.id)
    return [(m.role, m.content) for m in store.path(session.head_id)]


def tree_labels(app) -> list[tuple[int, str]]:
    """The sidebar as (depth, label) in display order."""
    tree = app.chat.query_one(SessionTree)
    out = []

    def walk(node, depth):
        for child in node.children:
            out.append((depth, str(child.label)))
            walk(child, depth + 1)

    walk(tree.root, 0)
    return out


# -- sending and streaming ---------------------------------------------------------------------------


@aio
async def test_a_message_streams_in_and_everything_is_stored(qwen2, tmp_path, slow_decode):
    slow_decode(0.02)
    app = chat_app(tmp_path, qwen2, max_tokens=12)
    appended = []
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
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
        reply_view = app.chat.views()[1]
        assert len(appended) > 1 and {v for v, _ in appended} == {reply_view}  # streamed in pieces
        assert "".join(t for _, t in appended) == reply_view.content != ""
        assert all(v.message is not None for v in app.chat.views())  # ids known: forkable, editable
        status = app.chat.status.fields
        assert status["model"] == "tiny-qwen2" and "decode" in status["speed"]
        assert status["context"].startswith("ctx ") and status["context"].endswith("/256")
        assert tree_labels(app) == [(0, "● hello the world")]


@aio
async def test_the_context_count_grows_while_a_reply_streams(qwen2, tmp_path, slow_decode):
    slow_decode(0.02)
    app = chat_app(tmp_path, qwen2, max_tokens=30)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = []
        status_set = app.chat.status.set

        def spy(**fields):
            if "context" in fields and app.chat.reply is not None:
                shown.append(int(fields["context"].split()[1].split("/")[0].replace(",", "")))
            status_set(**fields)

        app.chat.status.set = spy
        await say(pilot, "hello the world")
        assert len(set(shown)) > 2 and shown == sorted(shown)  # it moved, up, while the reply was written
        assert app.chat.status.fields["context"] == f"ctx {shown[-1]:,}/256"


@aio
async def test_the_model_is_named_as_its_file(qwen2, tmp_path):
    """The GGUF's general.name can name another build: the default Q4_K_M file says "… AWQ"."""
    renamed = tmp_path / "my-build-q4_k_m.gguf"
    shutil.copyfile(qwen2, renamed)
    app = chat_app(tmp_path, renamed)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.chat.engine.model.name == "tiny-qwen2"  # what the file says of itself
        assert app.chat.status.fields["model"] == "my-build-q4_k_m"


@aio
async def test_ctrl_j_adds_a_line_and_enter_sends(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"one", "ctrl+j", *"two")
        assert app.chat.query_one(ChatInput).text == "one\ntwo"
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.views(), what="the send")
        await idle(pilot)
        assert stored_path(app)[0] == ("user", "one\ntwo")
        assert app.chat.query_one(ChatInput).text == ""


@aio
async def test_a_message_sent_while_the_model_loads_waits_for_it(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"early", "enter")  # at once, before the model is ready
        await until(pilot, lambda: app.chat.views(), what="the send")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant"]


@aio
async def test_a_first_load_shows_its_progress_and_the_screen_works_meanwhile(qwen2, tmp_path, monkeypatch):
    from llama_chat.app.widgets import StatusLine

    shown = []
    progress = StatusLine.progress
    monkeypatch.setattr(StatusLine, "progress", lambda self, *a: (shown.append(a), progress(self, *a))[1])
    app = chat_app(tmp_path, qwen2)  # a fresh cache: the weights are prepared now
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"typed while loading")
        await ready(pilot)
        assert app.chat.query_one(ChatInput).text == "typed while loading"
        assert "work" not in app.chat.status.fields  # the bar is gone once loaded
    loader = [a for a in shown if a[0].endswith("tiny-qwen2.gguf") and not a[0].startswith("loading")]
    assert loader and any(total and done < total for _, done, total in loader)  # the loader's own steps


@aio
async def test_the_status_bar_shows_its_percent_sign_whole(qwen2, tmp_path):
    from textual.widgets._progress_bar import PercentageStatus

    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat.status.progress("loading a model", 64, 100)
        await pilot.pause()
        bar = app.chat.status.query_one(ProgressBar)
        percent = bar.query_one(PercentageStatus)
        assert str(percent.render()) == "64%" and bar.region.contains_region(percent.region)


@aio
async def test_escape_stops_the_reply_at_once_and_keeps_it(qwen2, tmp_path, slow_decode):
    slow_decode(0.05)
    app = chat_app(tmp_path, qwen2, max_tokens=100)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"hello the world", "enter")  # greedy: 120 tokens, no early end
        await until(pilot, lambda: len(app.chat.views()) == 2 and app.chat.views()[1].content, what="tokens")
        await pilot.press("escape")
        await idle(pilot)
        view = app.chat.views()[1]
        assert view.note == "stopped"
        stored = app.store.path(app.chat.session.head_id)[-1]
        assert stored.role == "assistant" and stored.content == view.content != ""
        assert stored.stats["stop_reason"] == "cancelled" and stored.stats["generated_tokens"] < 100


@aio
async def test_quitting_during_a_reply_stores_what_was_written(qwen2, tmp_path, slow_decode):
    slow_decode(0.05)
    app = chat_app(tmp_path, qwen2, max_tokens=100)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"hello the world", "enter")  # greedy: 120 tokens, no early end
        await until(pilot, lambda: len(app.chat.views()) == 2 and app.chat.views()[1].content, what="tokens")
        await pilot.press("ctrl+q")
    session = ChatStore(tmp_path / "chat.db").list_sessions()[0]
    messages = ChatStore(tmp_path / "chat.db").path(session.head_id)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].content


@aio
async def test_enter_on_an_empty_input_answers_a_message_left_without_reply(qwen2, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("interrupted")
    store.add_message(session.id, "user", "hello the world")  # e.g. a crash before the reply
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("enter")
        await until(pilot, lambda: len(app.chat.views()) == 2, what="the reply")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant"]


# -- sessions: automatic, resumed -----------------------------------------------------------------


@aio
async def test_starting_again_returns_to_the_same_conversation_resumed(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        await say(pilot, "and then")
        first_id, shown = app.chat.session.id, roles_and_text(app)
        await pilot.press("ctrl+q")
    assert State().last_session(tmp_path / "chat.db") == first_id

    again = chat_app(tmp_path, qwen2)
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await until(pilot, lambda: "resumed" in again.chat.status.fields, what="the resume line")
        assert again.chat.session.id == first_id and roles_and_text(again) == shown
        resumed = again.chat.status.fields["resumed"]  # every token back, nothing recomputed:
        assert re.fullmatch(r"[1-9][\d,]* tokens restored in \d+ ms", resumed), resumed


@aio
async def test_a_very_long_conversation_opens_on_its_newest_messages(qwen2, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("long")
    for i in range(75):
        store.add_message(session.id, "user", f"question {i}")
        store.add_message(session.id, "assistant", f"answer {i}")
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = roles_and_text(app)
        assert len(shown) == 100 and shown[-1] == ("assistant", "answer 74") and shown[0][1] == "question 25"
        assert "50 earlier messages" in str(app.chat.query_one(".system-prompt").content)
        await say(pilot, "and then")
        assert roles_and_text(app) == stored_path(app)[-102:]
        assert all(v.message is not None for v in app.chat.views())


@aio
async def test_new_chat_is_stored_with_its_first_message(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "first chat")
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.chat.session is None and app.chat.views() == []
        assert len(app.store.list_sessions()) == 1  # an empty chat is not stored
        await say(pilot, "second chat")
        titles = [s.title for s in app.store.list_sessions()]
        assert titles == ["second chat", "first chat"]
        assert tree_labels(app) == [(0, "● second chat"), (0, "first chat")]


@aio
async def test_selecting_a_chat_in_the_sidebar_opens_it(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
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
async def test_rename(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        await pilot.press("f2")
        assert isinstance(app.screen, TextScreen)
        app.screen.query_one(Input).value = "Greetings"
        await pilot.press("enter")
        await idle(pilot)
        assert app.store.get_session(app.chat.session.id).title == "Greetings"
        assert tree_labels(app) == [(0, "● Greetings")]


@aio
async def test_delete_asks_first(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "keep me")
        await pilot.press("ctrl+n")
        await say(pilot, "delete me")
        doomed = app.chat.session.id
        app.chat.query_one(SessionTree).focus()
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("escape")  # changed my mind
        await idle(pilot)
        assert len(app.store.list_sessions()) == 2
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        await pilot.press("y")
        await idle(pilot)
        assert [s.title for s in app.store.list_sessions()] == ["keep me"]
        assert app.chat.session.id != doomed and roles_and_text(app)[0] == ("user", "keep me")
        assert tree_labels(app) == [(0, "● keep me")]


# -- branching -----------------------------------------------------------------------------------


@aio
async def test_the_fork_key_forks_at_the_head_and_opens_the_branch(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
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
async def test_the_fork_key_on_a_selected_earlier_message_forks_there(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        parent, first_reply = await fork_two_exchanges_at(pilot, 3)  # last reply, "and then", first reply
        assert first_reply.role == "assistant" and app.chat.session.head_id == first_reply.id
        assert roles_and_text(app) == stored_path(app, parent.id)[:2]
        assert any("after this reply" in n.message for n in app._notifications)
        await pilot.press(*"typed next")  # goes to the input, not to the message selected before
        assert app.chat.query_one(ChatInput).text == "typed next"


@aio
async def test_the_fork_key_on_a_message_of_yours_forks_before_it_with_its_text_to_send(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        parent, selected = await fork_two_exchanges_at(pilot, 2)  # the last reply, then "and then"
        assert (selected.role, selected.content) == ("user", "and then")
        assert stored_path(app) == stored_path(app, parent.id)[:2]  # the branch ends on a reply
        assert roles_and_text(app) == stored_path(app)
        assert app.chat.query_one(ChatInput).text == "and then"  # ready to change and send
        assert any("before your message" in n.message for n in app._notifications)
        await pilot.press(*" now", "enter")
        await until(pilot, lambda: len(app.chat.views()) == 4, what="the send")
        await idle(pilot)
        assert [r for r, _ in stored_path(app)] == ["user", "assistant", "user", "assistant"]
        assert stored_path(app)[2] == ("user", "and then now")
        assert len(stored_path(app, parent.id)) == 4  # the original keeps its own turn


@aio
async def test_editing_a_past_message_makes_a_sibling_branch(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        await say(pilot, "and then")
        parent = app.chat.session
        before = stored_path(app)
        await pilot.press("up", "up", "up", "up")  # the first user message
        first = app.chat.views()[0]
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
        new_first = app.store.path(branch.head_id)[0]
        assert new_first.parent_id == first.message.parent_id  # a sibling of the old message
        assert (1, "● (edited) · from the start") in tree_labels(app)


@aio
async def test_regenerate_makes_a_sibling_reply(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2, sampling={"temperature": 1.0, "seed": 1})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        parent = app.chat.session
        old = app.store.message(parent.head_id)
        await pilot.press("ctrl+r")
        await until(pilot, lambda: app.chat.session.id != parent.id, what="the branch")
        await idle(pilot)
        new = app.store.message(app.chat.session.head_id)
        assert new.id != old.id and new.parent_id == old.parent_id and new.role == "assistant"
        assert app.store.get_session(parent.id).head_id == old.id  # the first reply is still there
        assert roles_and_text(app) == stored_path(app)
        assert (1, "● (regenerated) · after msg 1") in tree_labels(app)


@aio
async def test_regenerate_three_offers_three_branches(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2, sampling={"temperature": 1.0, "seed": 3})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        parent = app.chat.session
        user_id = app.store.message(parent.head_id).parent_id
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, AlternativesScreen), what="the alternatives")
        alternatives = app.screen.alternatives
        assert len(alternatives) == 3
        await pilot.press("2")
        await until(pilot, lambda: app.chat.session.id == alternatives[1][0], what="the switch")
        await idle(pilot)
        assert app.chat.views()[-1].content == alternatives[1][1]
        branches = [s for s in app.store.list_sessions() if s.forked_from == parent.id]
        assert len(branches) == 3
        assert all(app.store.message(s.head_id).parent_id == user_id for s in branches)
        assert sum(1 for depth, _ in tree_labels(app) if depth == 1) == 3


@aio
async def test_esc_stops_regenerate_three_and_keeps_what_was_written(qwen2, tmp_path, slow_decode):
    app = chat_app(tmp_path, qwen2, sampling={"temperature": 1.0, "seed": 3}, max_tokens=200)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        slow_decode(0.05)  # 200 tokens would take 10 s
        await pilot.press("ctrl+t")
        await until(pilot, lambda: app.chat.busy is not None, what="the alternatives to start")
        await pilot.pause(0.3)
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, AlternativesScreen), what="the alternatives")
        assert len(app.screen.alternatives) == 3 and app.chat.busy is None
        stored = [
            app.store.message(app.store.get_session(s).head_id).stats for s, _ in app.screen.alternatives
        ]
        assert all(s["stop_reason"] == "cancelled" and s["generated_tokens"] < 200 for s in stored)


@aio
async def test_a_long_prompt_shows_its_prefill_as_a_bar(qwen2, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["llama_chat.inference.model"], "PREFILL_BATCH", 4)
    app = chat_app(tmp_path, qwen2, max_tokens=4)
    shown = []
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        progress = app.chat.status.progress

        def spy(label, done=None, total=None):
            shown.append((label, done, total))
            progress(label, done, total)

        app.chat.status.progress = spy
        await say(pilot, "hello the world, then the water and the sun")
        bars = [(d, t) for label, d, t in shown if label == "reading the conversation"]
        assert bars and bars[-1][0] == bars[-1][1] > 4  # reached the end of a prompt of several batches
        assert not app.chat.status.query_one(ProgressBar).display  # gone once the reply is written


# -- copy, settings, model, search -----------------------------------------------------------------

CODE_REPLY = "Two ways:\n\n```python\nprint('one')\n```\n\nand\n\n```sh\necho two\n```\n"


def stored_conversation(tmp_path, reply=CODE_REPLY, title="code"):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session(title)
    store.add_message(session.id, "user", "show me code")
    store.add_message(session.id, "assistant", reply)
    return store, session


@aio
async def test_copy_a_message_and_its_code_blocks(qwen2, tmp_path):
    stored_conversation(tmp_path)
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("up")
        assert isinstance(app.focused, MessageView) and app.focused.role == "assistant"
        await pilot.press("c")
        assert app.clipboard == CODE_REPLY
        await pilot.press("y")
        assert app.clipboard == "print('one')\n"
        await pilot.press("y")
        assert app.clipboard == "echo two\n"


@aio
async def test_settings_store_a_system_prompt_and_sampling_per_session(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#system-prompt", TextArea).load_text("Answer in one word.")
        app.screen.query_one("#temperature", Input).value = "0.5"
        app.screen.query_one("#top_k", Input).value = "7"
        app.screen.query_one("#max_tokens", Input).value = "5"
        await pilot.press("ctrl+s")
        await idle(pilot)
        session = app.store.get_session(app.chat.session.id)
        assert session.system_prompt == "Answer in one word."
        assert session.sampling["temperature"] == 0.5 and session.sampling["top_k"] == 7
        assert app.chat.query_one(".system-prompt").content == "system: Answer in one word."
        await say(pilot, "and then")
        assert app.store.message(app.chat.session.head_id).stats["generated_tokens"] <= 5


@aio
async def test_settings_refuse_bad_values(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        app.screen.query_one("#top_p", Input).value = "3"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)  # still open, with the reason
        assert "top_p" in str(app.screen.query_one("#error").content)


@aio
async def test_choose_another_model(qwen2, tmp_path, tiny_model_paths):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        await pilot.press("ctrl+l")
        app.screen.query_one("#path", Input).value = str(tiny_model_paths["llama"])
        app.screen.query_one("#path", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.engine.model.name == "tiny-llama", what="the new model")
        await idle(pilot)
        assert app.chat.status.fields["model"] == "tiny-llama"
        assert Config.load(app.config.path).model == str(tiny_model_paths["llama"])  # opens next time
        await say(pilot, "and then")  # the conversation goes on with the new model
        assert len(stored_path(app)) == 4


@aio
async def test_a_missing_model_file_is_one_line_in_the_app(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        app.screen.query_one("#path", Input).value = str(tmp_path / "nothing.gguf")
        app.screen.query_one("#path", Input).focus()
        await pilot.press("enter")
        await idle(pilot)
        assert app.chat.engine.model.name == "tiny-qwen2"  # the loaded model stays
        assert any("no such file" in n.message for n in app._notifications)


@aio
async def test_search_finds_titles_and_message_text(qwen2, tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    for title, text in [("Apples", "red fruit"), ("Weather", "rain tomorrow"), ("Boats", "sailing in rain")]:
        s = store.create_session(title)
        store.add_message(s.id, "user", text)
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+f", *"rain")
        await until(pilot, lambda: "Apples" not in str(tree_labels(app)), what="the search")
        roots = [label for depth, label in tree_labels(app) if depth == 0]
        assert roots == ["● Boats", "Weather"]  # the open chat is marked
        await pilot.press("enter")  # to the results
        tree = app.chat.query_one(SessionTree)
        weather = next(n for n in tree.root.children if str(n.label) == "Weather")
        tree.move_cursor(weather)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.title == "Weather", what="the switch")
        await pilot.press("ctrl+f", *["backspace"] * 4)
        await until(pilot, lambda: len(tree_labels(app)) == 3, what="the whole list")


LONG_TITLE = "Planning the garden for next spring"  # longer than the sidebar is wide


def conversation_with_forks(tmp_path):
    """A conversation of two exchanges, forked at its head and after its first reply."""
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session(LONG_TITLE)
    for question, answer in [("tomatoes in rain", "first answer"), ("and the roses", "second answer")]:
        store.add_message(session.id, "user", question)
        store.add_message(session.id, "assistant", answer)
    session = store.get_session(session.id)
    first_reply = store.path(session.head_id)[1].id
    store.fork_session(session.id, None)
    store.fork_session(session.id, first_reply)
    return store, session


@aio
async def test_the_original_and_its_forks_are_told_apart_in_the_sidebar(qwen2, tmp_path):
    store, original = conversation_with_forks(tmp_path)
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        labels = [(depth, label.removeprefix("● ")) for depth, label in tree_labels(app)]
        assert labels == [(0, LONG_TITLE), (1, "(fork) · after msg 4"), (1, "(fork) · after msg 2")]


@aio
async def test_search_lists_a_message_forks_share_once_and_opens_it_scrolled_to(qwen2, tmp_path):
    store, original = conversation_with_forks(tmp_path)
    for i in range(30):  # more conversation than the screen holds, after the message searched for
        store.add_message(original.id, "user", f"question {i}\n\nwith a second paragraph")
        store.add_message(original.id, "assistant", f"answer {i}\n\nalso long")
    other = store.create_session("Something else")
    store.add_message(other.id, "user", "hello")
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.chat.session.id == other.id
        tree = app.chat.query_one(SessionTree)
        tree.move_cursor(tree.root.children[-1].children[-1])  # browsed the sidebar before searching
        await pilot.press("ctrl+f", *"tomatoes")
        await until(pilot, lambda: "Something else" not in str(tree_labels(app)), what="the search")
        labels = tree_labels(app)
        hits = [label for _, label in labels if "tomatoes in rain" in label]
        assert hits == ["user: tomatoes in rain"]  # once, though three sessions reach it
        assert labels[0] == (0, LONG_TITLE) and labels[1] == (1, "user: tomatoes in rain")
        await pilot.press("enter")  # to the results
        assert tree.cursor_line == 0  # from the first, not where the sidebar was left
        await pilot.press("down", "enter")  # the hit
        await until(pilot, lambda: app.chat.session.id == original.id, what="the switch")
        await idle(pilot)
        hit = app.chat.views()[0]
        assert hit.content == "tomatoes in rain" and app.focused is hit
        conversation = app.chat.conversation
        top, bottom = conversation.scroll_y, conversation.scroll_y + conversation.size.height
        assert top <= hit.virtual_region.y < bottom  # on screen, not left at the end


@aio
async def test_titles_are_one_line_with_single_spaces(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "a message   whose title is cut right after a word boundary here")
        assert app.chat.session.title == "a message whose title is cut right after a word"
        await pilot.press("f2")
        app.screen.query_one(Input).value = "  Spaced   out  title "
        await pilot.press("enter")
        await idle(pilot)
        assert app.store.get_session(app.chat.session.id).title == "Spaced out title"
        assert tree_labels(app) == [(0, "● Spaced out title")]


@aio
async def test_export_and_import_a_chat(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        original = app.chat.session
        app.chat.action_export()
        await pilot.pause()
        assert isinstance(app.screen, TextScreen) and app.screen.query_one(Input).value.endswith(".llamachat")
        exported = tmp_path / "out" / "hello.llamachat"
        exported.parent.mkdir()
        app.screen.query_one(Input).value = str(exported)
        await pilot.press("enter")
        await idle(pilot)
        assert exported.exists()
        app.chat.action_export()
        await pilot.pause()
        app.screen.query_one(Input).value = str(tmp_path / "out" / "hello.md")
        await pilot.press("enter")
        await idle(pilot)
        assert "hello the world" in (tmp_path / "out" / "hello.md").read_text()

        app.chat.action_import()
        await pilot.pause()
        app.screen.query_one(Input).value = str(exported)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.id != original.id, what="the imported chat")
        await idle(pilot)
        assert stored_path(app) == stored_path(app, original.id) and roles_and_text(app) == stored_path(app)
        assert len(app.store.list_sessions()) == 2
        await until(pilot, lambda: "resumed" in app.chat.status.fields, what="the resume line")
        restored = app.chat.status.fields["resumed"]  # its KV came with it: nothing recomputed
        assert re.fullmatch(r"[1-9][\d,]* tokens restored in \d+ ms", restored), restored

        app.chat.action_import()
        await pilot.pause()
        app.screen.query_one(Input).value = str(tmp_path / "out" / "hello.md")  # not a session file
        await pilot.press("enter")
        await idle(pilot)
        assert any("hello.md" in n.message for n in app._notifications)
        assert len(app.store.list_sessions()) == 2


# -- keys, palette, help, themes -------------------------------------------------------------------


@aio
async def test_help_lists_every_key_with_its_id(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2, keymap={"fork": "ctrl+k"})
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = "\n".join(f"{k} {d} {i}" for _, rows in app.screen.sections for k, d, i in rows)
        for needle in ["ctrl+k Fork fork", "enter Send send", "ctrl+j, shift+enter New line newline"]:
            assert needle in text
        for needle in ["e Edit edit_message", "c Copy copy_message", "y Copy code copy_code"]:
            assert needle in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@aio
async def test_help_shows_the_whole_config_path_on_a_narrow_terminal(qwen2, tmp_path):
    deep = tmp_path / "a-long-home-directory" / "with-nested-folders" / "config" / "llama-chat" / "config.toml"
    app = ChatApp(tmp_path / "chat.db", model=str(qwen2), config=Config(path=deep))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f1")
        assert app.screen.query_one(".dialog").region.right <= 80  # the box fits: nothing cut at the right
        hint = next(w for w in app.screen.query(".hint") if "keymap" in str(w.content))
        lines = hint.render_lines(Region(0, 0, hint.size.width, hint.size.height))
        assert str(deep) in "".join(line.text.strip() for line in lines)  # folded, every character there


@aio
async def test_every_action_is_in_the_command_palette(qwen2, tmp_path):
    app = chat_app(tmp_path, qwen2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = {c.title for c in app.get_system_commands(app.chat)}
        wanted = {"New chat", "Fork", "Regenerate", "Regenerate ×3", "Edit message", "Stop reply"}
        wanted |= {"Rename chat", "Delete chat", "Chat settings", "Choose model", "Search chats"}
        wanted |= {"Copy message", "Copy code block", "Export chat", "Import chat", "Help", "Theme", "Quit"}
        assert wanted <= titles
        await say(pilot, "hello the world")
        parent = app.chat.session.id
        await pilot.press("ctrl+p", *"Fork")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.chat.session.id != parent, what="the fork")


@aio
async def test_every_binding_has_an_id_and_a_keymap_remaps_it(qwen2, tmp_path):
    from llama_chat.app import screens, tui, widgets

    classes = [tui.ChatApp, tui.ChatScreen, widgets.ChatInput, widgets.MessageView, widgets.SessionTree]
    classes += [screens.Dialog, screens.ConfirmScreen, screens.TextScreen, screens.SettingsScreen]
    classes += [screens.AlternativesScreen, screens.HelpScreen]
    assert all(b.id for cls in classes for b in cls.BINDINGS)
    app = chat_app(tmp_path, qwen2, keymap={"fork": "ctrl+k"})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await say(pilot, "hello the world")
        parent = app.chat.session.id
        await pilot.press("ctrl+o")  # no longer the fork key
        await idle(pilot)
        assert app.chat.session.id == parent
        await pilot.press("ctrl+k")
        await until(pilot, lambda: app.chat.session.id != parent, what="the fork")


@aio
async def test_themes_from_files_and_the_choice_persists(qwen2, tmp_path):
    user_themes = tmp_path / "config" / "llama-chat" / "themes"
    user_themes.mkdir(parents=True)
    (user_themes / "mine.toml").write_text('name = "mine"\nprimary = "#00FF00"\ndark = true\n')
    (user_themes / "broken.toml").write_text('name = "broken"\nprimry = "#00FF00"\n')
    config_file = tmp_path / "config" / "llama-chat" / "config.toml"
    config_file.write_text("# my settings\nmax_tokens = 8\n\n[sampling]\ntemperature = 0\n")
    app = ChatApp(tmp_path / "chat.db", model=str(qwen2))
    async with app.run_test(size=SIZE) as pilot:
        assert {"llama-dark", "llama-light", "llama-amber", "mine"} <= set(app.available_themes)
        assert "broken" not in app.available_themes
        assert app.theme == "llama-dark"
        assert any("primry" in n.message for n in app._notifications)  # the bad file is named
        app.theme = "llama-light"
        await pilot.pause()
    text = config_file.read_text()
    assert 'theme = "llama-light"' in text and "# my settings" in text and "temperature = 0" in text
    assert Config.load().theme == "llama-light" and Config.load().sampling == {"temperature": 0}
    again = ChatApp(tmp_path / "chat.db", model=str(qwen2))
    async with again.run_test(size=SIZE):
        assert again.theme == "llama-light"


def test_titles_given_on_the_command_line_are_one_line_with_single_spaces(tmp_path, capsys):
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session("x")
    store.add_message(session.id, "user", "hello")
    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*db, "sessions", "rename", session.id, " Spaced   out\ttitle "]) == 0
    assert main([*db, "sessions", "fork", session.id, "--title", "a  fork "]) == 0
    assert [s.title for s in ChatStore(tmp_path / "chat.db").list_sessions()] == ["a fork", "Spaced out title"]


HAND_WRITTEN = '''# my settings
"model" = "qwen2.5-coder-0.5b-instruct-q4_k_m"   # the one I like
max_tokens   =  8
system_prompt = """
theme = "is not a setting here"
"""

[sampling]
temperature = 0  # greedy
'''


def test_saving_a_setting_keeps_the_file_as_the_user_wrote_it(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_WRITTEN)
    config = Config.load(path)
    config.save_setting("theme", "llama-light")
    config.save_setting("model", "gemma-3-270m-q4_k_m")
    expected = HAND_WRITTEN.replace("qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")
    expected = expected.replace('"""\n\n[sampling]', '"""\ntheme = "llama-light"\n\n[sampling]')
    assert path.read_text() == expected  # one key changed in place, one added before the first table
    again = Config.load(path)
    assert (again.model, again.theme) == ("gemma-3-270m-q4_k_m", "llama-light")
    assert again.system_prompt == 'theme = "is not a setting here"\n'


# -- the command line ------------------------------------------------------------------------------


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys, qwen2):
    db = ["--db", str(tmp_path / "chat.db")]
    assert main([*db, "--model", str(tmp_path / "missing.gguf")]) == 2
    assert main([*db, "--model", str(qwen2), "tui", "--session", "abcdef"]) == 2
    config = tmp_path / "config" / "llama-chat" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("theme = \n")
    assert main([*db, "--model", str(qwen2)]) == 2
    config.write_text('colour = "red"\n')
    assert main([*db, "--model", str(qwen2)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("llama-chat: error: ") for line in lines)
    assert "missing.gguf: no such file" in lines[0] and "unknown session 'abcdef'" in lines[1]
    assert "config.toml" in lines[2] and "unknown setting 'colour'" in lines[3]


# -- responsiveness --------------------------------------------------------------------------------


@aio
async def test_keys_typed_while_a_reply_streams_reach_the_input(qwen2, tmp_path, slow_decode):
    """Type while a reply streams: each key reaches the input before the next is typed, and the reply
    goes on. A real model's decode step is emulated by a wait that releases the GIL; the tiny model's
    Python work per token still runs. Keys go in as the terminal driver sends them: Pilot.press also
    waits for the whole process to go idle, which it never does while a reply is computed. How fast
    keys answer is measured by `llama-chat bench`, not asserted here: a busy machine is no bug."""
    slow_decode(0.02)
    app = chat_app(tmp_path, qwen2, max_tokens=120)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press(*"hello the world")  # greedy: 120 tokens, no early end
        app.post_message(events.Key("enter", None))
        while not (len(app.chat.views()) == 2 and app.chat.views()[1].content):
            await asyncio.sleep(0.005)
        chat_input = app.chat.query_one(ChatInput)
        for ch in "abcdefghijkl":
            assert app.chat.reply is not None  # still streaming
            app.post_message(events.Key(ch, ch))
            while not chat_input.text.endswith(ch):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.03)  # a fast typist
        streamed = len(app.chat.views()[1].content)
        await idle(pilot)
        assert chat_input.text == "abcdefghijkl"
        assert len(app.chat.views()[1].content) > streamed  # the reply went on while we typed
