"""Measurements that need a process of their own: compiling the kernels, a cold load, the peak RSS of
`ask`, and the full-screen app's start and keys (Textual's test driver, no terminal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_chat.inference import locate_model, resolve_model


def child_line(code: str, *args: str, env: dict | None = None) -> str:
    """The last line a Python child process prints: timings and RSS of a start of its own."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.strip().splitlines()[-1]


def measure_cold_load(model_arg) -> float:
    """Load from the GGUF without the prepared cache (metadata read again, weights packed), in a child
    process so RSS here stays honest; compiled kernels come from their cache (see measure_compile)."""
    code = (
        "import sys, time; from llama_chat.inference.weights import prepare; "
        "t = time.perf_counter(); prepare(sys.argv[1], use_cache=False); print(time.perf_counter() - t)"
    )
    return float(child_line(code, str(resolve_model(model_arg))))


def measure_compile(model_arg, activations: str) -> float:
    """Seconds a first start's load waits on compiling the kernels this model takes with these
    activations (an empty numba cache, in a child process); the rest compiles after it, on a thread of
    its own (app/chat/build.compile_later, which takes the one-row kernels too)."""
    code = (
        "import sys; from llama_chat.inference.weights import compile_kernels_for, model_info; "
        "from llama_chat.inference.products import compile_one_row_later; compile_one_row_later(); "
        "info = model_info(sys.argv[1]); info.activations = sys.argv[2]; "
        "print(compile_kernels_for(info))"
    )
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NUMBA_CACHE_DIR": folder}
        return float(child_line(code, str(locate_model(model_arg)), activations, env=env))


ASK_CHILD = """
import resource, sys
from llama_chat.app.cli import main
main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def measure_ask_rss(model_arg, folder) -> float:
    """Peak RSS (MB) of `llama-chat ask` answering a short question, in a process of its own."""
    path = str(locate_model(model_arg))
    args = ["--model", path, "--db", str(folder / "rss.db"), "ask", "Say hello.", "--max-tokens", "16"]
    return float(child_line(ASK_CHILD, *args))


APP_CHILD = """
import asyncio, json, sys, time
from pathlib import Path
started = time.perf_counter()
from textual import events
from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.app.tui.widgets import ChatInput

async def main():
    folder = Path(sys.argv[2])
    config = UserConfig(path=folder / "config.toml", max_tokens=200, sampling={"temperature": 0})
    app = ChatApp(folder / "app.db", model=sys.argv[1], config=config)
    async with app.run_test(size=(110, 34)) as pilot:
        screen_s = time.perf_counter() - started
        while app.chat.loading_model is not None:
            await asyncio.sleep(0.01)
        ready_s = time.perf_counter() - started
        await pilot.press(*"Write a story about caches.", "enter")
        views = app.chat.conversation.views
        while not (len(views()) == 2 and views()[1].content):
            await asyncio.sleep(0.01)
        chat_input = app.chat.query_one(ChatInput)
        keys = []
        for ch in "abcdefghij":
            t = time.perf_counter()
            app.post_message(events.Key(ch, ch))  # as the terminal driver sends it
            while not chat_input.text.endswith(ch):
                await asyncio.sleep(0.001)
            keys.append(time.perf_counter() - t)
            await asyncio.sleep(0.1)
        t = time.perf_counter()
        app.chat.action_stop()
        while app.chat.replies:
            await asyncio.sleep(0.005)
        esc_s = time.perf_counter() - t
    print(json.dumps({"screen_s": screen_s, "ready_s": ready_s, "key_ms": max(keys) * 1000,
                      "esc_ms": esc_s * 1000}))

asyncio.run(main())
"""


def measure_app(model_path: Path, folder: Path) -> dict:
    """The full-screen app in a process of its own (Textual's test driver, no terminal): seconds from
    its imports to the chat screen and to the model loaded; while a reply streams, the slowest of ten
    keys to reach the input; and Esc to the reply stopped and stored."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(folder / "config"), "XDG_STATE_HOME": str(folder / "state")}
    return json.loads(child_line(APP_CHILD, str(model_path), str(folder), env=env))
