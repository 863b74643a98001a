"""The remote KV tier: full blocks shared by every server through Redis (or Valkey), signed with a secret.

It sits under RAM and SQLite. A block stored locally is also written here, in the background; a block
missing from both lower tiers is looked for here. A namespace's blocks (a tenant's: vLLM's cache_salt)
have names and a signing key of their own, so no block of one is ever read as another's. A block read
back is used only when its HMAC-SHA256 (over its Redis key, its token ids, its checksum and its bytes)
proves a holder of the secret wrote it and its token ids are the ones its prefix key stands for (and
its bytes decode whole, as any stored block's must). Anything else — a dead, slow, flushed or lying
server, an evicted or altered block — is a miss: the block is recomputed, and nothing held locally is
touched.

The URLs it takes and the connections it makes are remote_wire.py's. Bound it on the server side with
`maxmemory <bytes>` and `maxmemory-policy allkeys-lru`; every block is also written with a TTL
(refreshed on each read), so an unbounded server forgets what nobody reads.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import queue
import struct
import threading
import time
from functools import partial

import numpy as np
import redis

from .codec import block_info
from .records import StoredBlock
from .remote_wire import DEFAULT_TIMEOUT_S, WRITE_TIMEOUT_S, RemoteTierError, connector

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 7 * 24 * 3600  # a week: a conversation nobody continues within it is recomputed
DEFAULT_BACKOFF_S = 30.0  # after a failure the tier is skipped this long (a plain circuit breaker)
# The bytes of blocks waiting to be written; beyond it new ones are dropped. In bytes, not blocks: a
# burst of new long conversations (an 880-token prompt is 55 blocks of 16) could overflow 256 blocks
# while the writer was busy, and their later blocks would be computed again on the next server.
DEFAULT_QUEUE_BYTES = 256 * 2**20
WRITE_BATCH = 32  # blocks written in one round trip
SMALL_ROUND_TRIP = 64 * 1024  # bytes under which a round trip measures latency, above it throughput
MAX_VALUE_BYTES = 64 * 2**20  # a value beyond any real block: not read into a block
KEY_PREFIX = "llama-chat:kv1"  # the layout version: a new value format gets a new prefix

_MAC = 32  # bytes of an HMAC-SHA256
_BODY = struct.Struct("<4sI")  # magic, number of token ids
_MAGIC = b"LCRB"
_CHECKSUM = 8  # hex digits of codec.checksum


class MovingAverage:
    """An exponentially weighted mean: recent round trips count most."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class RemoteTier:
    """Signed KV blocks in Redis: `fetch_run` reads a run of blocks in one round trip, `put` queues a
    block for the writer thread, `worth_fetching` says whether reading beats computing."""

    def __init__(
        self,
        connect,
        fingerprint: str,
        secret: str | bytes,
        *,
        where: str = "redis",
        ttl_s: int = DEFAULT_TTL_S,
        backoff_s: float = DEFAULT_BACKOFF_S,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        always_fetch: bool = False,
        clock=time.monotonic,
        connect_writer=None,
    ):
        if not secret:
            raise RemoteTierError(
                "--kv-remote needs --kv-secret (or LLAMA_CHAT_KV_SECRET): without a shared secret anyone "
                "who can write to the store could feed this server wrong KV"
            )
        self._connect = connect  # () -> a redis client; called again after a failure
        self._connect_writer = connect_writer or connect  # the writer thread's (a longer timeout)
        self.fingerprint = fingerprint
        self.secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.where = where  # the URL without its password, for messages
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self.clock = clock  # () -> seconds: when a backoff ends (tests move it on rather than wait)
        self.always_fetch = always_fetch  # skip the rule: read whatever is missing (--kv-fetch always)
        self._client = None
        self._writer_client = None  # the writer thread's own
        self._client_lock = threading.Lock()
        self._measured = False  # whether the client has connected and its latency is measured
        # When each side's backoff ends: reads' (a reply waits on them, with a short timeout) and the
        # writer's (a longer one) apart, so that a read too slow on a busy machine does not drop the
        # blocks a server writes for the next one to read (the cluster's failover) while it backs off.
        self._down_until = {"reads": 0.0, "writes": 0.0}
        self.last_error: str | None = None  # the last failure, as one line
        self._warned: set[str] = set()
        self._counts_lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("round_trips", "hits", "misses", "rejected", "failures", "written", "dropped_writes",
             "bytes_read", "bytes_written"),
            0,
        )  # fmt: skip
        self.rtt_s = MovingAverage()
        self.bytes_per_s = MovingAverage()
        self.block_bytes = MovingAverage()  # a stored block's size, to estimate a fetch before it
        self.queue_bytes = queue_bytes
        self._queued_bytes = 0  # of the blocks queued or being written (under _counts_lock)
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-remote-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # a process that ends (`llama-chat ask`) first writes what it queued

    @classmethod
    def from_url(
        cls,
        url: str,
        secret: str | bytes | None,
        fingerprint: str,
        *,
        timeout_s: float | None = None,
        always_fetch: bool = False,
        **options,
    ) -> RemoteTier:
        """A tier on the server at `url` (see remote_wire.py for the forms). Nothing is contacted
        yet: a server that is down now is tried again later, and meanwhile blocks are computed."""
        if timeout_s is None:
            # The reads' short timeout is the measured rule's: a store slower than it is no faster than
            # computing. Told to always fetch, a read waits as long as a write may: one answer slowed by
            # a busy machine would otherwise compute that reply and back the reads off for 30 s.
            timeout_s = WRITE_TIMEOUT_S if always_fetch else DEFAULT_TIMEOUT_S
        connect, where = connector(url, timeout_s)
        connect_writer, _ = connector(url, max(timeout_s, WRITE_TIMEOUT_S))
        return cls(
            connect, fingerprint, secret or b"", where=where, connect_writer=connect_writer,
            always_fetch=always_fetch, **options,
        )

    # -- names and signatures ----------------------------------------------------------------------

    def block_name(self, key: bytes, codec: str, namespace: bytes | None = None) -> bytes:
        """A block's Redis key: the model, the codec, its namespace (none: the blocks every server's
        sessions share) and its prefix key (which hashes every token before it and its own); one
        model's blocks under one codec are found under one pattern."""
        where = "" if namespace is None else namespace.hex() + ":"
        return f"{KEY_PREFIX}:{self.fingerprint}:{codec}:{where}{key.hex()}".encode()

    def signing_key(self, namespace: bytes | None) -> bytes:
        """The secret for the shared blocks; for a namespace's, a key derived from it (HKDF's extract
        step), so a block signed for one namespace is no block of another's, whatever its name."""
        if namespace is None:
            return self.secret
        return hmac.new(self.secret, b"llama-chat kv namespace:" + namespace, hashlib.sha256).digest()

    def _mac(self, name: bytes, body, namespace: bytes | None) -> bytes:
        """The HMAC of a name and a body (bytes or a view of them: a block's ~400 KB are not copied)."""
        mac = hmac.new(self.signing_key(namespace), struct.pack("<I", len(name)) + name, hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def seal(self, block: StoredBlock, namespace: bytes | None = None) -> tuple[bytes, bytes]:
        """(Redis key, value) for a block: its HMAC, then its token ids, checksum and encoded KV."""
        name = self.block_name(block.key, block.codec, namespace)
        tokens = np.asarray(block.tokens, dtype="<i4").tobytes()
        body = _BODY.pack(_MAGIC, len(block.tokens)) + tokens + block.checksum.encode("ascii") + block.data
        return name, self._mac(name, body, namespace) + body

    def unseal(
        self,
        name: bytes,
        key: bytes,
        codec: str,
        tokens: tuple[int, ...],
        value: bytes,
        namespace: bytes | None = None,
    ) -> StoredBlock | None:
        """The block in a value read under `name`, or None unless it is signed with the namespace's key,
        holds the token ids its key stands for, and is of the codec. Its data is a view of `value`, not a
        copy (a run of blocks is megabytes). Its CRC is not computed again: the signature covers it and
        the bytes, so they are what a holder of the secret wrote, and decoding checks them whole (zstd's
        content checksum), as for a block read from SQLite; the CRC cost as much as the HMAC."""
        head = _MAC + _BODY.size
        if len(value) < head:
            return None
        body = memoryview(value)[_MAC:]
        if not hmac.compare_digest(value[:_MAC], self._mac(name, body, namespace)):
            return None
        magic, n = _BODY.unpack_from(value, _MAC)
        data_at = head + 4 * n + _CHECKSUM
        if magic != _MAGIC or n != len(tokens) or len(value) < data_at:
            return None
        if np.frombuffer(value, dtype="<i4", count=n, offset=head).tolist() != list(tokens):
            return None
        expected = value[head + 4 * n : data_at].decode("ascii", "replace")
        data = memoryview(value)[data_at:]
        info = block_info(data)
        if info is None or info[0] != codec or info[1][2] != n:
            return None
        return StoredBlock(key, n, codec, data, expected, list(tokens))

    # -- reading -----------------------------------------------------------------------------------

    def fetch(
        self, key: bytes, tokens: tuple[int, ...], codec: str, namespace: bytes | None = None
    ) -> StoredBlock | None:
        return self.fetch_run([(key, tokens)], codec, namespace)[0]

    def fetch_run(
        self, blocks: list[tuple[bytes, tuple[int, ...]]], codec: str, namespace: bytes | None = None
    ) -> list[StoredBlock | None]:
        """The blocks (prefix key, token ids) of the namespace that the store holds intact, read in one
        round trip (each read refreshes the block's TTL); None for each one missing, rejected or
        unreachable."""
        if not blocks:
            return []
        names = [self.block_name(key, codec, namespace) for key, _ in blocks]
        values = self._round_trip(lambda client: self._read(client, names), "bytes_read")
        if values is None:
            return [None] * len(blocks)
        out: list[StoredBlock | None] = []
        for name, (key, tokens), value in zip(names, blocks, values):
            block = None
            if isinstance(value, bytes) and len(value) <= MAX_VALUE_BYTES:
                block = self.unseal(name, key, codec, tokens, value, namespace)
                if block is None:
                    self._count("rejected")
                    self._warn_once(
                        "rejected",
                        f"remote KV tier {self.where}: ignored a block that was unsigned, signed with "
                        "another secret, or not the tokens its key names (it is computed here instead)",
                    )
                else:
                    self._count("hits")
                    self.block_bytes.add(len(value))
            elif value is None:
                self._count("misses")
            else:
                self._count("rejected")
            out.append(block)
        return out

    def _read(self, client, names: list[bytes]) -> tuple[list, int]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.getex(name, ex=self.ttl_s)
        # A key holding something else (a list, say) answers with an error in its place: that block is
        # rejected, the others still count. A lost connection fails the whole round trip.
        values = pipe.execute(raise_on_error=False)
        for value in values:
            if isinstance(value, redis.ConnectionError | redis.TimeoutError):
                raise value
        return values, sum(len(v) for v in values if isinstance(v, bytes))

    # -- writing -----------------------------------------------------------------------------------

    def put(self, block: StoredBlock, namespace: bytes | None = None) -> bool:
        """Queue a block of the namespace for the writer thread; never waits. False (and counted) when
        it is dropped: the queue is full or the writer is backing off."""
        if self._backing_off("writes"):
            self._count("dropped_writes")
            return False
        name, value = self.seal(block, namespace)
        with self._counts_lock:
            fits = self._queued_bytes + len(value) <= self.queue_bytes
            if fits:
                self._queued_bytes += len(value)
            else:
                self.counts["dropped_writes"] += 1
        if fits:
            self._queue.put_nowait((name, value))
        return fits

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued block has been written (or dropped); False on timeout."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the writer after what is queued (within timeout_s) and let go of the connections."""
        if self._writer.is_alive():
            self.flush(timeout_s)
            self._queue.put_nowait(None)  # (the queue has no bound of its own: queue_bytes is put's)
            self._writer.join(timeout_s)
        clients = (self._client, self._writer_client)
        self._drop_client()
        for client in clients:
            if client is not None:
                try:
                    client.close()
                except (redis.RedisError, OSError):
                    pass

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.task_done()
                return
            batch = [first]
            while len(batch) < WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # put it back for the outer loop to end on
                    self._queue.task_done()
                    self._queue.put(None)
                    break
                batch.append(item)
            write = partial(self._write, batch=batch)
            done = self._round_trip(write, "bytes_written", self._get_writer_client)
            self._count("written" if done is not None else "dropped_writes", len(batch))
            with self._counts_lock:
                self._queued_bytes -= sum(len(value) for _, value in batch)
            for _ in batch:
                self._queue.task_done()

    def _write(self, client, batch: list[tuple[bytes, bytes]]) -> tuple[bool, int]:
        pipe = client.pipeline(transaction=False)
        for name, value in batch:
            pipe.set(name, value, ex=self.ttl_s)
            self.block_bytes.add(len(value))
        pipe.execute()
        return True, sum(len(v) for _, v in batch)

    # -- failures and measurements ---------------------------------------------------------------------

    @property
    def down(self) -> bool:
        """Backing off after a failure, reads or writes: they miss and drop without touching the network
        until their backoff ends."""
        return self._backing_off("reads") or self._backing_off("writes")

    def _backing_off(self, side: str) -> bool:
        return self.clock() < self._down_until[side]

    def _round_trip(self, work, moved: str, client_for=None):
        """work(client) -> (result, bytes moved), timed and counted under `moved`; None when its side
        is backing off or fails now. The client is the readers' shared one, or client_for()'s (the
        writer's)."""
        side = "reads" if client_for is None else "writes"
        if self._backing_off(side):
            return None
        try:
            if client_for is not None:
                client = client_for()
            else:
                client = self._get_client()
                if not self._measured:
                    self._first_round_trip(client)
            t0 = time.perf_counter()
            result, n_bytes = work(client)
        # Dead, slow, refused, a cluster that moved, and whatever a peer that only passes for Redis makes
        # the client or its parser raise (AttributeError on a HELLO answered +OK, RecursionError on a
        # reply nested 5,000 deep, ValueError on a socket closed under a read): all a failure of the
        # tier, and a miss. Nothing of it reaches the caller, where a RuntimeError would read as
        # "the server is shutting down", or kills the writer thread.
        except Exception as e:  # noqa: BLE001 — see above
            self._fail(e, side)
            return None
        self._measure(time.perf_counter() - t0, n_bytes)
        self._count(moved, n_bytes)
        return result

    def _fail(self, error: Exception, side: str) -> None:
        """Count a failure, back off on its side, and say it (the first time in the log; the last in
        stats)."""
        self._count("failures")
        self._down_until[side] = self.clock() + self.backoff_s
        self._drop_client(side)
        self.last_error = f"{type(error).__name__}: {_reason(error)}"
        self._warn_once(
            "unreachable",
            f"remote KV tier {self.where} failed ({self.last_error}); computing instead, "
            f"and trying it again every {self.backoff_s:g} s",
        )

    def _first_round_trip(self, client) -> None:
        """A client's first use connects (a cluster client also learns its slots): not timed, as that is
        not what later round trips cost; then one PING measures the latency. Once per client, not per
        thread: reads come from whichever thread submits a reply (a new one for each, in the app), and
        the pool's connections are made by then."""
        client.ping()
        t0 = time.perf_counter()
        client.ping()
        self._measure(time.perf_counter() - t0, 0)
        self._measured = True

    def _measure(self, seconds: float, n_bytes: int) -> None:
        self._count("round_trips")
        if n_bytes < SMALL_ROUND_TRIP:
            self.rtt_s.add(seconds)
        else:
            transfer = max(seconds - (self.rtt_s.value or 0.0), 1e-6)
            self.bytes_per_s.add(n_bytes / transfer)

    def _get_client(self):
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
                self._measured = False
            return self._client

    def _get_writer_client(self):
        """The writer thread's client (only that thread calls this), connected outside any timing."""
        if self._writer_client is None:
            client = self._connect_writer()
            client.ping()
            self._writer_client = client
        return self._writer_client

    def _drop_client(self, side: str | None = None) -> None:
        """Forget the clients of a side ("reads", "writes"; None: both): its next round trip connects
        anew. They are not closed here, as another thread (the writer, or a reader) may be in the middle
        of a round trip on one; its connections close when the last one lets go of it."""
        with self._client_lock:
            if side != "writes":
                self._client = None
                self._measured = False
            if side != "reads":
                self._writer_client = None

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[name] += n

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    # -- the rule --------------------------------------------------------------------------------

    def estimated_bytes(self, n_blocks: int) -> int:
        """What reading n_blocks would move, from the blocks seen so far (0 before any)."""
        return int(n_blocks * (self.block_bytes.value or 0))

    def fetch_seconds(self, n_bytes: int) -> float | None:
        """One round trip plus the bytes at the measured rate; None before anything is measured."""
        if self.rtt_s.value is None:
            return None
        rate = self.bytes_per_s.value
        return self.rtt_s.value + (n_bytes / rate if rate else 0.0)

    def worth_fetching(self, n_blocks: int, n_bytes: int, prefill_tok_s: float, n_tokens: int) -> bool:
        """Whether reading n_blocks (n_bytes) is faster than computing their n_tokens at prefill_tok_s.
        Before anything is measured, fetch: the fetch itself measures (a miss costs one round trip)."""
        if n_blocks <= 0 or self._backing_off("reads"):
            return False
        if self.always_fetch:
            return True
        fetch_s = self.fetch_seconds(n_bytes)
        if fetch_s is None or not prefill_tok_s or prefill_tok_s <= 0:
            return True
        return fetch_s < n_tokens / prefill_tok_s

    def stats(self) -> dict:
        """The tier's numbers for status lines and `usage`."""
        with self._counts_lock:
            counts = dict(self.counts)
        rtt, rate = self.rtt_s.value, self.bytes_per_s.value
        return {
            "url": self.where,
            "up": not self.down,
            "last_error": self.last_error,
            **counts,
            "rtt_ms": None if rtt is None else round(rtt * 1000, 2),
            "mb_per_s": None if rate is None else round(rate / 1e6, 1),
            # blocks queued or being written: a batch the writer took is not written until it says so
            "queued_writes": self._queue.unfinished_tasks,
        }


def _reason(error: Exception) -> str:
    """An error's message on one line, without the command a pipeline failed on (it would print a
    block's bytes)."""
    return " ".join(str(error).rpartition("caused error: ")[2].split())[:200]
