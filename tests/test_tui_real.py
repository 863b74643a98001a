"""The real `llama-chat` in tmux on the default model: chat, fork, quit, start again; typing while it
writes."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest
from conftest import real_cache
from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from tui_pilot import idle, opened, type_while_replying

pytestmark = pytest.mark.real_model

PLACEHOLDER = "Message (Enter sends"
MODEL_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"  # the file, not its general.name ("… AWQ")


class Tmux:
    """A private tmux server (its own socket): start a command in a pane, type, read the screen."""

    def __init__(self, socket: str, env: dict[str, str]):
        self.socket, self.env = socket, env

    def run(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True, env=self.env
        ).stdout

    def start(self, command: list[str], name: str) -> None:
        shell = " ".join(f"'{c}'" for c in command) + "; echo LLAMA-CHAT-EXITED $?; sleep 600"
        self.run("new-session", "-d", "-s", name, "-x", "120", "-y", "36", shell)
        self.name = name

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str, literal: bool = False) -> None:
        self.run("send-keys", "-t", self.name, *(["-l"] if literal else []), *keys)

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen}")
            time.sleep(0.05)

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, env=self.env)


def status_line(screen: str) -> str:
    """The status line: the lines between the input box and the footer (it wraps when narrow)."""
    lines = screen.rstrip("\n").splitlines()
    end_of_input = max(i for i, line in enumerate(lines) if "▁▁▁" in line)
    return " ".join(line.strip() for line in lines[end_of_input + 1 : -1])


def resumed_and_loaded(screen: str) -> bool:
    """The status line says how the session came back, and the model's loading bar is gone (for a
    moment the two may stand side by side)."""
    return "restored in" in status_line(screen) and "━" not in status_line(screen)


def reply_text(screen: str) -> str:
    """The text of the last reply on screen (the lines after its "assistant" heading)."""
    # right of the sidebar's edge, where there is one (below 90 columns the sidebar hides)
    lines = [line.rpartition("▕")[2].strip(" ▎") for line in screen.splitlines()]
    if not any(line.startswith("assistant") for line in lines):
        return ""
    start = max(i for i, line in enumerate(lines) if line.startswith("assistant"))
    return " ".join(line for line in lines[start + 1 :] if line and not line.startswith("▊"))  # not the input


def app_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of `llama-chat` in tmux: greedy replies of 40 tokens, the test's own config and
    state folders, the real models' cache."""
    config_home = tmp_path / "config"
    (config_home / "llama-chat").mkdir(parents=True)
    (config_home / "llama-chat" / "config.toml").write_text(
        "max_tokens = 40\n\n[sampling]\ntemperature = 0\n"
    )
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(config_home),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CACHE_HOME": str(conftest.REAL_CACHE),  # the default model, assembled and prepared once
        "TERM": "xterm-256color",
    }
    env.pop("TMUX", None)
    # The app must size itself from tmux's window: under xdist a worker that ran other tests had
    # COLUMNS=80 and LINES=24 in its environment, and the app took them (80 columns: no sidebar).
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    return env


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_llama_chat_in_tmux_chats_forks_and_resumes(qwen_model_path, tmp_path):
    command = [str(Path(sys.executable).parent / "llama-chat"), "--db", str(tmp_path / "chat.db")]
    tmux = Tmux(f"llama-chat-test-{os.getpid()}", app_environment(tmp_path))
    try:
        tmux.start(command, "first")
        screen = tmux.wait_for(lambda s: PLACEHOLDER in s, 30, "the chat screen")
        tmux.wait_for(lambda s: MODEL_NAME in status_line(s), 60, "the model")

        tmux.keys("Write a haiku about caches.", literal=True)
        time.sleep(0.2)
        tmux.keys("Enter")
        # streamed: the reply grows on screen while the status says it is being written
        first = reply_text(tmux.wait_for(lambda s: reply_text(s), 60, "the first words of the reply"))
        second = tmux.wait_for(lambda s: len(reply_text(s)) > len(first), 60, "more of the reply")
        assert "writing a reply" in status_line(second)
        screen = tmux.wait_for(
            lambda s: "writing a reply" not in s and "decode" in s, 120, "the reply to end"
        )
        assert "you" in screen and "Write a haiku about caches." in screen and "tok/s" in status_line(screen)

        tmux.keys("C-o")  # the fork key
        screen = tmux.wait_for(lambda s: "● (fork)" in s, 15, "the fork in the sidebar")
        assert "Write a haiku about caches." in screen  # the branch has the whole conversation
        tmux.keys("C-q")
        tmux.wait_for(lambda s: "LLAMA-CHAT-EXITED 0" in s, 30, "llama-chat to quit")

        # a second start: on the fork, resumed from the stored KV (how fast: `llama-chat bench`)
        tmux.start(command, "second")
        tmux.wait_for(lambda s: PLACEHOLDER in s and "● (fork)" in s, 30, "the chat screen")
        screen = tmux.wait_for(resumed_and_loaded, 60, "the resumed session")
        assert "Write a haiku about caches." in screen and "assistant" in screen
        restored = status_line(screen).split(" · ")[-1]
        assert re.fullmatch(r"[1-9][\d,]* tokens restored in \d+ ms", restored), restored  # none recomputed
        tmux.keys("C-q")
        tmux.wait_for(lambda s: "LLAMA-CHAT-EXITED 0" in s, 30, "llama-chat to quit")
    finally:
        tmux.kill()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_a_message_typed_as_llama_chat_starts_is_sent_by_its_enter(qwen_model_path, tmp_path):
    from llama_chat.storage import ChatStore

    db = tmp_path / "chat.db"
    tmux = Tmux(f"llama-chat-early-{os.getpid()}", app_environment(tmp_path))
    try:
        tmux.start([str(Path(sys.executable).parent / "llama-chat"), "--db", str(db)], "early")
        tmux.keys("hello there", literal=True)  # at once: the terminal is not the app's yet
        tmux.keys("Enter")
        tmux.wait_for(lambda s: reply_text(s) and "decode" in status_line(s), 180, "the reply")
        tmux.keys("C-q")
        tmux.wait_for(lambda s: "LLAMA-CHAT-EXITED 0" in s, 30, "llama-chat to quit")
    finally:
        tmux.kill()
    store = ChatStore(db)
    (session,) = store.list_sessions()
    assert store.path(session.head_id)[0].content == "hello there"  # sent by its Enter, no line added


def test_keys_typed_while_the_default_model_streams_reach_the_input(qwen_model_path, tmp_path):
    """Every key reaches the input while the real model writes (how fast: `llama-chat bench`, app_key_ms)."""
    config = UserConfig(path=tmp_path / "config.toml", max_tokens=60, sampling={"temperature": 0})

    async def run() -> str:
        app = ChatApp(tmp_path / "chat.db", model=str(qwen_model_path), config=config)
        async with opened(app) as pilot:
            typed = await type_while_replying(pilot, "Explain what a KV cache is.", "abcdefghij", 0.1)
            app.chat.action_stop()
            await idle(pilot)
            return typed

    with real_cache():
        assert asyncio.run(run()) == "abcdefghij"
