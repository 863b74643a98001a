"""What the server is and has: its options, and its life — loading the model, ready, draining, closing.

The model loads in a thread after the server starts listening, so /health can say "loading" (503)
meanwhile; every request that needs the model gets 503 until it is ready, and again once the server
drains (SIGTERM: the replies under way finish, no new one starts) or is shutting down.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from llama_chat.inference import DEFAULT_MODEL, Model
from llama_chat.inference.kv_arena import DEFAULT_CACHE_TYPE
from llama_chat.inference.kv_cache import DEFAULT_BLOCK_SIZE

from ..chat import build
from ..chat.build import EngineOptions, open_engine
from ..chat.engine import ChatEngine
from ..chat.sessions import Sessions
from ..chat.settings import CACHE_RAM_MB, CODEC, N_CTX
from ..progress import ProgressBar
from ..terminal import escaped
from .errors import model_not_found, unavailable

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
MAX_BODY = 8 << 20  # bytes of a JSON request; a full 32k-token conversation is well under 1 MB
MAX_CONNECTIONS = 256  # open at once; the next is answered 503 and closed (each holds a file descriptor)
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this (uvicorn's own default)
HEADER_TIMEOUT_S = 10  # a request's head (line and headers) must arrive whole within this (nginx: 60)
BODY_TIMEOUT_S = 30  # each read of a request's body waits at most this (nginx's client_body_timeout: 60)
# A request's head and body must arrive whole within this, plus a second per MIN_BODY_RATE bytes of body
# (Apache's mod_reqtimeout's rule): a slow link's upload goes on, a trickle holds no connection for long.
REQUEST_TIMEOUT_S = 30
MIN_BODY_RATE = 16 << 10  # bytes a second: a 128 kbit/s link
MAX_IMPORTS = 2  # imports received and checked at once (each streams to a file and reads it back); more: 429
DRAIN_S = 30  # how long the replies under way at a SIGTERM have to finish before they are cut


@dataclass
class ServeOptions:
    db: Path
    model: str | None = None  # a known model's name or a .gguf path; None: the default model
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    parallel: int = EngineOptions.parallel
    queue: int = EngineOptions.queue
    api_key: str | None = None
    ctx: int = N_CTX
    cache_ram_mb: float = CACHE_RAM_MB
    cache_type: str = DEFAULT_CACHE_TYPE  # the live KV cache's element type (kv_cache.CACHE_TYPES)
    activations: str = EngineOptions.activations  # what matrix products take as inputs (kernels.ACTIVATIONS)
    block_size: int = DEFAULT_BLOCK_SIZE
    codec: str = CODEC
    prompt_lookup: bool = True
    use_mmap: bool = True  # --no-mmap: the weights read into memory
    max_body: int = MAX_BODY
    kv_remote: str | None = None  # a Redis/Valkey URL: KV blocks shared with other servers
    kv_secret: str | None = None  # what signs them there
    kv_fetch: str = "measured"  # read missing blocks where faster than computing ("always": whenever)
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback's and the bound address
    cors_origins: tuple[str, ...] = ()  # web pages (origins) allowed to call the API from a browser
    max_connections: int = MAX_CONNECTIONS
    keep_alive_s: float = KEEP_ALIVE_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    min_body_rate: float = MIN_BODY_RATE
    max_imports: int = MAX_IMPORTS
    drain_seconds: float = DRAIN_S

    @property
    def engine(self) -> EngineOptions:
        """The options of the server's chat engine."""
        return EngineOptions(
            model=self.model,
            db=self.db,
            n_ctx=self.ctx,
            cache_ram_mb=self.cache_ram_mb,
            block_size=self.block_size,
            cache_type=self.cache_type,
            activations=self.activations,
            prompt_lookup=self.prompt_lookup,
            use_mmap=self.use_mmap,
            codec=self.codec,
            kv_remote=self.kv_remote,
            kv_secret=self.kv_secret,
            kv_fetch=self.kv_fetch,
            parallel=self.parallel,
            queue=self.queue,
        )

    @property
    def model_id(self) -> str:
        """The name clients give as "model": the known model's, or the file's stem."""
        name = self.model or DEFAULT_MODEL
        return Path(name).stem if name.endswith(".gguf") else name


def say(line: str) -> None:
    """A line of the server's log on stderr; what clients sent in it (a path, a session's title) cannot
    move the operator's cursor or retitle their terminal: control characters as `\\xNN`. One write with
    its newline (print's two would let another thread's line in between)."""
    sys.stderr.write(f"llama-chat serve: {escaped(line)}\n")
    sys.stderr.flush()


class Notice:
    """A line that may come thousands of times a second (a failed accept(), a refused connection):
    said at most once per `every_s`, with how many times it came since it was last said."""

    def __init__(self, every_s: float = 10):
        self.every_s = every_s
        self.last = -every_s
        self.count = 0

    def __call__(self, line: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            say(
                line
                + (f" ({self.count:,} times in the last {now - self.last:.0f} s)" if self.count > 1 else "")
            )
            self.last, self.count = now, 0


class ServerState:
    def __init__(self, options: ServeOptions, load: Callable[[ServeOptions], Model] | None = None):
        self.options = options
        self._load = load or open_model
        self.started = int(time.time())
        self.phase = "loading"  # then "ready", or "failed"; at the end "draining" (SIGTERM), "closing"
        self.drain_until = 0.0  # (time.monotonic) when replies still under way are cut
        self.under_way = 0  # requests taken while ready, not yet answered whole (on the event loop)
        self.failure: str | None = None  # why the model could not be loaded
        self.on_failure: Callable[[str], None] | None = None  # e.g. stop the server
        self.engine: ChatEngine | None = None
        self.sessions: Sessions | None = None  # the stored conversations, opened with the engine
        self.names = {options.model_id}  # what "model" may say: the id, the GGUF's own name, the stem
        self._thread: threading.Thread | None = None
        self.over_capacity = Notice()  # said when a connection past --max-connections is refused
        self.imports = 0  # being received or checked now (on the event loop: no lock needed)

    # -- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._start, name="model-load", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        options, t0 = self.options, time.perf_counter()
        say(f"loading {options.model_id}")
        try:
            model = self._load(options)
            model.warm_up()
            sessions = Sessions(options.db)
            try:
                engine = open_engine(replace(options.engine, sessions=sessions), model=model)
            except BaseException:
                sessions.close()
                raise
        except Exception as e:  # noqa: BLE001 — ModelError, StoreError, OSError: the server cannot serve
            self.failure, self.phase = str(e), "failed"
            if self.on_failure is not None:
                self.on_failure(self.failure)
            return
        self.names |= {model.name, model.path.stem}
        self.engine, self.sessions = engine, sessions
        if self.phase == "loading":
            self.phase = "ready"
        say(
            f"{model.name} ready in {time.perf_counter() - t0:.1f} s ({engine.n_ctx:,}-token context, "
            f"{options.parallel} replies at once, {options.queue} waiting at most)"
        )

    def begin_draining(self) -> bool:
        """New requests get 503 and /health says "draining"; the replies running or waiting go on for
        options.drain_seconds at most (drained() says when they are done). False when there is nothing
        to drain: the server is closing already, or drain_seconds is 0."""
        if self.phase not in ("loading", "ready") or self.options.drain_seconds <= 0:
            return False
        self.phase, self.drain_until = "draining", time.monotonic() + self.options.drain_seconds
        say(f"draining: no new requests; the replies under way have {self.options.drain_seconds:g} s")
        return True

    def drained(self) -> bool:
        """Every request taken while ready is answered (a stream to its end) and no reply runs or waits
        any more, or drain_seconds have passed (closing cuts what is left). The requests count, not only
        the engine's replies: one taken just before the SIGTERM may still be tokenizing or reading the
        remote tier, its job not yet submitted, and closing then would fail it."""
        load = {"active": 0, "queued": 0} if self.engine is None else self.engine.health()
        idle = self.under_way == 0 and load["active"] == load["queued"] == 0
        return idle or time.monotonic() >= self.drain_until

    def begin_closing(self) -> None:
        """New requests get 503; every running reply is cancelled (what was made is kept)."""
        self.phase = "closing"
        if self.engine is not None:
            threading.Thread(target=self.engine.close, name="closing", daemon=True).start()

    def close(self) -> None:
        self.begin_closing()
        if self._thread is not None:
            self._thread.join()
        if self.engine is not None:
            self.engine.close()
            self.sessions.close()

    # -- what requests ask -------------------------------------------------------------------------

    def ready(self) -> ChatEngine:
        if self.phase == "ready":
            return self.engine
        if self.phase == "loading":
            raise unavailable("The model is still loading; retry in a moment.", "model_loading")
        if self.phase == "failed":
            # the server's log says why (the reason names the server's files)
            raise unavailable("The model could not be loaded; the server is stopping.", "model_failed")
        if self.phase == "draining":
            raise unavailable("The server is draining before it stops: it takes no new requests.", "draining")
        raise unavailable("The server is shutting down.", "shutting_down")

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise model_not_found(name, self.options.model_id)

    def health(self) -> tuple[int, dict]:
        """What a load balancer asks: 200 and "ready", with the replies running and waiting, the KV
        pool's bytes (in use by replies, cached for reuse) and the remote tier's numbers when there is
        one; else 503 and "loading", "draining", "closing" or "failed". It waits on nothing (the
        engine's health() does not wait on its lock)."""
        said = {"status": self.phase, "model": self.options.model_id}
        if self.phase != "ready":
            return 503, said
        return 200, {**said, **self.engine.health()}


def open_model(options: ServeOptions) -> Model:
    with ProgressBar() as bar:
        return build.open_model(options.engine, bar)


def api_keys_from(flags: list[str] | None) -> dict[str, str | None]:
    """The API keys, each with its tenant's name: --api-key (given once or more: a key, or @FILE of
    `name:key` lines), else LLAMA_CHAT_API_KEY. One key has no tenant (None): it sees every session, as
    the TUI does. Of several, each is a tenant with sessions and KV of its own: named by the file, or
    by the start of the key's hash. ValueError says what is wrong."""
    named: list[tuple[str | None, str]] = []
    for flag in flags or [os.environ.get("LLAMA_CHAT_API_KEY") or ""]:
        named += _keys_file(flag[1:]) if flag.startswith("@") else [(None, flag)] if flag else []
    keys = {key: name or "key-" + hashlib.sha256(key.encode()).hexdigest()[:8] for name, key in named}
    if len(keys) < len(named) or len(set(keys.values())) < len(keys):
        raise ValueError("each API key and each tenant's name may be given only once")
    return {key: None for key in keys} if len(keys) == 1 else keys


def _keys_file(path: str) -> list[tuple[str, str]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot read the API keys in {path}: {getattr(e, 'strerror', None) or e}") from None
    named = []
    for number, line in enumerate(lines, 1):
        name, colon, key = line.strip().partition(":")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not colon or not name.strip() or not key.strip():
            raise ValueError(f"{path}, line {number}: expected 'name:key'")
        named.append((name.strip(), key.strip()))
    return named
