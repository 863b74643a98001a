"""Reading the remote tier, and what it sent waiting in RAM: blocks until a snapshot stores them in
SQLite, tails until a resume takes them, each under its namespace (a tenant's, or None: the blocks
every session shares). Only a cache: what is forgotten is read again or recomputed."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .records import StoredBlock
from .remote import RemoteTier

# Writing the ~11 MB of a 2,000-token conversation's blocks to SQLite and reading them back costs ~55 ms of
# its first token on another server, so they wait here as read. Past this many bytes the oldest go.
MAX_FETCHED_BYTES = 256 << 20
# A tail that is not taken (a local one was used, the reply was refused) goes after this many newer ones.
MAX_FETCHED_TAILS = 64


Named = tuple[bytes | None, bytes]  # (namespace, prefix key or tail key)


class Fetched:
    """Blocks by namespace and prefix key, tails by namespace and tail key, read from the remote tier.
    Thread-safe: snapshots are stored off the scheduler's thread, reads happen on the threads that
    submit replies."""

    def __init__(self, max_bytes: int = MAX_FETCHED_BYTES, max_tails: int = MAX_FETCHED_TAILS):
        self.max_bytes, self.max_tails = max_bytes, max_tails
        self.blocks: OrderedDict[Named, StoredBlock] = OrderedDict()
        self.tails: OrderedDict[Named, StoredBlock] = OrderedDict()
        self._lock = threading.Lock()

    def read(
        self,
        remote: RemoteTier,
        missing: list[tuple[bytes, tuple[int, ...]]],
        tail: tuple[bytes, tuple[int, ...]] | None,
        codec: str,
        prefill_tok_s: float,
        namespace: bytes | None = None,
    ) -> tuple[str, int]:
        """Blocks (prefix key, tokens) of the namespace RAM and SQLite lack, in order, read in one round
        trip when the tier's measured round trips and bytes per second beat computing them at
        `prefill_tok_s`, and kept here; the tail (tail key, tokens) after them rides along (alone where no
        block is missing). Returns the choice ("fetch", "compute"; "local": no block was missing) and the
        tokens read."""
        if missing:
            n_bytes, n_tokens = remote.estimated_bytes(len(missing)), sum(len(t) for _, t in missing)
            if not remote.worth_fetching(len(missing), n_bytes, prefill_tok_s, n_tokens):
                return "compute", 0  # and a tail after them is no use
        if not missing and tail is None:
            return "local", 0
        # a round trip after an 11 MB answer takes ~20 ms on loopback every other time (and one more RTT
        # on a real link): the tail, the last thing a returning conversation needs, comes with the blocks
        blocks = remote.fetch_run([*missing, *([tail] if tail else [])], codec, namespace)
        found = []
        for block in blocks[: len(missing)]:
            if block is None:
                break  # the pool stops at the first missing block anyway
            found.append(block)
        self.keep_blocks(found, namespace)
        if tail is not None and blocks[-1] is not None:
            self.keep_tail(tail[0], blocks[-1], namespace)
        return "fetch" if missing else "local", sum(block.n_tokens for block in found)

    def block(self, key: bytes, namespace: bytes | None = None) -> StoredBlock | None:
        with self._lock:
            return self.blocks.get((namespace, key))

    def keep_blocks(self, blocks: Sequence[StoredBlock], namespace: bytes | None = None) -> None:
        with self._lock:
            for block in blocks:
                self.blocks[namespace, block.key] = block
                self.blocks.move_to_end((namespace, block.key))
            total = sum(len(b.data) for b in self.blocks.values())
            while total > self.max_bytes:
                total -= len(self.blocks.popitem(last=False)[1].data)

    def forget(self, keys: Sequence[bytes], namespace: bytes | None = None) -> None:
        with self._lock:
            for key in keys:
                self.blocks.pop((namespace, key), None)

    def keep_tail(self, key: bytes, tail: StoredBlock, namespace: bytes | None = None) -> None:
        with self._lock:
            self.tails[namespace, key] = tail
            while len(self.tails) > self.max_tails:
                self.tails.popitem(last=False)

    def has_tail(self, key: bytes, namespace: bytes | None = None) -> bool:
        with self._lock:
            return (namespace, key) in self.tails

    def take_tail(self, key: bytes, namespace: bytes | None = None) -> StoredBlock | None:
        with self._lock:
            return self.tails.pop((namespace, key), None)
