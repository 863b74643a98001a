"""The paged KV cache: a pool of fixed-size blocks shared by every sequence of a model in the process.

A block holds keys and values of B consecutive tokens for every layer. A full block is named by
`prefix_key = hash(model fingerprint, parent block's key, its B token ids)` (vLLM's prefix caching):
its KV depends on nothing else, so any sequence whose tokens start the same way can use it as is.
Full blocks are immutable; a sequence writes only into its own last, partial block, and copies that
block first when another sequence shares it (copy-on-write). So `fork` is a list copy, no KV moves.

All blocks live in one arena per pool (kv_arena.py says how it is laid out and read); the forward pass
reads a sequence through `KVSequence.views`, writes it through `reserve` + `write`, copies it with `gather`.
Unreferenced full blocks stay cached and are evicted least-recently-used under the RAM budget.

Blocks missing from RAM may come from a `BlockSource` handed to the pool when it is built (the
conversation store): `source.fetch(key, tokens, namespace, out)` writes the block's keys and values
into `out`, the (k, v) views [layer, kv_head, B, head_dim] (of kv_arena.CACHE_TYPES) of a free slot, and
says True if it holds a block of that prefix key in that namespace made from exactly those tokens and
of that shape, else False. Decoded where it will be read, a stored block is never copied again; the
pool keeps what it fetched in RAM.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .config import ModelConfig
from .errors import ContextFullError
from .kv_arena import DEFAULT_CACHE_TYPE, KVViews, arena, element_type, key_run

DEFAULT_BLOCK_SIZE = 64
DEFAULT_CACHE_RAM_MB = 1024


class CacheFullError(MemoryError):
    """Every block of the pool is in use by a live sequence: the RAM budget is too small."""


def prefix_key(fingerprint: str, parent: bytes | None, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(fingerprint.encode())
    h.update(parent or b"\0" * 16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


BlockName = tuple[bytes | None, bytes | None]  # (namespace, prefix key): what the pool shares a block under
BlockWanted = tuple[bytes, tuple[int, ...]]  # (prefix key, tokens): a full block a slower tier may hold


class BlockSource(Protocol):
    """Where blocks missing from RAM may be found (see the module's docstring)."""

    def fetch(
        self, key: bytes, tokens: tuple[int, ...], namespace: bytes | None, out: tuple[np.ndarray, np.ndarray]
    ) -> bool: ...


class KVBlock:
    __slots__ = ("slot", "key", "tokens", "refs", "namespace")

    def __init__(self, slot: int):
        self.slot = slot  # where its B positions sit in the pool's arena
        self.key: bytes | None = None  # set once the block is full and registered for sharing
        self.tokens: tuple[int, ...] = ()  # the tokens of a full block
        self.refs = 0  # live sequences using it
        self.namespace: bytes | None = None  # whose blocks it is shared among (KVSequence.namespace)

    @property
    def name(self) -> BlockName:
        """What the pool shares it under: its namespace and its prefix key."""
        return self.namespace, self.key


class BlockPool:
    """All KV memory of one model: the arena, the free slots, the shared full blocks, the LRU."""

    def __init__(
        self,
        cfg: ModelConfig,
        fingerprint: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        ram_mb: float = DEFAULT_CACHE_RAM_MB,
        source: BlockSource | None = None,
        cache_type: str = DEFAULT_CACHE_TYPE,
    ):
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.cache_type = cache_type
        dtype = element_type(cache_type)
        self.token_bytes = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * dtype.itemsize  # k and v
        self.block_bytes = self.token_bytes * block_size
        self.n_slots = max(int(ram_mb * 2**20) // self.block_bytes, 2)
        # The arena (kv_arena.arena: keys by block, values by row): read and written in this module only.
        self._k, self._v = arena(cfg.n_layer, cfg.n_head_kv, self.n_slots, cfg.head_dim, dtype, block_size)
        self.free_slots: set[int] = set(range(self.n_slots))
        # Full blocks by name (namespace, prefix key): a namespace's blocks are shared only within it.
        self.by_key: dict[BlockName, KVBlock] = {}
        self.lru: OrderedDict[BlockName, KVBlock] = OrderedDict()  # unreferenced full blocks, oldest first
        self._ids = itertools.count(1)
        self.sequences: dict[int, KVSequence] = {}
        self._source = source

    @property
    def source(self) -> BlockSource | None:
        """Where blocks missing from RAM are looked for: set when the pool is built, or attached once."""
        return self._source

    def attach_source(self, source: BlockSource) -> None:
        """Read missing blocks from `source` from now on. A pool has one source: a second one (say a
        second chat engine on the same loaded model) would silently take the first one's blocks away."""
        if self._source is not None and self._source is not source:
            raise RuntimeError(
                "this model's KV block pool already reads from another block source; "
                "load the model again for a second one"
            )
        self._source = source

    # -- blocks ---------------------------------------------------------------------------------
    def allocate(self, after: int | None = None) -> KVBlock:
        """A fresh block, in the slot right after `after` when that one is free (keeps runs contiguous)."""
        if not self.free_slots:
            self._evict_one()
        slot = after + 1 if after is not None and after + 1 in self.free_slots else min(self.free_slots)
        self.free_slots.remove(slot)
        block = KVBlock(slot)
        block.refs = 1
        return block

    def _evict_one(self) -> None:
        if not self.lru:
            raise CacheFullError(
                f"KV cache full: all {self.n_slots} blocks ({self.n_slots * self.block_bytes >> 20} MB) "
                "are in use; raise --cache-ram"
            )
        name, block = self.lru.popitem(last=False)
        del self.by_key[name]
        self.free_slots.add(block.slot)

    def acquire(self, block: KVBlock) -> KVBlock:
        if block.refs == 0 and block.key is not None:
            self.lru.pop(block.name, None)
        block.refs += 1
        return block

    def release(self, block: KVBlock) -> None:
        block.refs -= 1
        if block.refs > 0:
            return
        if block.key is not None and self.by_key.get(block.name) is block:
            self.lru[block.name] = block  # stays cached until the budget needs its slot
        else:
            self.free_slots.add(block.slot)

    def register(
        self, block: KVBlock, key: bytes, tokens: tuple[int, ...], namespace: bytes | None = None
    ) -> KVBlock:
        """Make a full block shareable under its prefix key (within its namespace); if an equal block
        exists, use that one."""
        existing = self.by_key.get((namespace, key))
        if existing is not None and existing is not block:
            self.acquire(existing)
            self.release(block)
            return existing
        block.key, block.tokens, block.namespace = key, tokens, namespace
        self.by_key[block.name] = block
        return block

    def block_keys(self, ids: Sequence[int]) -> list[bytes]:
        """The prefix keys of the full blocks of `ids`, in order: each names its block and every token
        before it."""
        B, keys, parent = self.block_size, [], None
        for i in range(len(ids) // B):
            parent = prefix_key(self.fingerprint, parent, ids[i * B : (i + 1) * B])
            keys.append(parent)
        return keys

    def missing(self, ids: Sequence[int], namespace: bytes | None = None) -> list[BlockWanted]:
        """The full blocks of `ids` that RAM lacks in `namespace`, as (prefix key, tokens): what a
        slower tier may be asked for. (It may be read without the pool's lock: it only says what to
        fetch, and lookup confirms every block taken.)"""
        B = self.block_size
        return [
            (key, tuple(ids[i * B : (i + 1) * B]))
            for i, key in enumerate(self.block_keys(ids))
            if (namespace, key) not in self.by_key
        ]

    def lookup(self, key: bytes, tokens: tuple[int, ...], namespace: bytes | None = None) -> KVBlock | None:
        """The shared full block with this prefix key in this namespace: from RAM, else from `source`
        (then kept in RAM). A hit is confirmed against its tokens (as nano-vllm's block manager does)."""
        block = self.by_key.get((namespace, key))
        if block is not None:
            if block.tokens != tokens:
                return None
            if block.refs == 0:
                self.lru.move_to_end(block.name)
            return block
        if self._source is None:
            return None
        block = self.allocate()
        if not self._source.fetch(key, tokens, namespace, self.block_kv(block)):
            self.release(block)  # (unnamed: its slot is free again)
            return None
        block.refs = 0
        self.register(block, key, tokens, namespace)
        self.lru[block.name] = block
        return block

    def copy_block(self, src: KVBlock, n_tokens: int, after: int | None) -> KVBlock:
        dst = self.allocate(after)
        B = self.block_size
        s, d = src.slot * B, dst.slot * B
        self._k[:, :, dst.slot, :, :n_tokens] = self._k[:, :, src.slot, :, :n_tokens]
        self._v[:, :, d : d + n_tokens] = self._v[:, :, s : s + n_tokens]
        return dst

    def block_kv(self, block: KVBlock, n_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of one block, [layer, kv_head, n, head_dim] views into the arena (the keys'
        strided: the arena holds them by block)."""
        B = self.block_size
        s = block.slot * B
        n = B if n_tokens is None else n_tokens
        return self._k[:, :, block.slot, :, :n].swapaxes(2, 3), self._v[:, :, s : s + n]

    # -- sequences ------------------------------------------------------------------------------
    def new_sequence(self, n_ctx: int, private: bool = False, namespace: bytes | None = None) -> KVSequence:
        """An empty sequence: sharing blocks within `namespace` (None: every sequence's), or none at all
        (`private`, see KVSequence)."""
        seq = KVSequence(self, next(self._ids), n_ctx, private, namespace)
        self.sequences[seq.seq_id] = seq
        return seq

    def memory_breakdown(self) -> dict:
        """Bytes of KV in use, shared between sequences, cached for reuse, and per sequence."""
        live = {id(b): b for seq in self.sequences.values() for b in seq.blocks}
        return {
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "budget_bytes": self.n_slots * self.block_bytes,
            "in_use_bytes": len(live) * self.block_bytes,
            "shared_bytes": sum(self.block_bytes for b in live.values() if b.refs > 1),
            "cached_bytes": len(self.lru) * self.block_bytes,
            "free_bytes": len(self.free_slots) * self.block_bytes,
            "per_sequence": {sid: len(s.blocks) * self.block_bytes for sid, s in self.sequences.items()},
        }


class KVSequence:
    """The KV of one sequence: a list of blocks (all full but maybe the last) and its tokens."""

    def __init__(
        self, pool: BlockPool, seq_id: int, n_ctx: int, private: bool = False, namespace: bytes | None = None
    ):
        self.pool = pool
        self.seq_id = seq_id
        self.n_ctx = n_ctx
        self.blocks: list[KVBlock] = []
        self.tokens: list[int] = []  # the token at each cached position
        # Whose blocks it shares (vLLM's cache_salt): None, every sequence's; a session resumed from an
        # imported file reads and makes blocks in that import's namespace, which no other session reaches.
        self.namespace = namespace
        # Private KV is not that of a plain prefix (after a context shift, or decoded by a lossy codec
        # for a measurement): it is never shared under a prefix key, nor taken from the pool.
        self.private = private

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def last_key(self) -> bytes | None:
        """The prefix key of its last block, once that one is full and shared (else None)."""
        return self.blocks[-1].key if self.blocks else None

    # -- llama.cpp's sequence operations ----------------------------------------------------------
    def fork(self) -> KVSequence:
        """A new sequence sharing every block (seq_cp): O(blocks), no KV copied."""
        child = self.pool.new_sequence(self.n_ctx, self.private, self.namespace)
        child.blocks = [self.pool.acquire(b) for b in self.blocks]
        child.tokens = list(self.tokens)
        return child

    def truncate(self, n_tokens: int) -> None:
        """Forget every position from n_tokens on (seq_rm)."""
        n_tokens = max(0, min(n_tokens, self.n_tokens))
        keep = -(-n_tokens // self.pool.block_size)
        for block in self.blocks[keep:]:
            self.pool.release(block)
        del self.blocks[keep:]
        del self.tokens[n_tokens:]

    def free(self) -> None:
        self.truncate(0)
        self.pool.sequences.pop(self.seq_id, None)

    def common_prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def reuse_prefix(self, ids: Sequence[int]) -> int:
        """Keep the longest prefix of ids this sequence holds, then take any further full blocks of ids
        that the pool already has; return how many leading tokens of ids need no computing."""
        self.truncate(self.common_prefix(ids))
        B = self.pool.block_size
        while not self.private and self.n_tokens % B == 0 and self.n_tokens + B <= len(ids):
            chunk = tuple(ids[self.n_tokens : self.n_tokens + B])
            parent = self.last_key
            if self.blocks and parent is None:
                break
            block = self.pool.lookup(prefix_key(self.pool.fingerprint, parent, chunk), chunk, self.namespace)
            if block is None:
                break
            self.blocks.append(self.pool.acquire(block))
            self.tokens.extend(chunk)
        return self.n_tokens

    def append_kv(self, tokens: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        """Add tokens whose KV was computed elsewhere (a stored tail): k, v [layer, kv_head, n, head_dim]."""
        where = self.reserve(len(tokens))
        for layer in range(self.pool.cfg.n_layer):
            self.write(layer, where, k[layer], v[layer])
        self.commit(tokens)

    def snapshot(self) -> tuple[list[KVBlock], tuple[list[int], np.ndarray, np.ndarray] | None]:
        """What persisting this sequence needs: its shareable full blocks (read their KV with
        pool.block_kv) and its tail — the tokens after them with their KV (copies), or None.

        A private sequence has no tail to persist: its KV after the last shared block is not that of its
        tokens (after a context shift it still saw the dropped ones), and a stored tail is taken back,
        by a new process or another server, as the KV of its tokens."""
        B = self.pool.block_size
        full = []
        for i, block in enumerate(self.blocks):
            if block.key is None or (i + 1) * B > self.n_tokens:
                break
            full.append(block)
        start = len(full) * B
        if start >= self.n_tokens or self.private:
            return full, None
        return full, (self.tokens[start:], *self.gather(start, self.n_tokens))

    def shift(self, keep: int, drop: int, rerotate: Callable[[int, np.ndarray], np.ndarray]) -> None:
        """Forget positions keep..keep+drop-1 and move the later ones back by `drop` (llama.cpp's seq_rm +
        seq_add): their KV is kept, `rerotate(layer, k)` gives one layer's moved keys [kv_head, m, hd] for
        their new positions. The moved KV still saw the dropped tokens in deeper layers, so the sequence
        becomes private: its blocks are never shared under a prefix key."""
        n = self.n_tokens
        if not (0 <= keep and drop > 0 and keep + drop <= n):
            raise ValueError(f"cannot drop {drop} tokens after {keep} of {n}")
        moved_tokens = self.tokens[keep + drop :]
        k, v = self.gather(keep + drop, n)
        self.truncate(keep)
        self.private = True
        if not moved_tokens:
            return
        for layer in range(len(k)):
            k[layer] = rerotate(layer, k[layer])
        self.append_kv(moved_tokens, k, v)

    def gather(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the keys and values of positions first..end-1, [layer, kv_head, n, head_dim]."""
        k, v = self.pool._k, self.pool._v
        keys = [key_run(k, a, n) for a, n in self._runs(first, end)] or [key_run(k, 0, 0)]
        return np.concatenate(keys, axis=2), v[:, :, self._arena_positions(first, end)]

    # -- what the forward pass uses ---------------------------------------------------------------
    def reserve(self, n_new: int) -> np.ndarray:
        """Make room for n_new tokens after the current ones; return their arena positions."""
        if self.n_tokens + n_new > self.n_ctx:
            raise ContextFullError(
                f"{self.n_tokens + n_new:,} tokens do not fit in the context window of {self.n_ctx:,}"
            )
        B = self.pool.block_size
        n = self.n_tokens
        if n % B and (self.blocks[-1].refs > 1 or self.blocks[-1].key is not None):
            # the partial last block is shared (or a truncated full block): copy it before writing
            old = self.blocks[-1]
            after = self.blocks[-2].slot if len(self.blocks) > 1 else None
            self.blocks[-1] = self.pool.copy_block(old, n % B, after)
            self.pool.release(old)
        while len(self.blocks) * B < n + n_new:
            self.blocks.append(self.pool.allocate(self.blocks[-1].slot if self.blocks else None))
        positions = np.arange(n, n + n_new)
        slots = np.array([b.slot for b in self.blocks], dtype=np.int64)
        return slots[positions // B] * B + positions % B

    def write(self, layer: int, where: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        # k, v [n_kv, T, hd] for the arena positions `where` from reserve()
        B = self.pool.block_size
        if len(where) == 1:  # (a decoded token: slices, not NumPy's indexing by arrays, 3x as quick)
            slot, lane = divmod(int(where[0]), B)
            self.pool._k[layer, :, slot, :, lane] = k[:, 0]
            self.pool._v[layer, :, where[0]] = v[:, 0]
            return
        self.pool._k[layer][:, where // B, :, where % B] = k.swapaxes(0, 1)  # (indexed axes come first)
        if len(where) and where[-1] - where[0] == len(where) - 1:
            self.pool._v[layer, :, where[0] : where[-1] + 1] = v
        else:
            self.pool._v[layer][:, where] = v  # (indexing [layer, :, where] would move the axes)

    def views(self, first: int, end: int) -> KVViews:
        """Positions first..end-1 (first may be negative: from 0) as they lie in the arena, for attention."""
        return KVViews(self.pool._k, self.pool._v, [slice(a, a + n) for a, n in self._runs(first, end)])

    def _runs(self, first: int, end: int) -> list[tuple[int, int]]:
        """Positions first..end-1 as runs of consecutive arena positions: (arena start, length)."""
        B = self.pool.block_size
        out: list[tuple[int, int]] = []
        pos = max(first, 0)
        while pos < end:
            start = self.blocks[pos // B].slot * B + pos % B
            length = min(B - pos % B, end - pos)
            if out and out[-1][0] + out[-1][1] == start:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((start, length))
            pos += length
        return out

    def _arena_positions(self, first: int, end: int) -> np.ndarray:
        runs = self._runs(first, end)
        if not runs:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, a + n) for a, n in runs])

    def commit(self, new_tokens: Sequence[int]) -> None:
        """Record tokens whose KV was just written; register blocks they completed for sharing."""
        B = self.pool.block_size
        before = self.n_tokens
        self.tokens.extend(int(t) for t in new_tokens)
        if self.private:
            return
        for i in range(before // B, self.n_tokens // B):
            block = self.blocks[i]
            if block.key is not None:
                continue
            parent = self.blocks[i - 1].key if i else None
            if i and parent is None:
                return
            chunk = tuple(self.tokens[i * B : (i + 1) * B])
            self.blocks[i] = self.pool.register(
                block, prefix_key(self.pool.fingerprint, parent, chunk), chunk, self.namespace
            )

    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes
