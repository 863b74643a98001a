"""The remote tier's wire: a client for each `--kv-remote` URL, over connections whose every exchange
must keep pace, so that no peer holds a request or fills memory with a slow or endless answer.

URLs (`--kv-remote`, LLAMA_CHAT_KV_REMOTE):
  redis://[:PASSWORD@]HOST:PORT[/DB]      one server (Valkey speaks the same protocol)
  rediss://...                            the same over TLS
  redis+cluster://HOST:PORT               a Redis Cluster, reached through any one of its nodes
  rediss+cluster://HOST:PORT              the same over TLS
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

DEFAULT_TIMEOUT_S = 0.25  # connect and answer: a store slower than this is no faster than computing
# The writer thread's: nobody waits on a write, so a store that answers slower than a read may wait (a
# busy machine's) is not called down for it — which would drop every block queued in its backoff.
WRITE_TIMEOUT_S = 2.0
PACE_BYTES = 64 * 1024  # an answer may take the timeout once, and once more for each 64 KiB it moves
# The most one answer may bring: a 32k-token conversation's blocks are ~170 MB at q6. A peer that
# announces a larger value is cut off as it sends, not after its bytes have filled memory.
MAX_ANSWER_BYTES = 512 * 2**20
# What one read from a socket may take: a run of blocks is megabytes, and redis-py's 64 KiB reads
# (each appended to its buffer, then copied out) took as long again as the blocks' bytes on loopback.
READ_BYTES = 4 * 2**20
SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}  # → cluster?


class RemoteTierError(ValueError):
    """A remote tier that cannot be set up as asked: one line for the user."""


def connector(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Callable[[], redis.Redis], str]:
    """(a function that makes a client for `url`, where it points without its password, for messages).
    Nothing is contacted here; a URL that cannot work raises RemoteTierError."""
    parts = urlsplit(url)
    shown = url.replace(parts.password, "***") if parts.password else url  # messages name no password
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise RemoteTierError(
            f"--kv-remote {shown!r}: expected redis://HOST:PORT[/DB], rediss://..., or redis+cluster://HOST:PORT"
        )
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here, not on first use)
    except ValueError:
        raise RemoteTierError(f"--kv-remote {shown!r}: the port is not a number") from None
    cluster = SCHEMES[parts.scheme]
    # redis-py is given a redis:// URL and the connection class, TLS or not: a rediss:// URL would
    # make a cluster client replace the class with its own
    plain = urlunsplit(parts._replace(scheme="redis"))
    client_options = {
        "retry": Retry(NoBackoff(), 0),  # a failed call is a miss now, not three slower tries
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "socket_read_size": READ_BYTES,
        "connection_class": PacedSSLConnection if parts.scheme.startswith("rediss") else PacedConnection,
    }
    if cluster:
        if parts.path.strip("/"):
            raise RemoteTierError(f"--kv-remote {shown!r}: a Redis Cluster has no database number")

        def connect():
            return RedisCluster.from_url(plain, **client_options)
    else:

        def connect():
            return redis.Redis.from_url(plain, **client_options)

    where = urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port or 6379}"))
    return connect, where


# -- a whole answer in time ----------------------------------------------------------------------------
# redis-py's socket_timeout bounds each recv, not an answer: a peer sending one byte every 0.2 s never
# trips a 0.25 s timeout and held a request 20 s for 100 bytes. So every connection's socket is wrapped:
# an exchange (what is sent, then its whole answer) may take the timeout once, and once more for every
# PACE_BYTES it moves. A trickle runs out of time after one timeout; a real slow link is not cut off (a
# flat deadline would refuse the 10 MB answers a 10 MB/s link delivers in 1 s, which the rule reads, and
# writes as large): at the default 0.25 s the floor is 256 KiB/s, below where reading pays for any model.


class PacedSocket:
    """A connection's socket whose every exchange must keep pace (see above); all else is the socket's."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self._sock = sock
        self._timeout_s = timeout_s
        self._started = time.monotonic()  # when the exchange began: its first send
        self._moved = 0  # bytes sent and received in it
        self._received = 0  # bytes received in it
        self._answering = False  # something was received since the last send

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendall(self, data, *args):
        if self._answering:  # a new exchange
            self._started, self._moved, self._received, self._answering = time.monotonic(), 0, 0, False
        self._moved += len(data)
        return self._sock.sendall(data, *args)

    def recv(self, *args):
        data = self._paced(self._sock.recv, *args)
        self._count(len(data))
        return data

    def recv_into(self, *args):
        n = self._paced(self._sock.recv_into, *args)
        self._count(n)
        return n

    def _count(self, received: int) -> None:
        self._moved += received
        self._received += received
        if self._received > MAX_ANSWER_BYTES:
            raise ConnectionError(f"an answer of more than {MAX_ANSWER_BYTES >> 20} MiB")

    def _paced(self, receive, *args):
        self._answering = True
        timeout = self._sock.gettimeout()
        if timeout == 0:  # a poll for what is there already (redis-py's check of an idle connection)
            return receive(*args)
        left = self._started + self._timeout_s * (1 + self._moved / PACE_BYTES) - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"slower than {self._timeout_s:g} s per {PACE_BYTES // 1024} KiB")
        self._sock.settimeout(left if timeout is None else min(timeout, left))
        try:
            return receive(*args)
        finally:
            self._sock.settimeout(timeout)


class PacedConnection(redis.Connection):
    def _connect(self):
        return PacedSocket(super()._connect(), self.socket_timeout)


class PacedSSLConnection(redis.SSLConnection):
    def _connect(self):
        return PacedSocket(super()._connect(), self.socket_timeout)
