"""How the TUI looks, pinned as SVG snapshots: the main screen, a fork in the sidebar, help, each theme,
and replies drawn as they were written (code without a fence, a haiku's lines, an attached file).

Update after an intended change with `pytest tests/test_tui_snapshots.py --snapshot-update`, and look
at the report before committing. The numbers of the status line are fixed so the pictures never
depend on timing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.storage import ChatStore
from tui_pilot import ready

SIZE = (100, 30)
REPLY = """Here is a function that adds two numbers:

```python
def add(a: int, b: int) -> int:
    return a + b
```

- it takes **two** arguments
- it returns their sum
"""


ASKED = "Write a Python function that adds two numbers."


def conversation(store: ChatStore, title: str, reply: str = REPLY, asked: str = ASKED):
    session = store.create_session(title, system_prompt="You are a concise coding assistant.")
    store.add_message(session.id, "user", asked)
    store.add_message(session.id, "assistant", reply)
    return store.get_session(session.id)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """The config file's path is relative to the test's folder: the help screen shows it, and the
    folder pytest gives a test (longer under xdist, or after a thousand runs) would change how it wraps."""
    monkeypatch.chdir(tmp_path)


def app_on(tmp_path, tiny_model_paths, theme: str = "llama-dark", session_id: str | None = None) -> ChatApp:
    config = UserConfig(path=Path("config", "llama-chat", "config.toml"), theme=theme)
    return ChatApp(
        tmp_path / "chat.db", model=str(tiny_model_paths["qwen2"]), session_id=session_id, config=config
    )


async def settled(pilot) -> None:
    """Model loaded, session resumed, workers done; then the timing figures fixed and the cursor
    steady (a blinking one is drawn or not depending on when the picture is taken)."""
    app = pilot.app
    await ready(pilot)
    for field in app.screen.query("Input, TextArea"):
        field.cursor_blink = False
    app.chat.status.set(
        context="ctx 61/256",
        speed="prefill 1,234 · decode 56.7 tok/s",
        resumed="61 tokens restored in 3 ms",
    )
    app.clear_notifications()
    await pilot.pause()


def test_main_screen(snap_compare, tmp_path, tiny_model_paths):
    conversation(ChatStore(tmp_path / "chat.db"), "Adding numbers")
    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=SIZE, run_before=settled)


def test_main_screen_on_a_narrow_terminal_gives_the_chat_every_column(
    snap_compare, tmp_path, tiny_model_paths
):
    conversation(ChatStore(tmp_path / "chat.db"), "Adding numbers")
    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=(60, 24), run_before=settled)


def test_sidebar_with_a_fork(snap_compare, tmp_path, tiny_model_paths):
    store = ChatStore(tmp_path / "chat.db")
    conversation(store, "Weather report", reply="Rain tomorrow.")
    parent = conversation(store, "Adding numbers")
    first_user = store.path(parent.head_id)[0].id
    store.fork_session(parent.id, first_user, "Adding numbers (edited)")
    fork = store.fork_session(parent.id, None, "Adding numbers (fork)")
    app = app_on(tmp_path, tiny_model_paths, session_id=fork.id)
    assert snap_compare(app, terminal_size=SIZE, run_before=settled)


def test_help_screen(snap_compare, tmp_path, tiny_model_paths):
    async def open_help(pilot):
        await settled(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=(100, 40), run_before=open_help)


@pytest.mark.parametrize("theme", ["llama-dark", "llama-light", "llama-amber"])
def test_each_theme(snap_compare, tmp_path, tiny_model_paths, theme):
    store = ChatStore(tmp_path / "chat.db")
    parent = conversation(store, "Adding numbers")
    store.fork_session(parent.id, None, "Adding numbers (fork)")
    app = app_on(tmp_path, tiny_model_paths, theme=theme, session_id=parent.id)

    async def select_reply(pilot):  # a focused message shows the accent colour too
        await settled(pilot)
        await pilot.press("up")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=select_reply)


# -- replies as they were written ------------------------------------------------------------------

PALINDROME = """def is_palindrome(s):
    # Remove non-alphanumeric characters and convert to lowercase
    cleaned = ''.join(c.lower() for c in s if c.isalnum())
    # Compare the cleaned string with its reverse
    return cleaned == cleaned[::-1]

# Test the function
print(is_palindrome("A man, a plan, a canal: Panama"))  # Output: True
"""
HAIKU = """Here is a haiku:

An old silent pond
A frog jumps into the pond
splash! Silence again.
<em>Basho</em>, 1686"""


def test_code_written_without_a_fence_keeps_its_lines(snap_compare, tmp_path, tiny_model_paths):
    conversation(ChatStore(tmp_path / "chat.db"), "Palindromes", PALINDROME, "Is a string a palindrome?")
    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=SIZE, run_before=settled)


def test_a_haiku_keeps_its_four_lines_and_html_shows_as_text(snap_compare, tmp_path, tiny_model_paths):
    conversation(ChatStore(tmp_path / "chat.db"), "Haiku", HAIKU, "Write a haiku.")
    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=SIZE, run_before=settled)


def test_an_attached_file_is_folded_with_its_name_and_size(snap_compare, tmp_path, tiny_model_paths):
    from llama_chat.storage.fragments import inline

    source = "import functools\n\n\n@functools.cache\ndef fib(n):\n"
    source += "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    asked = inline("fib.py", source) + "What does this file do?"
    conversation(ChatStore(tmp_path / "chat.db"), "fib.py", "It computes Fibonacci numbers, cached.", asked)
    assert snap_compare(app_on(tmp_path, tiny_model_paths), terminal_size=SIZE, run_before=settled)
