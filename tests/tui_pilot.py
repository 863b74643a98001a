"""Driving the chat app with Textual's Pilot: open it on a model, wait for it, type, read what it shows.

Tests get an app through the `open_chat` fixture (conftest.py): `async with open_chat(max_tokens=12)
as pilot:` opens the chat on the tiny qwen2 model with greedy replies, the model loaded and the last
chat resumed. Waits end on what the app shows; their timeout only stops a hung test and is no limit
on speed (`llama-chat bench` measures that).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from pathlib import Path

from textual import events
from textual.keys import _character_to_key

from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.app.tui.sidebar import SessionTree
from llama_chat.app.tui.widgets import ChatInput

SIZE = (110, 34)
HUNG_S = 120.0  # a wait this long means the app hung


def aio(test):
    """Run an async test in its own event loop (no pytest async plugin needed)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def greedy_config(folder: Path, **settings) -> UserConfig:
    """Greedy replies of a few tokens: the same text on every run."""
    settings = {"sampling": {"temperature": 0}, "max_tokens": 8, **settings}
    return UserConfig(path=folder / "config" / "llama-chat" / "config.toml", **settings)


def chat_app(folder: Path, model: Path, **settings) -> ChatApp:
    return ChatApp(folder / "chat.db", model=str(model), config=greedy_config(folder, **settings))


# Each app's notifications, as their text: headless tests draw no toasts, so the app's own `notify`
# (Textual's public call, which every screen and widget goes through) is what a test reads.
_shown: weakref.WeakKeyDictionary[ChatApp, list[str]] = weakref.WeakKeyDictionary()


def record_notices(app: ChatApp) -> None:
    """From now on, keep the text (title and message) of every notification `app` shows."""
    shown = _shown.setdefault(app, [])
    show = app.notify

    def recorded(message, *args, title: str = "", **kwargs):
        shown.append(f"{title}: {message}" if title else str(message))
        return show(message, *args, title=title, **kwargs)

    app.notify = recorded


def notices(app: ChatApp) -> list[str]:
    """The notifications `app` has shown since it was opened, oldest first."""
    return list(_shown.get(app, []))


@contextlib.asynccontextmanager
async def opened(app: ChatApp, size: tuple[int, int] = SIZE, wait: bool = True):
    """Run the app headless, its notifications recorded (notices); `wait`: until the model is loaded
    and nothing runs."""
    record_notices(app)
    try:
        async with app.run_test(size=size) as pilot:
            if wait:
                await ready(pilot)
            yield pilot
    finally:
        released(app)


def released(app: ChatApp) -> None:
    """End the scheduler thread that a closed app leaves to the process's end. The thread keeps the
    stderr it started with, the app's print capture, and so the whole app: every test's app would stay
    in memory, and each garbage collection of the tests after it would walk them all (a third of the
    TUI tests' time)."""
    engine = app.chat.engine
    if engine is not None:
        engine.close()  # idle: quitting stops a reply first


async def until(pilot, condition, what: str = "the condition") -> None:
    deadline = time.monotonic() + HUNG_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    """The model is loaded, the last session resumed, and nothing is running."""
    await until(pilot, lambda: pilot.app.chat.loading_model is None, what="the model")
    await idle(pilot)


async def idle(pilot) -> None:
    """No reply is being written, no model loads, no worker runs."""
    chat = pilot.app.chat
    await until(
        pilot,
        lambda: (
            not chat.replies and chat.loading_model is None and all(w.is_finished for w in pilot.app.workers)
        ),
        what="the work to end",
    )
    await pilot.pause()


async def say(pilot, text: str) -> None:
    """Type a message, send it, wait for the whole reply."""
    chat = pilot.app.chat
    shown = len(chat.conversation.views())
    chat_input = chat.query_one(ChatInput)
    chat_input.focus()
    await type_fast(pilot, text, lambda: chat_input.text == text)
    await pilot.press("enter")
    await until(pilot, lambda: len(chat.conversation.views()) >= shown + 2, what="the message and its reply")
    await idle(pilot)


async def type_fast(pilot, text: str, arrived) -> None:
    """Type `text` as a fast typist or a paste does, the terminal sending its keys together, until
    `arrived()` (Pilot.press waits for the app to go idle after each key: a second per sentence)."""
    for char in text:
        pilot.app.post_message(events.Key(_character_to_key(char), char))
    await until(pilot, arrived, what=f"{text!r} to be typed")


async def type_while_replying(pilot, message: str, keys: str, pause: float) -> str:
    """Send `message`, then, while its reply streams, type `keys` one at a time, `pause` seconds apart,
    as the terminal driver sends them (Pilot.press waits for the app to go idle, which it never does
    while a reply is computed): each must reach the input before the next, the reply still going. What
    the input holds then."""
    app = pilot.app
    await pilot.press(*message)
    app.post_message(events.Key("enter", None))
    await until(pilot, lambda: len(views(app)) == 2 and views(app)[1].content, what="the reply to stream")
    chat_input = app.chat.query_one(ChatInput)
    for key in keys:
        assert app.chat.replies, "the reply ended before every key was typed"
        app.post_message(events.Key(key, key))
        while not chat_input.text.endswith(key):
            await asyncio.sleep(0.001)
        await asyncio.sleep(pause)
    return chat_input.text


def views(app) -> list:
    return app.chat.conversation.views()


def roles_and_text(app) -> list[tuple[str, str]]:
    return [(v.role, v.content) for v in views(app)]


def stored_path(app, session_id=None) -> list[tuple[str, str]]:
    session, messages = app.sessions.read(session_id or app.chat.session.id)
    return [(m.role, m.content) for m in messages]


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
