"""One model's KV blocks in the chat store: the block pool's source on a miss, and where snapshots go.

Everything about blocks as bytes lives here: the codec, the checksums, the check that a stored block
stands for the tokens asked for. A block that fails any check is dropped and reported missing, so the
caller recomputes it from tokens: the message tree is the truth, the KV only a cache of it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .codec import CorruptBlockError, KVPlan, checksum, decode_kv, encode_kv, kv_matches
from .records import StoredBlock, StoredTail
from .remote import MovingAverage, RemoteTier
from .store import ChatStore

KV = tuple[np.ndarray, np.ndarray]  # k, v [n_layer, n_kv_head, n_tokens, head_dim]

# Blocks read from the remote tier wait in RAM, as read, until their session's next snapshot writes them
# to SQLite: writing ~11 MB there and reading it back cost ~55 ms of a 2,000-token conversation's first
# token on another server. Past this many bytes the oldest are forgotten (only a cache: recomputed).
MAX_FETCHED_BYTES = 256 << 20
# Tails read with a conversation's blocks wait for remote_tail; one that is not taken (a local tail was
# used, the reply was refused) is forgotten after this many newer ones.
MAX_FETCHED_TAILS = 64


def decode_checked(data: bytes, expected_checksum: str) -> KV | None:
    """The KV of stored bytes, or None when they are not what was written."""
    return _decoded(data) if checksum(data) == expected_checksum else None


def _decoded(data: bytes, out: KV | None = None) -> KV | None:
    try:
        return decode_kv(data, out)
    except CorruptBlockError:
        return None


def _fits(tail: StoredTail | None, parent_key: bytes | None, want: Sequence[int]) -> int:
    """How many of the tokens `want` (those after the block `parent_key`) a stored tail holds."""
    if tail is None or tail.parent_key != parent_key:
        return 0
    n = 0
    while n < min(len(want), len(tail.tokens)) and want[n] == tail.tokens[n]:
        n += 1
    return n


def tail_key(parent_key: bytes | None, tokens: Sequence[int]) -> bytes:
    """A tail's name in the remote tier: like a block's prefix key it stands for every token before it
    (parent_key) and its own, so another server that holds the same conversation finds it."""
    return hashlib.sha256(b"tail" + (parent_key or b"") + np.asarray(tokens, dtype="<i4").tobytes()).digest()


@dataclass
class RemoteRead:
    """What the remote tier did for one prompt: the rule's choice, and the tokens it read."""

    choice: str = "local"  # "fetch" or "compute"; "local": RAM and SQLite held every full block
    tokens: int = 0
    seconds: float = 0.0  # the time it took, round trip and checks


class KVStore:
    def __init__(
        self,
        store: ChatStore,
        fingerprint: str,
        codec: str,
        remote: RemoteTier | None = None,
        plan: KVPlan | None = None,
    ):
        self.store = store
        self.fingerprint = fingerprint
        self.codec = codec  # what new blocks are written in; any stored block reads, whatever its codec
        self.plan = plan  # the auto codec's bits per layer and head (kv_plan.model_plan)
        self.remote = remote  # the tier under SQLite shared with other servers (--kv-remote), if any
        self.prefill_tok_s = MovingAverage()  # the model's, measured on replies: what `remote` must beat
        # from `remote`, by namespace and prefix key, not in SQLite yet; tails by namespace and tail_key
        self.fetched: OrderedDict[tuple[bytes | None, bytes], StoredBlock] = OrderedDict()
        self.fetched_tails: OrderedDict[tuple[bytes | None, bytes], StoredBlock] = OrderedDict()
        self._fetched_lock = threading.Lock()  # (snapshots are stored off the scheduler's thread)

    def fetch(self, key: bytes, tokens: Sequence[int], namespace: bytes | None, out: KV) -> bool:
        """A stored block of the namespace decoded into `out` (the pool's arena), checked whole as it is
        decoded, against the tokens it stands for and out's shape; a bad one is dropped so it gets
        recomputed."""
        block = self._fetched(namespace, key) or self.store.kv.load_block(key, self.fingerprint, namespace)
        if block is None:
            return False
        # No CRC of the bytes here: decoding checks them whole (a block is its header and one zstd frame
        # that repeats the header and carries its content's checksum), and the CRC cost ~3 ms of a
        # 2,000-token resume. (A remote block had its signature checked as it was read.)
        kv = _decoded(block.data, out) if block.tokens == list(tokens) else None
        if kv is None:
            self._forget([key], namespace)
            self.store.kv.drop_block(key, namespace)
        return kv is not None

    def _fetched(self, namespace: bytes | None, key: bytes) -> StoredBlock | None:
        with self._fetched_lock:
            return self.fetched.get((namespace, key))

    def _keep_fetched(self, blocks: Sequence[StoredBlock], namespace: bytes | None) -> None:
        with self._fetched_lock:
            for block in blocks:
                self.fetched[namespace, block.key] = block
                self.fetched.move_to_end((namespace, block.key))
            total = sum(len(b.data) for b in self.fetched.values())
            while total > MAX_FETCHED_BYTES:
                total -= len(self.fetched.popitem(last=False)[1].data)

    def _forget(self, keys: Sequence[bytes], namespace: bytes | None) -> None:
        with self._fetched_lock:
            for key in keys:
                self.fetched.pop((namespace, key), None)

    def tail(
        self, session_id: str, parent_key: bytes | None, want: Sequence[int]
    ) -> tuple[list[int], KV] | None:
        """The stored tail of a session (the KV after its last full block) as far as it matches `want`,
        the tokens that follow `parent_key`; None when it does not fit or is damaged."""
        tail = self.store.kv.load_tail(session_id, self.fingerprint)
        n = _fits(tail, parent_key, want)
        kv = decode_checked(tail.data, tail.checksum) if n else None
        if kv is None or kv[0].shape[2] != len(tail.tokens):
            return None
        k, v = kv
        return tail.tokens[:n], (k[:, :, :n], v[:, :, :n])

    def save(
        self,
        session_id: str,
        blocks: Sequence[tuple[bytes, Sequence[int]]],
        block_kv: Callable[[int], KV],
        tail: tuple[list[int], np.ndarray, np.ndarray] | None,
        n_tokens: int,
        namespace: bytes | None,
        travels: bool = False,
    ) -> list[StoredBlock]:
        """Store a session's KV in one transaction: its full blocks (key, tokens) — encoding only those
        not stored yet, block_kv(i) gives the i-th one's KV — and its tail; and, where it `travels`
        (computed here, not imported), write them to the remote tier in the background, in their
        namespace. Returns the new blocks."""
        keys = [key for key, _ in blocks]
        stored = self.store.kv.stored_keys(keys, namespace)
        new_blocks, remote_keys = [], set()
        for i, (key, tokens) in enumerate(blocks):
            if key in stored:
                continue
            fetched = self._fetched(namespace, key)
            if fetched is not None and fetched.tokens == list(tokens):
                new_blocks.append(fetched)  # as another server wrote it: nothing to encode
                remote_keys.add(key)
            else:
                data = encode_kv(*block_kv(i), self.codec, self.plan)
                new_blocks.append(
                    StoredBlock(key, len(tokens), self.codec, data, checksum(data), list(tokens))
                )
        stored_tail = None
        if tail is not None:
            tokens, k, v = tail
            data = encode_kv(k, v, self.codec, self.plan)
            stored_tail = StoredTail(keys[-1] if keys else None, tokens, self.codec, data, checksum(data))
        self.store.kv.save_snapshot(
            session_id, self.fingerprint, keys, new_blocks, stored_tail, n_tokens, namespace
        )
        self._forget(keys, namespace)  # stored now
        if self.remote is not None and travels:  # an import's blocks never leave
            for block in new_blocks:
                if block.key in remote_keys:
                    continue  # the tier has it: it came from there
                self.remote.put(block, namespace)  # in the background: a full queue drops, nothing waits
            if stored_tail is not None:
                t = stored_tail
                key = tail_key(t.parent_key, t.tokens)
                tail_block = StoredBlock(key, len(t.tokens), t.codec, t.data, t.checksum, t.tokens)
                self.remote.put(tail_block, namespace)
        return new_blocks

    def remote_tail(
        self, parent_key: bytes | None, tokens: Sequence[int], namespace: bytes | None = None
    ) -> tuple[list[int], KV] | None:
        """A tail another server stored for exactly these tokens after the block `parent_key` (in the
        namespace), as read_remote read it (on the thread that submitted the reply: nothing is read from
        the network here); None when it read none or it fails a check."""
        if self.remote is None or not tokens:
            return None
        with self._fetched_lock:
            block = self.fetched_tails.pop((namespace, tail_key(parent_key, tokens)), None)
        kv = _decoded(block.data) if block is not None else None  # (its checksum was checked as it was read)
        if kv is None or block.tokens != list(tokens) or kv[0].shape[2] != len(tokens):
            return None
        return list(tokens), kv

    def has_tail(self, session_id: str, parent_key: bytes | None, tokens: Sequence[int]) -> bool:
        """Whether the session's tail stored here follows `parent_key` and starts as `tokens` do (then
        restore_tail takes it, and no other server's is needed)."""
        return _fits(self.store.kv.load_tail(session_id, self.fingerprint), parent_key, tokens) > 0

    def read_remote(
        self,
        missing: Sequence[tuple[bytes, tuple[int, ...]]],
        tail: tuple[bytes | None, tuple[int, ...]] | None = None,
        session_id: str | None = None,
        namespace: bytes | None = None,
    ) -> RemoteRead:
        """Full blocks (prefix key, tokens) of the namespace that RAM lacks, in order: those SQLite
        lacks too are read from the remote tier in one round trip, when its measured round trips and
        bytes per second beat computing them at the measured prefill speed, and kept in RAM as read (the
        pool then takes them as any stored block) until the session's snapshot stores them in SQLite.
        The tail (parent key, tokens) after them, if asked for and the session (`session_id`) has none
        here for it, comes in the same round trip (alone where no block is missing) and waits for
        remote_tail. Says what was chosen and how many tokens of blocks were read."""
        if self.remote is None:
            return RemoteRead()
        t0 = time.perf_counter()
        with self._fetched_lock:
            missing = [(key, tokens) for key, tokens in missing if (namespace, key) not in self.fetched]
        stored = self.store.kv.stored_keys([key for key, _ in missing], namespace)
        missing = [(key, tokens) for key, tokens in missing if key not in stored]
        if missing:
            n_bytes = self.remote.estimated_bytes(len(missing))
            n_tokens = sum(len(tokens) for _, tokens in missing)
            if not self.remote.worth_fetching(len(missing), n_bytes, self.prefill_tok_s.value or 0.0, n_tokens):
                return RemoteRead("compute", 0, time.perf_counter() - t0)  # and a tail after them is no use
        # a round trip after an 11 MB answer took 20 ms on loopback every other time (and one more RTT
        # on a real link): the tail, the last thing a returning conversation needs, comes with the blocks
        tail_read = self._tail_to_read(tail, session_id, namespace)
        if not missing and not tail_read:
            return RemoteRead("local", 0, time.perf_counter() - t0)
        blocks = self.remote.fetch_run([*missing, *tail_read], self.codec, namespace)
        found = []
        for block in blocks[: len(missing)]:
            if block is None:
                break  # the pool stops at the first missing block anyway
            found.append(block)
        self._keep_fetched(found, namespace)
        if tail_read and blocks[-1] is not None:
            with self._fetched_lock:  # under its own key (its parent's and its tokens'), for remote_tail
                self.fetched_tails[namespace, tail_read[0][0]] = blocks[-1]
                while len(self.fetched_tails) > MAX_FETCHED_TAILS:
                    self.fetched_tails.popitem(last=False)
        choice = "fetch" if missing else "local"  # (local: every full block was here; a tail was read)
        return RemoteRead(choice, sum(block.n_tokens for block in found), time.perf_counter() - t0)

    def _tail_to_read(
        self,
        tail: tuple[bytes | None, tuple[int, ...]] | None,
        session_id: str | None,
        namespace: bytes | None,
    ) -> list[tuple[bytes, tuple[int, ...]]]:
        """[(tail_key, tokens)] for the tail asked for, unless it was read already or the session has one
        here that fits."""
        if tail is None:
            return []
        key = tail_key(*tail)
        with self._fetched_lock:
            if (namespace, key) in self.fetched_tails:
                return []
        if session_id is not None and self.has_tail(session_id, *tail):
            return []
        return [(key, tail[1])]

    def load(self, key: bytes, namespace: bytes | None) -> StoredBlock | None:
        return self.store.kv.load_block(key, self.fingerprint, namespace)

    @staticmethod
    def matches(stored: StoredBlock, tokens: Sequence[int], kv: KV) -> bool:
        """Whether a stored block is intact, stands for `tokens` and holds `kv` (freshly computed) up to
        its codec's rounding."""
        if stored.tokens != list(tokens) or decode_checked(stored.data, stored.checksum) is None:
            return False
        return kv_matches(stored.data, *kv)
