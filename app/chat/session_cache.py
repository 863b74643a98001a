"""The session cache: the one owner of a conversation's KV, in RAM, in SQLite and in Redis.

RAM is the model's block pool (inference/kv_cache.py), SQLite the store's KV tables (storage/kv_tables.py),
Redis the remote tier (storage/remote.py); only SessionCache moves KV between them. `prefetch` reads what
only Redis holds, on the thread that asks for a reply and without the lock, so a slow store holds up one
reply, not every reply being decoded; `open` brings a session's KV into RAM from the pool, the stored
blocks (the pool asks `fetch`, this class being its block source) and the session's tail, nothing
computed; `snapshot` completes it to the stored conversation and stores what is new; `verify` recomputes
a session imported from a file; `close` gives it back to the pool. The keys and digests the tiers name KV
by are made below, one function each — but a full block's prefix key, which the pool makes: inference
names its own blocks and imports nothing above it. The message tree is the truth: every block is checked,
and one missing, corrupt or made by another model is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence

import numpy as np

from llama_chat.inference import GenerationStats, KVSequence, Model, fit_messages, shift_to
from llama_chat.inference.kv_cache import KVBlock
from llama_chat.inference.prompt import Rendered, prompt_ids, render
from llama_chat.inference.thinking import thinking_format
from llama_chat.storage.codec import checksum, decoded, encode_kv, kv_matches
from llama_chat.storage.fetched import MAX_FETCHED_BYTES, Fetched
from llama_chat.storage.records import StoredBlock, StoredTail
from llama_chat.storage.remote import MovingAverage, RemoteTier
from llama_chat.storage.store import ChatStore, Session

from .replies import system_message, template_message
from .resume import RemoteRead, ResumeInfo, VerifyResult
from .settings import template_variables

KV = tuple[np.ndarray, np.ndarray]  # k, v [n_layer, n_kv_head, n_tokens, head_dim]


# -- the keys and digests KV is named by --------------------------------------------------------------


def ids_digest(model: Model, rendered: Rendered, budget: int) -> bytes:
    """What the token ids of a stored conversation are made from, digested: the text the template
    renders of it (its messages, tools and variables, and anything else it writes, such as today's date),
    with what in it is text from outside (the shield's placeholders), the window they must fit, the model
    (its fingerprint: weights and vocabulary size) and its tokenizer (its settings and the version of its
    encoding). Ids kept under another digest are never used."""
    meta = {k: v for k, v in model.metadata.items() if k.startswith("tokenizer.")}
    settings = sorted((k, len(v) if isinstance(v, list) else v) for k, v in meta.items())
    placeholders = sorted(rendered.shield.placeholders.items())
    made_by = [model.tokenizer.encoding_version, model.fingerprint, budget, settings, placeholders]
    h = hashlib.sha256(repr(made_by).encode())
    h.update(rendered.text.encode())
    return h.digest()


def ids_seal(digest: bytes, ids: Sequence[int]) -> bytes:
    """What kept token ids are stored under: the digest of what they were made from and of themselves,
    so that ids damaged on disk (a model reading other tokens than the conversation's) are never used."""
    return hashlib.sha256(digest + np.asarray(ids, dtype="<i4").tobytes()).digest()


def tail_key(parent_key: bytes | None, tokens: Sequence[int]) -> bytes:
    """A tail's name in the remote tier: like a block's prefix key it stands for every token before it
    (parent_key) and its own, so another server that holds the same conversation finds it."""
    return hashlib.sha256(b"tail" + (parent_key or b"") + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def kv_salt(tenant: str | None, cache_key: str | None = None) -> bytes | None:
    """The KV namespace of a tenant's requests (vLLM's cache_salt), narrowed by a prompt_cache_key: no
    block, in RAM, stored or in the remote tier, is shared across two, so no cached_tokens tell of
    another's prompts. None, without either: the blocks every session shares."""
    if tenant is None and cache_key is None:
        return None
    return hashlib.sha256(json.dumps(["llama-chat kv salt", tenant, cache_key]).encode()).digest()[:16]


def computed_here(session: Session) -> bool:
    """Whether a session's KV is the shared namespace's or its tenant's own: computed by a model, so the
    remote tier may carry it (in that namespace). An import's namespace is its own until verified, and
    its KV never leaves this server."""
    return session.kv_namespace in (None, kv_salt(session.tenant))


def _fits(tail: StoredTail | StoredBlock | None, want: Sequence[int]) -> int:
    """How many of the tokens `want` a stored tail (read for the block before them) holds."""
    n = 0
    while tail is not None and n < min(len(want), len(tail.tokens)) and want[n] == tail.tokens[n]:
        n += 1
    return n


class SessionCache:
    """The KV of the sessions open in this process, each a sequence of the model's block pool, and of
    every conversation's blocks and tails kept in SQLite and the remote tier. Whoever changes a sequence
    holds `lock` (the scheduler's: the pool is not thread-safe); the verbs that need it take it."""

    def __init__(
        self,
        model: Model,
        store: ChatStore,
        lock: threading.RLock,
        n_ctx: int,
        codec: str,
        remote: RemoteTier | None = None,
        plan=None,
        max_fetched_bytes: int = MAX_FETCHED_BYTES,
    ):
        self.model, self.lock, self.n_ctx = model, lock, n_ctx
        self._store, self._tables = store, store.kv
        self._codec, self._plan = codec, plan  # new blocks' codec (any stored one reads); auto's plan
        self.remote = remote  # the tier under SQLite shared with other servers (--kv-remote), if any
        self.fetched = Fetched(max_fetched_bytes)  # what `remote` sent, waiting in RAM for a snapshot
        self._prefill = MovingAverage()  # the model's prefill tok/s, measured: what `remote` must beat
        self._seqs: dict[str, KVSequence] = {}
        self.tools: list[dict] | None = None  # function definitions every session's prompt offers (MCP tools)
        self.thinking = thinking_format(model.chat_template if model.has_chat_template else None)
        model.pool.attach_source(self)  # one source per pool: a second cache on this model is refused

    # -- the sessions open in RAM ------------------------------------------------------------------

    def seq(self, session_id: str) -> KVSequence | None:
        """The session's KV, where it is open."""
        return self._seqs.get(session_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        """With the lock held: the child (at the parent's head) shares every block of the parent's KV."""
        seq = self._seqs.get(parent_id)
        if seq is not None:
            self.keep(child_id, seq.fork())

    def close(self, session_id: str) -> None:
        """With the lock held: the session's KV goes back to the pool (its full blocks stay cached)."""
        seq = self._seqs.pop(session_id, None)
        if seq is not None:
            seq.free()

    def close_all(self, but: str | None = None) -> None:
        """With the lock held: every session closed, but `but`."""
        for session_id in [s for s in self._seqs if s != but]:
            self.close(session_id)

    def keep(self, session_id: str, seq: KVSequence) -> None:
        """With the lock held: `seq` is the session's KV from now on, and no other's (one it had before
        is freed)."""
        for other in [s for s, held in self._seqs.items() if held is seq and s != session_id]:
            del self._seqs[other]  # a reply that went on a new branch: its KV is the branch's now
        old = self._seqs.get(session_id)
        if old is not None and old is not seq:
            old.free()
        self._seqs[session_id] = seq

    # -- a conversation's tokens -------------------------------------------------------------------

    def messages(self, session: Session) -> list[dict]:
        """The stored conversation as the chat template wants it: system prompt, then the path to the head."""
        path = self._store.path(session.head_id)
        return system_message(session.system_prompt) + [template_message(m, self.thinking) for m in path]

    def stored_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        variables: dict | None = None,
        whole: list[int] | None = None,
    ) -> list[int]:
        """The tokens of a conversation as it is stored: its newest turns that fit the window (the context
        less one, for the next reply), with the tools it offers (else those every session offers),
        rendered with the template's `variables`; `whole`: the tokens of all of it, where they are made."""
        tools = self.tools if tools is None else tools
        budget = self.n_ctx - 1
        return fit_messages(self.model, messages, budget, False, tools, variables, whole)[1]

    def stored_conversation(
        self, session: Session, messages: list[dict] | None = None
    ) -> tuple[bytes, list[int], bool]:
        """The stored conversation's tokens (`messages`, else read) with the digest of what they are
        made from, and whether they are the ones the session kept under it (tokenizing 2,000 tokens
        again takes ~20 ms of a resume's ~70); else they are made now, from the same rendering."""
        messages = self.messages(session) if messages is None else messages
        if not messages:  # a new session: nothing to tokenize, nor to keep (a template may not render none)
            return b"", [], True
        variables = template_variables(session.sampling)
        rendered = render(self.model, messages, False, self.tools, variables)
        digest = ids_digest(self.model, rendered, self.n_ctx - 1)
        kept = self._tables.kept_ids(session.id)
        if kept is not None and kept[0] == ids_seal(digest, kept[1]):
            return digest, kept[1], True
        whole = prompt_ids(self.model, rendered)
        return digest, self.stored_ids(messages, variables=variables, whole=whole), False

    # -- bringing KV back --------------------------------------------------------------------------

    def prefetch(self, session: Session, messages: list[dict] | None = None) -> RemoteRead | None:
        """The blocks and tail of a session's conversation (`messages`, else read) that only the remote
        tier holds, read into RAM without the lock: on the thread that submits a reply. None: no tier."""
        if self.remote is None:
            return None
        live = self._seqs.get(session.id)
        if not computed_here(session) or (live is not None and live.private):
            return RemoteRead()  # an import's KV, or KV that is no prefix's: never read from the tier
        ids = self.stored_conversation(session, messages)[1]
        held = live is not None and live.common_prefix(ids) == len(ids)  # (without the lock: a hint)
        tail_of = None if held else ids
        return self.read_remote(ids, tail_of, session_id=session.id, namespace=session.kv_namespace)

    def open(
        self,
        session: Session,
        read: RemoteRead | None = None,
        prompt: list[int] | None = None,
        cut: bool = False,
    ) -> tuple[KVSequence, ResumeInfo]:
        """The session's KV, ready for its next reply: from RAM, stored blocks and tail; nothing computed.
        `read`: what prefetch() read for it already (else it is read now). `prompt`: the next reply's,
        whose tokens begin with the stored conversation's — unless it `cut` its oldest turns: then the
        stored conversation comes back and the KV follows the prompt by context shift."""
        t0 = time.perf_counter()
        earlier = read.seconds if read is not None else 0.0
        if read is None:
            read = self.prefetch(session)
        with self.lock:
            ids = prompt[:-1] if prompt is not None and not cut else self.stored_conversation(session)[1]
            seq = self._seqs.get(session.id)
            if seq is None or seq.namespace != session.kv_namespace:  # (verify moves it to the shared one)
                seq = self.model.new_sequence(self.n_ctx, namespace=session.kv_namespace)
                self.keep(session.id, seq)
            if seq.private:
                shift_to(self.model, seq, ids)
            seq.reuse_prefix(ids)  # keeps what RAM holds, then takes blocks from RAM or the store
            from_remote = min(read.tokens if read else 0, seq.n_tokens)
            from_remote += self._restore_tail(session, seq, ids, read)
            if cut:
                shift_to(self.model, seq, prompt)
            seconds = time.perf_counter() - t0 + earlier
            return seq, ResumeInfo(len(ids), seq.n_tokens, seconds, from_remote, read)

    def open_fresh(
        self,
        namespace: bytes | None,
        previous: list[int] | None,
        kept: Session | None,
        read: RemoteRead | None,
    ) -> KVSequence:
        """With the lock held: a fresh sequence for a conversation sent whole, in `namespace`; a
        returning one (`previous`: its tokens as kept after its last reply) takes what it held then,
        and the tail its `kept` session stored (or the one `read` read)."""
        seq = self.model.new_sequence(self.n_ctx, namespace=namespace)
        if previous is not None:
            seq.reuse_prefix(previous)
            self._restore_tail(kept, seq, previous, read)
        return seq

    def read_remote(
        self,
        ids: Sequence[int],
        tail_of: Sequence[int] | None = None,
        session_id: str | None = None,
        namespace: bytes | None = None,
    ) -> RemoteRead | None:
        """The full blocks of `ids` (of the namespace) that RAM and SQLite lack, read from the
        remote tier in one round trip, when its measured round trips and bytes per second beat computing
        them at the measured prefill speed, and kept in RAM as read (the pool then takes them as any
        stored block) until a snapshot stores them in SQLite. The tail after the full blocks of `tail_of`
        (a prefix of ids: else no stored tail matches), which _restore_tail asks for next, rides in the
        same round trip, unless the session (`session_id`) has one here. None when there is no tier.
        Every prompt comes through here before its job is queued: _restore_tail reads nothing from the
        network."""
        if self.remote is None:
            return None
        t0 = time.perf_counter()
        pool, B = self.model.pool, self.model.pool.block_size
        missing = pool.missing(ids, namespace)
        missing = [(key, tokens) for key, tokens in missing if self.fetched.block(key, namespace) is None]
        stored = self._tables.stored_keys([key for key, _ in missing], namespace)
        missing = [(key, tokens) for key, tokens in missing if key not in stored]
        tail, wanted = None, None
        if tail_of is not None and len(tail_of) % B and len(tail_of) // B <= len(ids) // B:
            keys = pool.block_keys(tail_of)
            wanted = (keys[-1] if keys else None, tuple(tail_of[len(keys) * B :]))
            key = tail_key(*wanted)
            here = session_id is not None and self._stored_tail(session_id, *wanted) is not None
            tail = None if here or self.fetched.has_tail(key, namespace) else (key, wanted[1])
        prefill_tok_s = self._prefill.value or 0.0
        choice, tokens = self.fetched.read(self.remote, missing, tail, self._codec, prefill_tok_s, namespace)
        return RemoteRead(choice, tokens, time.perf_counter() - t0, wanted if choice != "compute" else None)

    def fetch(self, key: bytes, tokens: Sequence[int], namespace: bytes | None, out: KV) -> bool:
        """The pool's block source: a stored block of the namespace (or one the remote tier sent) decoded
        into `out` (the pool's arena), checked whole as it is decoded, against the tokens it stands for
        and out's shape; a bad one is dropped so it gets recomputed."""
        fetched = self.fetched.block(key, namespace)
        block = fetched or self._tables.load_block(key, self.model.fingerprint, namespace)
        if block is None:
            return False
        # No CRC of the bytes here: decoding checks them whole (a block is its header and one zstd frame
        # that repeats the header and carries its content's checksum), and the CRC costs ~3 ms of a
        # 2,000-token resume. (A remote block had its signature checked as it was read.)
        kv = decoded(block.data, out=out) if block.tokens == list(tokens) else None
        if kv is None:
            self.fetched.forget([key], namespace)
            self._tables.drop_block(key, namespace)
        return kv is not None

    def _stored_tail(self, session_id: str, parent: bytes | None, want: Sequence[int]) -> StoredTail | None:
        """The session's tail stored here, where it follows the block `parent` and starts as `want` does."""
        tail = self._tables.load_tail(session_id, self.model.fingerprint)
        return tail if tail is not None and tail.parent_key == parent and _fits(tail, want) else None

    def _restore_tail(
        self, session: Session | None, seq: KVSequence, ids: list[int], read: RemoteRead | None = None
    ) -> int:
        """With the lock held, after seq took the full blocks of `ids`: the session's stored tail, as far
        as it matches ids, else the tail another server stored that `read` (read_remote) read, where ids
        go on as it does. Returns the tokens that came from the remote tier."""
        if seq.n_tokens % self.model.pool.block_size or seq.n_tokens >= len(ids):
            return 0
        want = ids[seq.n_tokens :]
        found = None
        if session is not None and (tail := self._stored_tail(session.id, seq.last_key, want)) is not None:
            found = self._decoded_tail(tail, tail.checksum, _fits(tail, want))
        remote = found is None and not seq.private  # (an import's KV is never read: prefetch)
        if remote and read is not None and read.tail is not None and read.tail[0] == seq.last_key:
            tail = self.fetched.take_tail(tail_key(*read.tail), seq.namespace)  # (its signature was checked)
            whole = tail is not None and tail.tokens == list(read.tail[1]) == list(want[: len(tail.tokens)])
            if whole:
                found = self._decoded_tail(tail, None, len(tail.tokens))
        if found is None:
            return 0
        seq.append_kv(*found)
        return len(found[0]) if remote else 0

    @staticmethod
    def _decoded_tail(tail: StoredTail | StoredBlock, expected_checksum: str | None, n: int):
        """The first n tokens of a tail and their KV; None when it fails a check."""
        kv = decoded(tail.data, expected_checksum)
        if kv is None or kv[0].shape[2] != len(tail.tokens):
            return None
        return tail.tokens[:n], kv[0][:, :, :n], kv[1][:, :, :n]

    def note_prefill(self, stats: GenerationStats) -> None:
        """A reply's prefill speed, what the remote tier's reads must beat (see read_remote)."""
        if stats.prefilled_tokens >= self.model.pool.block_size:  # shorter ones are mostly overhead
            self._prefill.add(stats.prefill_tok_s)

    # -- keeping it --------------------------------------------------------------------------------

    def snapshot(
        self, session: Session, seq: KVSequence, messages: list[dict] | None = None, complete: bool = True
    ) -> None:
        """`seq` becomes the session's KV, brought up to the end of its stored conversation (`messages`,
        else read; unless not `complete`: then what it holds of it); what is new is stored in one
        transaction, and the conversation's tokens kept for the next resume."""
        with self.lock:
            self.keep(session.id, seq)
            digest, ids, kept = self.stored_conversation(session, messages)
            held = self.hold(seq, ids, complete)
        self.store(session.id, held, computed_here(session))
        if not kept:
            self._tables.keep_ids(session.id, ids_seal(digest, ids), ids)

    def hold(self, seq: KVSequence, ids: list[int], complete: bool = True) -> KVSequence:
        """With the lock held: bring seq's KV up to `ids`, a stored conversation's tokens (unless not
        `complete`: then what it holds of them), and return a fork of it that keeps its blocks for
        store(). That one may run on another thread while the scheduler goes on: full blocks never
        change, and the fork's last one is copied by whoever writes to it next."""
        if seq.private:
            shift_to(self.model, seq, ids)
        held = seq.reuse_prefix(ids)
        if complete and held < len(ids) <= seq.n_ctx:
            self.model.forward(ids[held:], seq)  # e.g. the end-of-turn marker after the reply
        return seq.fork()

    def store(self, session_id: str, held: KVSequence, travels: bool) -> list[StoredBlock]:
        """Store what hold() kept as the session's KV, in one transaction — its full blocks (encoding
        only those not stored yet) and its tail — and, where it `travels` (computed_here), queue what is
        new for the remote tier in its namespace; then free it. Returns the blocks new to SQLite."""
        namespace = held.namespace
        try:
            full, tail = held.snapshot()
            keys = [b.key for b in full]
            stored = self._tables.stored_keys(keys, namespace)
            new_blocks = [self._stored_block(b, namespace) for b in full if b.key not in stored]
            stored_tail = None
            if tail is not None:
                data = encode_kv(tail[1], tail[2], self._codec, self._plan)
                parent = keys[-1] if keys else None
                stored_tail = StoredTail(parent, tail[0], self._codec, data, checksum(data))
            self._tables.save_snapshot(session_id, self.model.fingerprint, keys, new_blocks, stored_tail,
                                       held.n_tokens, namespace)  # fmt: skip
        finally:
            with self.lock:
                held.free()
        if travels and self.remote is not None:  # in the background: a full queue drops, nothing waits
            for block in new_blocks:
                if self.fetched.block(block.key, namespace) is not block:  # (the tier sent those)
                    self.remote.put(block, namespace)
            if stored_tail is not None:
                t = stored_tail
                self.remote.put(StoredBlock(tail_key(t.parent_key, t.tokens), len(t.tokens), t.codec, t.data,
                                             t.checksum, t.tokens), namespace)  # fmt: skip
        self.fetched.forget(keys, namespace)  # stored now
        return new_blocks

    def _stored_block(self, block: KVBlock, namespace: bytes | None) -> StoredBlock:
        """A full block as it is stored: as another server wrote it, where the remote tier sent it, else
        encoded now."""
        fetched = self.fetched.block(block.key, namespace)
        if fetched is not None and fetched.tokens == list(block.tokens):
            return fetched
        data = encode_kv(*self.model.pool.block_kv(block), self._codec, self._plan)
        tokens = list(block.tokens)
        return StoredBlock(block.key, len(tokens), self._codec, data, checksum(data), tokens)

    def verify(self, session: Session) -> VerifyResult:
        """Recompute the KV of a session resumed from imported blocks and compare each block with it.
        Blocks that match (same tokens, same KV up to their codec's rounding) join the shared blocks as
        they are; the others are never read again: the recomputed KV takes their place. The session
        (not its forks, which verify on their own) then reads only blocks computed or verified here."""
        with self.lock:
            namespace = session.kv_namespace
            if namespace is None:
                return VerifyResult(imported=False)
            ids = self.stored_conversation(session)[1]
            # private: all of it computed now, no block taken from RAM or the store
            fresh = self.model.new_sequence(self.n_ctx, private=True)
            self.model.forward(ids, fresh)
            B, fingerprint = self.model.pool.block_size, self.model.fingerprint
            matched, differed = [], 0
            for i, key in enumerate(self.model.pool.block_keys(ids)):
                tokens, block = ids[i * B : (i + 1) * B], fresh.blocks[i]
                stored = self._tables.load_block(key, fingerprint, namespace)
                if stored is None:
                    continue  # nothing imported to compare: it is computed here anyway
                intact = stored.tokens == list(tokens) and decoded(stored.data, stored.checksum) is not None
                if intact and kv_matches(stored.data, *self.model.pool.block_kv(block)):
                    matched.append(stored)
                else:
                    differed += 1
            fresh.free()
            self._tables.promote_session(session.id, fingerprint, matched)
            session = self._store.get_session(session.id)
            seq, _ = self.open(session)  # now in the shared namespace, with the blocks that matched
            self.snapshot(session, seq)  # and the others computed again, and the tail
            return VerifyResult(True, len(matched), differed)
