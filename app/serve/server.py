"""`llama-chat serve`: the app under uvicorn, on a socket bound here (so --port 0 can say which port),
refusing to listen beyond this machine without an API key; the connections' limits uvicorn lacks."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import resource
import signal
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .errors import ApiError
from .state import Notice, ServeOptions, api_keys_from, say
from .transport import Deadline

GRACEFUL_S = 10  # how long a stopping server lets running replies end (they are cancelled at once)


class BindRefused(Exception):
    """The address cannot be used (or must not be, without a key): one line."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it every
        # response after the first on a connection waits for the client's delayed ACK (40 ms)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise BindRefused(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def over_capacity(scope, receive, send) -> None:
    """The answer on a connection past --max-connections: 503, and the connection is closed."""
    message = "This server has as many connections open as it takes (--max-connections); retry in a moment."
    headers = {"Retry-After": "1", "Connection": "close"}
    refusal = ApiError(503, message, type="server_error", code="too_many_connections", headers=headers)
    await refusal.response()(scope, receive, send)


class Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection with the limits it lacks: a request's head must arrive whole
    within header_timeout_s (of the connection opening, or of the last response), so idle and
    slow-header connections do not pile up, and its body by the Deadline each request carries in its
    scope (transport reads the body by it); past max_connections, the request is answered 503."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = self.config.app.state.server
        self.options: ServeOptions = self.state.options
        self.head_deadline: asyncio.TimerHandle | None = None
        self.head_started = 0.0  # when the head of the request to come was first waited for

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.options.max_connections:
            self.app = over_capacity
            self.state.over_capacity(
                f"{self.options.max_connections} connections are open (--max-connections): more get 503"
            )
        self._await_head()

    def _await_head(self) -> None:
        self._head_arrived()
        self.head_started = self.loop.time()
        self.head_deadline = self.loop.call_later(self.options.header_timeout_s, self._head_late)

    def _head_arrived(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_late(self) -> None:
        self.head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head came whole
            self._head_arrived()
            options = self.options
            deadline = Deadline(self.head_started, options.request_timeout_s, options.min_body_rate)
            self.cycle.scope["state"]["deadline"] = deadline

    def on_response_complete(self) -> None:
        self._await_head()  # the next request's (a pipelined one cancels it at once)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server that, on SIGTERM, drains: new requests get 503 while the replies under way
    finish (for --drain-seconds at most), then it stops. Asked to stop otherwise (Ctrl+C, a second
    SIGTERM, stop()), it turns new requests away and cancels the replies being made, so it does not
    wait on them. A signal ends it as a stop asked for (exit 0), not as an interrupted program."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.state = config.app.state.server
        self.state.on_failure = self.failed
        self.failure: str | None = None
        self.stopped_by: str | None = None  # the signal's name
        self.accept_failed = Notice()

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.loop_error)
        await super().serve(sockets)

    def loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """Out of file descriptors, asyncio logs a traceback for each failed accept() (up to the
        backlog's 2,048 a second) and schedules a retry for each: say it in one line, now and then."""
        e = context.get("exception")
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.accept_failed(
                f"cannot accept connections: {e.strerror}; the open-file limit is {limit:,} (ulimit -n): "
                f"give --max-connections below it"
            )
        elif isinstance(e, ValueError) and "._start_serving(" in context.get("message", ""):
            pass  # one of those retries, come after the server closed its socket: nothing to say
        else:
            loop.default_exception_handler(context)

    def handle_exit(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        if sig == signal.SIGTERM and self.state.begin_draining():
            return  # on_tick stops the server once the replies under way are done
        self.state.begin_closing()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for anything
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks this ten times a second whether to stop."""
        if self.state.phase == "draining" and self.state.drained():
            self.state.begin_closing()  # what still runs past --drain-seconds is cut, and stored as it is
            self.should_exit = True
        return await super().on_tick(counter)

    def stop(self) -> None:
        self.state.begin_closing()
        self.should_exit = True

    def failed(self, why: str) -> None:
        self.failure = why
        self.should_exit = True


def make_server(
    options: ServeOptions, api_key: str | dict[str, str | None] | None, load=None
) -> tuple[Server, socket.socket]:
    """A server for `options` and its API key (or keys, with their tenants: api_keys_from), its socket
    bound (port 0: a free one); BindRefused says why not."""
    if not is_loopback(options.host) and not api_key:
        raise BindRefused(
            f"refusing to listen on {options.host} without an API key: anyone who reaches it could use the "
            "model and read every stored conversation; give --api-key KEY (or LLAMA_CHAT_API_KEY)"
        )
    sock = bind(options.host, options.port)
    app = create_app(options, load, api_key)
    config = uvicorn.Config(
        app,
        http=Connection,
        log_level="warning",
        access_log=False,  # app.AccessLog writes one line per request
        timeout_keep_alive=options.keep_alive_s,
        timeout_graceful_shutdown=GRACEFUL_S,
        lifespan="on",
    )
    return Server(config), sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def options_from(args) -> tuple[ServeOptions, dict[str, str | None]]:
    """The server's options from the command line (flags not given keep ServeOptions' defaults), and
    its API keys (api_keys_from)."""
    flags = ("host", "port", "parallel", "queue", "ctx", "max_connections", "drain_seconds")
    given = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    for name in ("parallel", "ctx", "max_connections"):
        if given.get(name, 1) < 1:
            raise BindRefused(f"--{name.replace('_', '-')} must be 1 or more")
    if (
        min(given.get("queue", 0), given.get("drain_seconds", 0)) < 0
        or not 0 <= given.get("port", 0) <= 65535
    ):
        raise BindRefused("--queue and --drain-seconds must be 0 or more, --port from 0 to 65535")
    for flag, option in (
        ("cache_ram", "cache_ram_mb"),
        ("block_size", "block_size"),
        ("cache_type", "cache_type"),
        ("activations", "activations"),
        ("kv_codec", "codec"),
    ):
        if getattr(args, flag, None) is not None:
            given[option] = getattr(args, flag)
    options = ServeOptions(
        db=args.db, model=args.model,
        prompt_lookup=not args.no_lookup, use_mmap=not getattr(args, "no_mmap", False),
        kv_remote=getattr(args, "kv_remote", None), kv_secret=getattr(args, "kv_secret", None),
        kv_fetch=getattr(args, "kv_fetch", None) or "measured",
        allowed_hosts=tuple(args.allowed_host or ()), cors_origins=tuple(args.cors_origin or ()), **given,
    )
    try:
        return options, api_keys_from(args.api_key)
    except ValueError as e:
        raise BindRefused(str(e)) from None


def serve(options: ServeOptions, api_key: dict[str, str | None]) -> int:
    server, sock = make_server(options, api_key)
    say(f"listening on {url(sock)}" + (" (API key required)" if api_key else ""))
    server.run(sockets=[sock])
    if server.failure:
        say(f"error: {server.failure}")
        return 2
    say(f"stopped ({server.stopped_by or 'asked to'})")
    return 0
