"""`llama-chat serve`: the app under uvicorn, on a socket bound here (so --port 0 can say which port),
refusing to listen beyond this machine without an API key."""

from __future__ import annotations

import ipaddress
import socket

import uvicorn

from .app import create_app
from .state import ServeOptions, api_key_from, say

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
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise BindRefused(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server that, asked to stop, first turns new requests away (503) and cancels the
    replies being made, so it does not wait on them."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.state = config.app.state.server
        self.state.on_failure = self.failed
        self.failure: str | None = None

    def handle_exit(self, sig, frame) -> None:
        self.state.begin_closing()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        self.state.begin_closing()
        self.should_exit = True

    def failed(self, why: str) -> None:
        self.failure = why
        self.should_exit = True


def make_server(options: ServeOptions, api_key: str | None, load=None) -> tuple[Server, socket.socket]:
    """A server for `options`, its socket bound (port 0: a free one); BindRefused says why not."""
    if not is_loopback(options.host) and not api_key:
        raise BindRefused(
            f"refusing to listen on {options.host} without an API key: anyone who reaches it could use the "
            "model and read every stored conversation; give --api-key KEY (or LLAMA_CHAT_API_KEY)"
        )
    sock = bind(options.host, options.port)
    app = create_app(options, load, api_key)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_S, lifespan="on"
    )
    return Server(config), sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def options_from(args) -> tuple[ServeOptions, str | None]:
    """The server's options from the command line (flags not given keep ServeOptions' defaults), and
    its API key (--api-key, else LLAMA_CHAT_API_KEY)."""
    flags = ("host", "port", "parallel", "queue", "ctx")
    given = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    for name in ("parallel", "ctx"):
        if given.get(name, 1) < 1:
            raise BindRefused(f"--{name} must be 1 or more")
    if given.get("queue", 0) < 0 or not 0 <= given.get("port", 0) <= 65535:
        raise BindRefused("--queue must be 0 or more, --port from 0 to 65535")
    options = ServeOptions(
        db=args.db, model=args.model, cache_ram_mb=args.cache_ram, prompt_lookup=not args.no_lookup,
        kv_remote=getattr(args, "kv_remote", None), kv_secret=getattr(args, "kv_secret", None), **given,
    )
    return options, api_key_from(args.api_key)


def serve(options: ServeOptions, api_key: str | None) -> int:
    server, sock = make_server(options, api_key)
    say(f"listening on {url(sock)}" + (" (API key required)" if api_key else ""))
    server.run(sockets=[sock])
    if server.failure:
        say(f"error: {server.failure}")
        return 2
    return 0
