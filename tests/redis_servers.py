"""Real redis-server processes on loopback ports for the remote-tier tests and benchmark, and a TCP proxy
that makes a store far away (a delay per direction and a bandwidth cap)."""

from __future__ import annotations

import contextlib
import queue
import random
import shutil
import socket
import socketserver
import subprocess
import threading
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def free_port() -> int:
    """A loopback port free now whose cluster bus port (port + 10,000) is free too."""
    while True:
        port = random.randrange(20000, 50000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class RedisServer:
    """One redis-server on 127.0.0.1, nothing saved to disk; stop/start keep its port."""

    def __init__(self, folder: Path, port: int | None = None, cluster: bool = False):
        self.folder = Path(folder)
        self.port = port or free_port()
        self.cluster = cluster
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is running already")
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        args += ["--logfile", str(self.folder / f"redis-{self.port}.log")]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)
        client.close()
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)


def start_cluster(folder: Path, n: int = 3) -> list[RedisServer]:
    """n masters sharing the 16,384 slots, no replicas (none left running if it fails)."""
    nodes = [RedisServer(folder / f"node{i}", cluster=True) for i in range(n)]
    try:
        for node in nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        deadline = time.monotonic() + 20
        for node in nodes:  # until every node agrees the slots are covered
            client = node.client()
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not come up")
                time.sleep(0.05)
            client.close()
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


class SlowProxy:
    """Forwards 127.0.0.1:port to a redis-server, each byte arriving `delay_s` late in each direction
    (a round trip costs 2 × delay_s) and at most `bytes_per_s`: a store far away, or a slow link."""

    def __init__(self, target_port: int, delay_s: float = 0.0, bytes_per_s: float | None = None):
        self.target_port = target_port
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while self.running:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                continue
            self.sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                line: queue.Queue = queue.Queue()
                threading.Thread(target=self._receive, args=(src, line), daemon=True).start()
                threading.Thread(target=self._send, args=(dst, line), daemon=True).start()

    def _receive(self, src: socket.socket, line: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            line.put((time.monotonic(), data))
            if not data:
                return

    def _send(self, dst: socket.socket, line: queue.Queue) -> None:
        free_at = 0.0  # when the link has sent what it was given so far
        while True:
            arrived, data = line.get()
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            start = max(arrived + self.delay_s, free_at)
            free_at = start + (len(data) / self.bytes_per_s if self.bytes_per_s else 0.0)
            time.sleep(max(0.0, free_at - time.monotonic()))
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.running = False
        for s in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                s.close()


class MisbehavingRedis:
    """A peer on 127.0.0.1 that passes for a Redis until it is asked for data: it answers the handshake
    (HELLO, CLIENT, PING) as Redis 7 does, then answers the first read or write of each connection with
    its misbehaviour and hangs up. `sent` counts the bytes of misbehaviour that went out."""

    MISBEHAVIOURS = ("hello +OK", "nested reply", "trickle", "close mid-reply", "garbage", "endless value")

    def __init__(self, misbehaviour: str, trickle_s: float = 0.2, trickle_bytes: int = 100):
        assert misbehaviour in self.MISBEHAVIOURS
        self.misbehaviour = misbehaviour
        self.trickle_s = trickle_s
        self.trickle_bytes = trickle_bytes  # the trickled reply: trickle_bytes × trickle_s to send it all
        self.sent = 0
        peer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = 30  # a client that never speaks or hangs up does not hold a thread forever

            def handle(self):
                with contextlib.suppress(OSError):
                    peer._serve(self.rfile, self.connection)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _serve(self, rfile, connection: socket.socket) -> None:
        while command := _read_command(rfile):
            name = command[0].upper()
            if name == b"HELLO" and self.misbehaviour == "hello +OK":
                connection.sendall(b"+OK\r\n")  # a RESP2 answer where a map was asked for
            elif name == b"HELLO":
                connection.sendall(b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n")
            elif name == b"PING":
                connection.sendall(b"+PONG\r\n")
            elif name in (b"CLIENT", b"SELECT", b"AUTH"):
                connection.sendall(b"+OK\r\n")
            else:
                self._misbehave(connection)
                return

    def _misbehave(self, connection: socket.socket) -> None:
        if self.misbehaviour == "trickle":
            reply = b"$%d\r\n" % self.trickle_bytes + b"x" * self.trickle_bytes + b"\r\n"
            for byte in reply:
                connection.sendall(bytes([byte]))
                self.sent += 1
                time.sleep(self.trickle_s)
            return
        if self.misbehaviour == "endless value":  # announces 2 GB and sends as fast as it is read
            connection.sendall(b"$2000000000\r\n")
            chunk = b"x" * (1 << 20)
            while self.sent < 1 << 30:  # the client hangs up long before (or the test ends)
                connection.sendall(chunk)
                self.sent += len(chunk)
            return
        reply = {
            "hello +OK": b"+OK\r\n",
            "nested reply": b"*1\r\n" * 5000 + b"$-1\r\n",  # 5,000 arrays deep
            "close mid-reply": b"$1000\r\nonly the start of it",
            "garbage": b"\x00\xff\xfe not RESP at all \x07\r\n" * 4,
        }[self.misbehaviour]
        connection.sendall(reply)
        self.sent += len(reply)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _read_command(rfile) -> list[bytes] | None:
    """One command as a client sends it (an array of bulk strings), or None when it hung up."""
    head = rfile.readline()
    if not head.startswith(b"*"):
        return None
    command = []
    for _ in range(int(head[1:])):
        size = int(rfile.readline()[1:])
        command.append(rfile.read(size + 2)[:-2])
    return command


def end_backoff(tier) -> None:
    """Move a remote tier's clock past the backoff of its last failure, rather than sleep through it;
    the clock then stands still, so a failure after this backs off again until the next call."""
    later = tier.clock() + tier.backoff_s
    tier.clock = lambda: later
