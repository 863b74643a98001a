"""Resuming a session: its KV brought back into RAM, kept while it is open, and snapshotted.

The steps of a resume, in the order they run: `prefetch` reads from the remote tier what only it holds
(without the engine's lock, so a slow store holds up one reply, not every reply being decoded), `open`
takes the full blocks from RAM or the stored blocks and restores the session's tail, nothing computed;
after a reply, `snapshot` brings the KV up to the stored conversation and stores what is new; `verify`
recomputes a session resumed from an imported file. The message tree is the truth: every block is
checked, and one that is missing, corrupt or made by another model is simply recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_chat.inference
from llama_chat.inference import GenerationStats, KVSequence, Model, fit_messages, shift_to
from llama_chat.inference.generate import prompt_text
from llama_chat.storage.kv_store import KVStore, RemoteRead
from llama_chat.storage.store import ChatStore, Session

from .namespaces import computed_here


@dataclass
class ResumeInfo:
    tokens: int  # tokens of the conversation so far
    restored: int  # of those, how many came back without computing (RAM, stored blocks, tail)
    seconds: float
    remote: int = 0  # of those, how many were read from the remote tier
    remote_read: RemoteRead | None = None  # what the remote tier did (None: there is none)

    def describe(self) -> str:
        remote = f" ({self.remote:,} from the remote tier)" if self.remote else ""
        return f"{self.restored:,} of {self.tokens:,} tokens restored{remote} in {self.seconds * 1000:.0f} ms"


@dataclass
class VerifyResult:
    imported: bool  # whether the session read imported KV (else there was nothing to verify)
    matched: int = 0  # imported blocks equal to their recomputed KV, now shared
    differed: int = 0  # imported blocks that were not: replaced by the recomputed KV

    def describe(self) -> str:
        if not self.imported:
            return "nothing to verify: its KV was computed here"
        text = f"{self.matched} imported KV block(s) matched the recomputed KV and are now shared"
        if self.differed:
            text += f"; {self.differed} did not (altered or made by another program) and were replaced"
        return text


def system_message(system_prompt: str | None) -> list[dict]:
    """A system prompt as the first message of a conversation, if there is one."""
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


# The code that turns text into token ids: kept ids made by another version of it are not used.
TOKENIZER_SOURCES = ("tokenizer.py", "bpe.py", "control_text.py")


@functools.cache
def tokenizer_code() -> bytes:
    digest = hashlib.sha256()
    for name in TOKENIZER_SOURCES:
        digest.update((Path(llama_chat.inference.__file__).parent / name).read_bytes())
    return digest.digest()


def ids_digest(model: Model, messages: list[dict], budget: int, tools: list[dict] | None) -> bytes:
    """What the token ids of a stored conversation are made from, digested: the text the template
    renders of it (its messages and tools, and anything else the template writes, such as today's date),
    the window they must fit, the model (its fingerprint: weights and vocabulary size) and its tokenizer
    (its settings and our code). Ids kept under another digest are never used."""
    h = hashlib.sha256(tokenizer_code())
    meta = model.metadata
    settings = {k: len(v) if isinstance(v, list) else v for k, v in meta.items() if k.startswith("tokenizer.")}
    h.update(repr([model.fingerprint, budget, sorted(settings.items())]).encode())
    h.update(prompt_text(model, messages, add_generation_prompt=False, tools=tools).encode())
    return h.digest()


class LiveSessions:
    """The sessions open in this process, each with its KV sequence in the model's block pool. Whoever
    changes one holds `lock` (the scheduler's: the pool is not thread-safe)."""

    def __init__(self, model: Model, store: ChatStore, kv: KVStore, lock: threading.RLock, n_ctx: int):
        self.model, self.store, self.kv, self.lock, self.n_ctx = model, store, kv, lock, n_ctx
        self._seqs: dict[str, KVSequence] = {}
        self.tools: list[dict] | None = None  # function definitions every session's prompt offers (MCP tools)

    # -- which are open ----------------------------------------------------------------------------

    def __getitem__(self, session_id: str) -> KVSequence:
        return self._seqs[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._seqs))

    def get(self, session_id: str) -> KVSequence | None:
        return self._seqs.get(session_id)

    def keep(self, session_id: str, seq: KVSequence) -> None:
        """With the lock held: `seq` is the session's KV from now on (one it had before is freed)."""
        old = self._seqs.get(session_id)
        if old is not None and old is not seq:
            old.free()
        self._seqs[session_id] = seq

    def move(self, old_id: str, new_id: str, seq: KVSequence) -> None:
        """With the lock held: the KV open as `old_id` is `new_id`'s now (a reply went on a new branch)."""
        self._seqs[new_id] = self._seqs.pop(old_id, seq)

    def close(self, session_id: str) -> None:
        """With the lock held: the session's KV goes back to the pool (its full blocks stay cached)."""
        seq = self._seqs.pop(session_id, None)
        if seq is not None:
            seq.free()

    def close_all(self, but: str | None = None) -> None:
        """With the lock held: every session closed, but `but`."""
        for session_id in self:
            if session_id != but:
                self.close(session_id)

    # -- a session's tokens ------------------------------------------------------------------------

    def messages(self, session: Session) -> list[dict]:
        """The conversation as the chat template wants it: system prompt, then the path to the head."""
        return system_message(session.system_prompt) + [
            {"role": m.role, "content": m.content} for m in self.store.path(session.head_id)
        ]

    def conversation_ids(self, session: Session) -> list[int]:
        """The tokens of the stored conversation (its newest turns, when it outgrew the window).

        As much as the window holds: the next prompt never needs more of it, and when it needs less
        (room for a long reply), the prompt cuts the restored KV down by context shift."""
        return self.conversation(session)[1]

    def conversation(self, session: Session) -> tuple[bytes, list[int], bool]:
        """conversation_ids with the digest of what they are made from (ids_digest), and whether they
        are the ones the session kept under that digest (tokenizing 2,000 tokens again took ~20 ms of a
        resume's ~70); else they are made now."""
        messages = self.messages(session)
        if not messages:  # a new session: nothing to tokenize, nor to keep (a template may not render none)
            return b"", [], True
        digest = ids_digest(self.model, messages, self.window, self.tools)
        ids = self.store.kv.kept_ids(session.id, digest)
        if ids is not None:
            return digest, ids, True
        return digest, self.window_ids(messages), False

    @property
    def window(self) -> int:
        """The tokens a stored conversation may take: the context less one, for the next reply."""
        return self.n_ctx - 1

    def window_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The tokens of a conversation as it is stored: its newest turns that fit the window, with the
        tools it offers (else those every session offers)."""
        tools = self.tools if tools is None else tools
        return fit_messages(self.model, messages, self.window, add_generation_prompt=False, tools=tools)[1]

    # -- bringing KV back --------------------------------------------------------------------------

    def prefetch(self, session: Session) -> RemoteRead | None:
        """The blocks and tail of a session's conversation that only the remote tier holds, read into RAM
        (read_remote) without the lock: on the thread that submits a reply. None: no tier."""
        if self.kv.remote is None:
            return None
        live = self.get(session.id)
        if not computed_here(session) or (live is not None and live.private):
            return RemoteRead()  # an import's KV, or KV that is no prefix's: never read from the tier
        ids = self.conversation_ids(session)
        held = live is not None and live.common_prefix(ids) == len(ids)  # (without the lock: a hint)
        tail_of = None if held else ids
        return self.read_remote(ids, tail_of, session_id=session.id, namespace=session.kv_namespace)

    def read_remote(
        self,
        ids: Sequence[int],
        tail_of: Sequence[int] | None = None,
        session_id: str | None = None,
        namespace: bytes | None = None,
    ) -> RemoteRead | None:
        """The full blocks of `ids` (of the namespace) that RAM lacks, read from the remote tier
        where it holds them and that beats computing them (KVStore.read_remote), for a sequence to take
        with reuse_prefix; None when there is no tier. The tail after the full blocks of `tail_of` (a
        prefix of ids: else no stored tail matches), which restore_tail asks for next, rides in the same
        round trip, unless the session (`session_id`) has one here. Every prompt goes through here — a
        session's turn (prefetch) and a conversation sent whole — before its job is queued: restore_tail
        reads nothing from the network."""
        if self.kv.remote is None:
            return None
        pool, B = self.model.pool, self.model.pool.block_size
        missing = pool.missing(ids, namespace)  # (read without the lock: only what to fetch depends on it)
        tail = None
        if tail_of is not None and len(tail_of) % B and len(tail_of) // B <= len(ids) // B:
            keys = pool.block_keys(tail_of)
            tail = (keys[-1] if keys else None, tuple(tail_of[len(keys) * B :]))
        return self.kv.read_remote(missing, tail, session_id, namespace)

    def note_prefill(self, stats: GenerationStats) -> None:
        """A reply's prefill speed, what the remote tier's reads must beat (see read_remote)."""
        if stats.prefilled_tokens >= self.model.pool.block_size:  # shorter ones are mostly overhead
            self.kv.prefill_tok_s.add(stats.prefill_tok_s)

    def open(self, session: Session, read: RemoteRead | None = None) -> tuple[KVSequence, ResumeInfo]:
        """The session's KV, ready for its next reply: from RAM, stored blocks and tail; nothing computed.
        `read`: what prefetch() read for it already (else it is read now)."""
        t0 = time.perf_counter()
        earlier = read.seconds if read is not None else 0.0
        if read is None:
            read = self.prefetch(session)
        with self.lock:
            ids = self.conversation_ids(session)
            seq = self.get(session.id)
            if seq is None or seq.namespace != session.kv_namespace:  # (verify moves it to the shared one)
                seq = self.model.new_sequence(self.n_ctx, namespace=session.kv_namespace)
                self.keep(session.id, seq)
            if seq.private:
                shift_to(self.model, seq, ids)
            seq.reuse_prefix(ids)  # keeps what RAM holds, then takes blocks from RAM or the store
            from_remote = min(read.tokens if read else 0, seq.n_tokens) + self.restore_tail(session, seq, ids)
            seconds = time.perf_counter() - t0 + earlier
            return seq, ResumeInfo(len(ids), seq.n_tokens, seconds, from_remote, read)

    def restore_tail(self, session: Session | None, seq: KVSequence, ids: list[int]) -> int:
        """After seq took the full blocks of `ids`: the session's stored tail, as far as it matches ids,
        else a tail another server stored for ids to their end (read_remote read it). Returns the tokens
        that came from the remote tier."""
        if seq.n_tokens % self.model.pool.block_size or seq.n_tokens >= len(ids):
            return 0
        parent = seq.last_key
        found = self.kv.tail(session.id, parent, ids[seq.n_tokens :]) if session is not None else None
        remote = found is None and not seq.private  # (only read_remote's tails: never an import's)
        if remote:
            found = self.kv.remote_tail(parent, ids[seq.n_tokens :], seq.namespace)
        if found is None:
            return 0
        tokens, (k, v) = found
        seq.append_kv(tokens, k, v)
        return len(tokens) if remote else 0

    # -- keeping it --------------------------------------------------------------------------------

    def snapshot(self, session: Session, seq: KVSequence, complete: bool = True) -> None:
        """Bring the KV up to the end of the stored conversation (unless not `complete`: then what it holds
        of it), then store what is new, in one transaction."""
        with self.lock:
            digest, ids, kept = self.conversation(session)
            held = self.hold_kv(seq, ids, complete)
        self.store_kv(session.id, held, computed_here(session))
        if not kept:
            self.store.kv.keep_ids(session.id, digest, ids)  # for the next resume

    def hold_kv(self, seq: KVSequence, ids: list[int], complete: bool = True) -> KVSequence:
        """With the lock held: bring seq's KV up to `ids`, a stored conversation's tokens (unless not
        `complete`: then what it holds of them), and return a fork of it that keeps its blocks for
        store_kv. That one may run on another thread while the scheduler goes on: full blocks never
        change, and the fork's last one is copied by whoever writes to it next."""
        if seq.private:
            shift_to(self.model, seq, ids)
        held = seq.reuse_prefix(ids)
        if complete and held < len(ids) <= seq.n_ctx:
            self.model.forward(ids[held:], seq)  # e.g. the end-of-turn marker after the reply
        return seq.fork()

    def store_kv(self, session_id: str, held: KVSequence, travels: bool) -> None:
        """Store what hold_kv kept as the session's KV (encoding only blocks not stored yet), then free it;
        where it `travels` (computed_here), the remote tier gets its new blocks too."""
        try:
            full, tail = held.snapshot()
            self.kv.save(
                session_id,
                [(b.key, b.tokens) for b in full],
                lambda i: self.model.pool.block_kv(full[i]),
                tail,
                held.n_tokens,
                held.namespace,
                travels,
            )
        finally:
            with self.lock:
                held.free()

    def verify(self, session: Session) -> VerifyResult:
        """Recompute the KV of a session resumed from imported blocks and compare each block with it.
        Blocks that match (same tokens, same KV up to their codec's rounding) join the shared blocks as
        they are; the others are never read again: the recomputed KV takes their place. The session
        (not its forks, which verify on their own) then reads only blocks computed or verified here."""
        with self.lock:
            namespace = session.kv_namespace
            if namespace is None:
                return VerifyResult(imported=False)
            ids = self.conversation_ids(session)
            # private: all of it computed now, no block taken from RAM or the store
            fresh = self.model.new_sequence(self.n_ctx, private=True)
            self.model.forward(ids, fresh)
            B = self.model.pool.block_size
            matched, differed = [], 0
            for i, key in enumerate(self.model.pool.block_keys(ids)):
                tokens, block = ids[i * B : (i + 1) * B], fresh.blocks[i]
                stored = self.kv.load(key, namespace)
                if stored is None:
                    continue  # nothing imported to compare: it is computed here anyway
                if self.kv.matches(stored, tokens, self.model.pool.block_kv(block)):
                    matched.append(stored)
                else:
                    differed += 1
            fresh.free()
            self.store.kv.promote_session(session.id, self.model.fingerprint, matched)
            session = self.store.get_session(session.id)
            seq, _ = self.open(session)  # now in the shared namespace, with the blocks that matched
            self.snapshot(session, seq)  # and the others computed again, and the tail
            return VerifyResult(True, len(matched), differed)
