"""A `llama-chat serve` for tests — in a thread of the test's process, on an ephemeral loopback port,
with the real `openai` client — and what the serve tests share."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from llama_chat.app.serve.server import make_server, url
from llama_chat.app.serve.state import ServeOptions, open_model

BLOCK = 8  # tokens per KV block: the tiny models' prompts span several
SYSTEM = "the sun and the water are the world; " * 3
LONG = "x y z"  # greedy, the tiny qwen2 model goes on past 200 tokens from this prompt
MODEL = "tiny-qwen2"  # the file's stem is the model's id


class Served:
    """A server in a thread of this process, as `llama-chat serve --port 0` runs it."""

    def __init__(self, db: Path, model: Path, api_key: str | None = None, load=None, **options):
        opts = ServeOptions(db=db, model=str(model), port=0, block_size=BLOCK, **options)
        self.server, sock = make_server(opts, api_key, load)
        self.url = url(sock)
        self.state = self.server.state
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def wait_ready(self) -> Served:
        for _ in range(600):
            if self.state.phase == "ready":
                return self
            assert self.state.phase == "loading", self.state.failure
            time.sleep(0.05)
        raise AssertionError("the model did not load")

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()

    @property
    def model(self):
        return self.state.engine._model

    @property
    def scheduler(self):
        return self.state.engine._scheduler

    def ask(self, text: str | list, **kwargs):
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        kwargs.setdefault("max_tokens", 12)
        return self.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, body bytes) of a request sent as bytes (a body as JSON unless the headers
        say otherwise)."""
        headers = (
            {"Content-Type": "application/json", **(headers or {})} if body is not None else headers or {}
        )
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()


def held_loading(db: Path, model: Path, **options) -> tuple[Served, threading.Event]:
    """A server whose model loads only once the event returned is set."""
    loaded = threading.Event()

    def slow_load(opts):
        loaded.wait(30)
        return open_model(opts)

    return Served(db, model, load=slow_load, **options), loaded


def upload(s: Served, data: bytes):
    """POST /v1/sessions/import of a .llamachat file's bytes, as the docs say to send it."""
    return s.raw("POST", "/v1/sessions/import", data, {"Content-Type": "application/octet-stream"})


def streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons by choice index, and the usage chunk, of a stream."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def idle(s: Served) -> None:
    """Wait until no reply runs or waits, and the KV pool holds no sequence: its baseline."""
    for _ in range(400):
        if s.scheduler.load() == {"active": 0, "queued": 0} and not s.model.pool.sequences:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy: {s.scheduler.load()}, {len(s.model.pool.sequences)} sequence(s)")


def blocks_in_use(s: Served) -> int:
    return s.model.pool.memory_breakdown()["in_use_bytes"] // s.model.pool.block_bytes


def error_of(response) -> tuple[int, dict]:
    status, _, body = response
    return status, json.loads(body)["error"]


def post(s: Served, body, **headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return s.raw("POST", "/v1/chat/completions", data, {"Content-Type": "application/json", **headers})


class StderrLines(io.TextIOBase):
    """What is written to sys.stderr while it is redirected here (contextlib.redirect_stderr), a write a
    line (the server's log writes each line in one). Waiting on it loses nothing: polling capfd or
    capsys does, as their readouterr() empties what it read, and a line the server writes between the
    read and the emptying is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text.rstrip("\n"))
        return len(text)

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)


def wait_for(condition, timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("the condition never held")


@contextlib.contextmanager
def queue_full(s: Served, start):
    """A server of --parallel 1 --queue 1 with nothing advancing: one request taken, one waiting, so
    that the next is refused. start(max_tokens) sends a streamed request (its job is queued once the
    response's headers are in); yields the two streams."""
    with s.scheduler.lock:
        first = start(12)
        wait_for(lambda: s.scheduler.load()["queued"] == 0)
        second = start(5)
        assert s.scheduler.load()["queued"] == 1
        yield first, second
