"""deploy/local-cluster.sh's cluster for the tests and the benchmark — a Redis Cluster, `llama-chat
serve`s and HAProxy on loopback — and conversations sent through its balancer as a client sends them
(the whole history each turn, the X-Conversation-Key of the last answer sent back)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tiny_models import write_tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "local-cluster.sh"
HAPROXY = shutil.which("haproxy")
LLAMA_CHAT = Path(sys.executable).with_name("llama-chat")
SYSTEM = "You answer questions about rivers, hills and the weather over them, briefly. " * 6
MODEL = "tiny-qwen2"


def tiny_model(folder: Path) -> Path:
    """The tiny qwen2 model with room for conversations of a few hundred tokens a turn."""
    return write_tiny_model(folder / f"{MODEL}.gguf", "qwen2", context_length=4096)


class Failed(Exception):
    """A request that failed at the client: its status, or the error its stream ended with."""


class Cluster:
    """The cluster deploy/local-cluster.sh starts in `folder`: `url` is its balancer's."""

    def __init__(self, folder: Path, model: Path | str | None, servers: int = 3, options: tuple = ()):
        self.folder = Path(folder)
        self.model = model
        self.n_servers = servers
        self.options = ("--threads", "1", "--cache-ram", "128", *options)
        self.url = ""

    def _run(self, *args: str, timeout: float = 900) -> str:
        env = {**os.environ, "LLAMA_CHAT": str(LLAMA_CHAT)}
        done = subprocess.run(
            [str(SCRIPT), "--dir", str(self.folder), *args],
            env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )
        if done.returncode:
            raise RuntimeError(f"local-cluster.sh {' '.join(args)} failed: {done.stderr[-2000:]}")
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def start(self) -> Cluster:
        model = ("--model", str(self.model)) if self.model else ()
        self.url = self._run("--servers", str(self.n_servers), *model, "--", *self.options)
        return self

    def stop(self) -> None:
        self._run("--stop", timeout=120)

    def add_server(self) -> str:
        self._run("--add-server")
        return list(self.servers)[-1]

    @property
    def servers(self) -> dict[str, int]:
        """Each server's name (as X-Served-By says it) and port."""
        lines = (self.folder / "servers").read_text().split("\n")
        return {name: int(port) for name, port in (line.split() for line in lines if line)}

    def pid(self, name: str) -> int:
        return int((self.folder / "pids" / f"{name}.pid").read_text())

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a server and wait for it to end."""
        pid = self.pid(name)
        os.kill(pid, sig)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            assert time.monotonic() < deadline, f"{name} did not stop"
            time.sleep(0.05)

    def restart(self, name: str) -> None:
        """Start a server again as the script started it, and wait until it is ready."""
        subprocess.run([str(self.folder / f"{name}.start")], check=True, timeout=30)
        self.wait_ready(name)

    def health(self, name: str) -> tuple[int, dict]:
        try:
            status, _, body = request(f"http://127.0.0.1:{self.servers[name]}", "GET", "/health", timeout=5)
        except OSError:
            return 0, {}
        return status, json.loads(body or b"{}")

    def wait_ready(self, name: str, timeout_s: float = 300) -> None:
        """Until the server answers /health with 200 and the balancer's checks have found it up."""
        deadline = time.monotonic() + timeout_s
        while self.health(name)[0] != 200:
            assert Path(f"/proc/{self.pid(name)}").exists(), f"{name} stopped: {self.log_tail(name)}"
            assert time.monotonic() < deadline, f"{name} did not become ready: {self.log_tail(name)}"
            time.sleep(0.2)
        self.wait_balanced([name], timeout_s)

    def balanced(self) -> set[str]:
        """The servers the balancer sends requests to now: those its checks find up (its runtime API)."""
        port = int((self.folder / "balancer").read_text().split()[2])
        with contextlib.closing(socket.create_connection(("127.0.0.1", port), timeout=5)) as admin:
            admin.sendall(b"show servers state llama-chat\n")
            answer = b""
            while chunk := admin.recv(65536):
                answer += chunk
        rows = [line.split() for line in answer.decode().splitlines() if line and line[0].isdigit()]
        return {row[3] for row in rows if len(row) > 5 and row[5] == "2"}  # srv_op_state 2: running

    def wait_balanced(self, names: list[str] | None = None, timeout_s: float = 120) -> None:
        """Until the balancer's checks find every one of `names` (default: every server) up; a check
        can fail while the machine is busy, and the server is then out of the balance for a while."""
        wanted = set(self.servers if names is None else names)
        deadline = time.monotonic() + timeout_s
        while not wanted <= self.balanced():
            assert time.monotonic() < deadline, f"the balancer sends to {self.balanced()}, not {wanted}"
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 5) -> str:
        path = self.folder / "logs" / f"{name}.log"
        return " | ".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no log)"

    def wait_written(self, name: str, timeout_s: float = 30) -> None:
        """Until the server has written to Redis every block it queued."""
        deadline = time.monotonic() + timeout_s
        while self.health(name)[1].get("kv_remote", {}).get("queued_writes", 1):
            assert time.monotonic() < deadline, f"{name} still has KV blocks to write"
            time.sleep(0.1)

    def redis_ports(self) -> list[int]:
        return [int(p) for p in (self.folder / "redis-ports").read_text().split()]

    def stored_paths(self, name: str) -> list[list[tuple[str, str]]]:
        """The (role, content) path of every API session in a server's database (read-only)."""
        db = self.folder / name / "chat.db"
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            heads = [row[0] for row in conn.execute("SELECT head_id FROM sessions WHERE origin = 'api'")]
            paths = []
            for head in heads:
                path = conn.execute(
                    "WITH RECURSIVE up(id, parent_id, role, content, depth) AS ("
                    " SELECT id, parent_id, role, content, 0 FROM messages WHERE id = ?"
                    " UNION ALL SELECT m.id, m.parent_id, m.role, m.content, up.depth + 1"
                    " FROM messages m JOIN up ON m.id = up.parent_id)"
                    " SELECT role, content FROM up ORDER BY depth DESC",
                    (head,),
                ).fetchall()
                paths.append([(role, content) for role, content in path])
        return paths


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def request(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None,
            timeout: float = 120):
    """(status, headers, body bytes) of one request on a fresh connection."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})} if data else headers or {}
        conn.request(method, path, data, sent)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


@dataclass
class Turn:
    server: str  # the server that answered (the balancer's X-Served-By; "" without a balancer)
    usage: dict
    reply: str
    session: str | None  # the API session it was stored in
    seconds: float
    first_token_s: float  # until the first token (the whole reply when not streamed)
    key: str  # its X-Conversation-Key

    @property
    def prompt_tokens(self) -> int:
        return self.usage["prompt_tokens"]

    @property
    def cached(self) -> float:
        return self.usage["prompt_tokens_details"]["cached_tokens"] / self.prompt_tokens


@dataclass
class Conversation:
    """A conversation sent whole each turn, as the OpenAI clients send one."""

    opening: str
    model: str = MODEL
    messages: list[dict] = field(default_factory=list)
    key: str | None = None  # the X-Conversation-Key of the last answer
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self):
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.opening}]

    def ask(self, url: str, stream: bool = False, max_tokens: int = 12, then: str | None = None) -> Turn:
        """The next turn through the balancer at `url`; Failed if it did not come back whole. Its
        reply and `then` (the next user message) are added to the conversation."""
        body = {"model": self.model, "messages": self.messages, "max_tokens": max_tokens, "temperature": 0}
        turn = send(url, body, {"X-Conversation-Key": self.key} if self.key else {}, stream)
        self.turns.append(turn)
        self.key = turn.key
        self.messages += [{"role": "assistant", "content": turn.reply},
                          {"role": "user", "content": then or f"and after that, turn {len(self.turns)}?"}]
        return turn

    def stored_until(self, n_turns: int) -> list[tuple[str, str]]:
        """The (role, content) messages a server stores for the first n_turns (the system prompt apart)."""
        return [(m["role"], m["content"]) for m in self.messages[1 : 1 + 2 * n_turns]]


def send(
    url: str, body: dict, headers: dict | None = None, stream: bool = False, timeout: float = 120
) -> Turn:
    """One chat completion (streamed: its first token timed); Failed unless it came back whole and
    stored, each read within `timeout` seconds."""
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    return (_streamed if stream else _whole)(url, body, headers or {}, time.perf_counter(), timeout)


def _whole(url: str, body: dict, headers: dict, t0: float, timeout: float) -> Turn:
    try:
        status, answer_headers, data = request(url, "POST", "/v1/chat/completions", body, headers, timeout)
    except (OSError, http.client.HTTPException) as e:
        raise Failed(f"{type(e).__name__}: {e}") from None
    if status != 200:
        raise Failed(f"{status}: {data[:300]!r}")
    reply = json.loads(data)
    usage = reply["usage"]
    seconds = time.perf_counter() - t0
    return _turn(answer_headers, usage, reply["choices"][0]["message"]["content"], reply, seconds, seconds)


def _streamed(url: str, body: dict, headers: dict, t0: float, timeout: float) -> Turn:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        if response.status != 200:
            raise Failed(f"{response.status}: {response.read()[:300]!r}")
        text, usage, last, first, done = "", None, {}, None, False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise Failed(f"the stream ended with an error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - t0
                    text += choice["delta"]["content"]
            usage, last = chunk.get("usage") or usage, chunk
        if not done or usage is None:
            raise Failed("the stream ended before [DONE]")
        seconds = time.perf_counter() - t0
        return _turn(response.headers, usage, text, last, seconds, first or seconds)
    except (OSError, http.client.HTTPException) as e:
        raise Failed(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()


def _turn(headers, usage: dict, text: str, last: dict, seconds: float, first_token_s: float) -> Turn:
    if not last.get("stored"):
        raise Failed(f"the turn was not stored: {last.get('store_error')}")
    server = headers.get("X-Served-By", "")
    return Turn(
        server, usage, text, last.get("session"), seconds, first_token_s, headers["X-Conversation-Key"]
    )
