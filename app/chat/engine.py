"""The chat engine: stored conversations driven through the model, with KV resumed from RAM or SQLite.

No maths, no SQL and no bytes of KV here: it renders a session's messages (inference), finds the
longest prefix whose KV is already held — in the RAM block pool, then among the stored blocks
(storage.kv_store), then the session's stored tail — and submits the reply as a job to the scheduler,
which prefills only the rest and streams it; when it ends, the engine stores the turn and snapshots the
new KV. The message tree is the truth: every block is checked, and one that is missing, corrupt or made
by another model is simply recomputed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from llama_chat.inference import (
    GenerationStats,
    KVSequence,
    Model,
    SamplingParams,
    chat_prompt_ids,
    fit_messages,
    load_model,
    shift_to,
)
from llama_chat.inference.errors import ContextFullError
from llama_chat.inference.kv_cache import prefix_key
from llama_chat.storage.codec import AUTO
from llama_chat.storage.codec import compile_kernels as compile_codec
from llama_chat.storage.db import StoreError
from llama_chat.storage.fragments import brief
from llama_chat.storage.kv_plan import model_plan
from llama_chat.storage.kv_store import KVStore, RemoteRead
from llama_chat.storage.remote import RemoteTier
from llama_chat.storage.store import ChatStore, Message, Session, marked_title

from .compile_progress import CompileProgress
from .jobs import Event, Job, stream_text
from .scheduler import Scheduler
from .settings import CODEC, MAX_TOKENS, N_CTX, model_sampling, sampling_params


class ReplyNotStored(StoreError):
    """A reply was made but could not be stored (the disk is full, …): whoever made it still has it."""

    def __init__(self, e: StoreError):
        super().__init__(f"the reply was not stored: {e}", e.brief, e.full)


@dataclass
class SavedReply:
    """Where a reply was stored, filled in by ChatEngine.reply() as GenerationStats is."""

    session: Session | None = None  # the session ending with the reply; None: not stored (an error says why)
    branched: bool = False  # the session had moved on meanwhile: the reply went on a new branch of it
    kv_skipped: str | None = None  # why the KV snapshot was not stored (it is recomputed when needed)


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


def load_chat_model(name: str | None, progress: Callable[[str, int, int], None] | None = None, **options) -> Model:
    """load_model (name, progress and its options), then the KV codec's compiled loops made ready under
    the same progress (compiled at a first start, else loaded): no reply's resume or snapshot waits on
    the compiler. Under the auto codec, the model's KV plan too (measured at its first use)."""
    if progress is None:
        model = load_model(name, **options)
        compile_codec()
    else:
        with CompileProgress(progress) as told:  # what really compiles, as it does
            model = load_model(name, progress=told, **options)
            compile_codec(told)
    if CODEC == AUTO:
        model_plan(model, progress)
    return model


NEW_CHAT = "New chat"  # the title of a chat until its first message names it
TITLE_CHARS = 48  # a title made from a message is cut to this


def session_title(text: str) -> str:
    """A title as it is stored: one line, single spaces, none at either end."""
    return " ".join(text.split())


def title_from_text(text: str, limit: int = TITLE_CHARS) -> str:
    """A chat's title from a message: one line, cut after its last whole word that fits, with "…"."""
    title = session_title(brief(text))  # an attached file by its name
    if len(title) <= limit:
        return title or NEW_CHAT
    cut = title[: limit - 1]
    if title[limit - 1] != " " and " " in cut:  # else it ends on a whole word, or is one long word
        cut = cut.rsplit(" ", 1)[0]
    words = cut
    return words.rstrip(" ,.;:-") + "…"


def named_by(session: Session, user_text: str | None) -> str | None:
    """The title a session takes from a message of its own: a new chat's first message, and a fork's
    (or an edit's) first own message, while its title only says what it was forked from."""
    if user_text is None or not user_text.strip():
        return None
    placeholder = session.title == NEW_CHAT or session.title.endswith((" (fork)", " (edited)"))
    return title_from_text(user_text) if placeholder else None


def fork_before(store: ChatStore, session: Session, message: Message, title: str | None = None) -> Session:
    """A new session on `session`'s tree that ends just before `message` (empty, before the first)."""
    branch = store.fork_session(session.id, message.id, title)
    store.set_head(branch.id, message.parent_id)
    return store.get_session(branch.id)


def reply_stats(stats: GenerationStats) -> dict:
    """What is stored with a reply about how it was made."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "prefill_tok_s": round(stats.prefill_tok_s, 2),
        "generated_tokens": stats.generated_tokens,
        "decode_tok_s": round(stats.decode_tok_s, 2),
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "stop_reason": stats.stop_reason,
    }


def system_message(system_prompt: str | None) -> list[dict]:
    """A system prompt as the first message of a conversation, if there is one."""
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def check_fits(prompt: list[int], n_ctx: int) -> None:
    """Refuse a prompt that leaves no room for a reply, before anything is stored or computed."""
    if len(prompt) >= n_ctx:
        raise ContextFullError(
            f"the prompt is {len(prompt):,} tokens; the context window holds {n_ctx:,} (--ctx)"
        )


class ChatEngine:
    def __init__(
        self,
        model: Model,
        store: ChatStore,
        codec: str = CODEC,
        n_ctx: int = N_CTX,
        scheduler: Scheduler | None = None,
        remote: RemoteTier | None = None,
    ):
        self.model = model
        self.store = store
        plan = model_plan(model) if codec == AUTO else None
        self.kv = KVStore(store, model.fingerprint, codec, remote, plan)
        self.n_ctx = min(n_ctx, model.config.n_ctx_train)
        self.live: dict[str, KVSequence] = {}  # sessions opened in this process
        self.sampling_defaults = model_sampling(model)  # where a session sets nothing
        self.tools: list[dict] | None = None  # function definitions every prompt offers (`chat`'s MCP tools)
        self.scheduler = scheduler or Scheduler(model)
        self.lock = self.scheduler.lock  # the pool is not thread-safe: KV is touched between steps only
        model.pool.attach_source(self.kv)  # one source per pool: a second store on this model is refused
        store.add_model(model.fingerprint, model.name, model.config.arch, str(model.path))

    # -- sessions --------------------------------------------------------------------------------

    def new_session(
        self, title: str = NEW_CHAT, system_prompt: str | None = None, sampling: dict | None = None
    ):
        return self.store.create_session(
            session_title(title) or NEW_CHAT,
            model_fingerprint=self.model.fingerprint,
            model_name=self.model.name,
            system_prompt=system_prompt,
            sampling=sampling,
        )

    def messages(self, session: Session) -> list[dict]:
        """The conversation as the chat template wants it: system prompt, then the path to the head."""
        return system_message(session.system_prompt) + [
            {"role": m.role, "content": m.content} for m in self.store.path(session.head_id)
        ]

    def conversation_ids(self, session: Session) -> list[int]:
        """The tokens of the stored conversation (its newest turns, when it outgrew the window).

        As much as the window holds: the next prompt never needs more of it, and when it needs less
        (room for a long reply), prompt() cuts the restored KV down by context shift."""
        return self.window_ids(self.messages(session))

    def window_ids(self, messages: list[dict]) -> list[int]:
        """The tokens of a conversation as it is stored: its newest turns that fit the window."""
        return fit_messages(self.model, messages, self.n_ctx - 1, add_generation_prompt=False, tools=self.tools)[1]

    def open(self, session: Session, read: RemoteRead | None = None) -> tuple[KVSequence, ResumeInfo]:
        """The session's KV, ready for its next reply: from RAM, stored blocks and tail; nothing computed.
        `read`: what prefetch() read for it already (a job's, on the thread that submitted it)."""
        t0 = time.perf_counter()
        earlier = read.seconds if read is not None else 0.0
        if read is None:
            read = self.prefetch(session)
        with self.lock:
            ids = self.conversation_ids(session)
            seq = self.live.get(session.id)
            if seq is None or seq.namespace != session.kv_namespace:  # (verify moves it to the shared one)
                if seq is not None:
                    seq.free()
                seq = self.live[session.id] = self.model.new_sequence(self.n_ctx)
                seq.namespace = session.kv_namespace
            if seq.private:
                shift_to(self.model, seq, ids)
            seq.reuse_prefix(ids)  # keeps what RAM holds, then takes blocks from RAM or the store
            from_remote = min(read.tokens if read else 0, seq.n_tokens) + self.restore_tail(session, seq, ids)
            seconds = time.perf_counter() - t0 + earlier
            return seq, ResumeInfo(len(ids), seq.n_tokens, seconds, from_remote, read)

    def prefetch(self, session: Session) -> RemoteRead | None:
        """The blocks and tail of a session's conversation that only the remote tier holds, read into RAM
        (read_remote) without the engine's lock: on the thread that submits a reply, so that a slow store
        holds up that reply only, not the scheduler and every reply it is decoding. None: no tier."""
        if self.kv.remote is None:
            return None
        live = self.live.get(session.id)
        if session.kv_namespace is not None or (live is not None and live.private):
            return RemoteRead()  # an import's KV, or KV that is no prefix's: never read from the tier
        ids = self.conversation_ids(session)
        held = live is not None and live.common_prefix(ids) == len(ids)  # (without the lock: a hint)
        return self.read_remote(ids, tail_of=None if held else ids, session_id=session.id)

    def read_remote(
        self, ids: Sequence[int], tail_of: Sequence[int] | None = None, session_id: str | None = None
    ) -> RemoteRead | None:
        """The full blocks of `ids` (of the shared namespace) that RAM lacks, read from the remote tier
        where it holds them and that beats computing them (KVStore.read_remote), for a sequence to take
        with reuse_prefix; None when there is no tier. The tail after the full blocks of `tail_of` (a
        prefix of ids: else no stored tail matches), which restore_tail asks for next, rides in the same
        round trip, unless the session (`session_id`) has one here. Every prompt goes through here — a
        session's turn (prefetch) and a conversation sent whole — before its job is queued: restore_tail
        reads nothing from the network."""
        if self.kv.remote is None:
            return None
        pool, B = self.model.pool, self.model.pool.block_size
        missing, keys, parent = [], [], None
        for i in range(len(ids) // B):
            tokens = tuple(ids[i * B : (i + 1) * B])
            parent = prefix_key(self.model.fingerprint, parent, tokens)
            keys.append(parent)
            if (None, parent) not in pool.by_key:  # (read without the lock: only what to fetch depends on it)
                missing.append((parent, tokens))
        tail = None
        if tail_of is not None and len(tail_of) % B and len(tail_of) // B <= len(keys):
            n = len(tail_of) // B * B
            tail = (keys[n // B - 1] if n else None, tuple(tail_of[n:]))
        return self.kv.read_remote(missing, tail, session_id)

    def restore_tail(self, session: Session | None, seq: KVSequence, ids: list[int]) -> int:
        """After seq took the full blocks of `ids`: the session's stored tail, as far as it matches ids,
        else a tail another server stored for ids to their end (read_remote read it). Returns the tokens
        that came from the remote tier."""
        if seq.n_tokens % self.model.pool.block_size or seq.n_tokens >= len(ids):
            return 0
        parent = seq.blocks[-1].key if seq.blocks else None
        found = self.kv.tail(session.id, parent, ids[seq.n_tokens :]) if session is not None else None
        remote = found is None and seq.namespace is None and not seq.private  # an import's KV never travels
        if remote:
            found = self.kv.remote_tail(parent, ids[seq.n_tokens :])
        if found is None:
            return 0
        tokens, (k, v) = found
        seq.append_kv(tokens, k, v)
        return len(tokens) if remote else 0

    # -- replies ---------------------------------------------------------------------------------

    def sampling(self, session: Session) -> SamplingParams:
        return self.sampling_for(session.sampling)

    def sampling_for(self, settings: dict) -> SamplingParams:
        """The sampling of a reply with these settings (a session's, a request's), the model's defaults
        where they set nothing."""
        return sampling_params(settings, self.sampling_defaults)

    def submit_reply(
        self,
        session: Session,
        user_text: str | None,
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int = MAX_TOKENS,
        stop: Sequence[str] = (),
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
        stats: GenerationStats | None = None,
        saved: SavedReply | None = None,
        store: bool = True,
        drop_unanswered: bool = False,
    ) -> Job:
        """The reply to the user's message (if any), as a job on the scheduler; when it ends, both are
        stored (unless not `store`: then nothing is written, and the session stays as it was) and the KV
        snapshotted, and job.result is a SavedReply. A job of a session waits for the one before it,
        and starts from what that one stored. `drop_unanswered`: see Job.

        The message and its reply are stored together, in one transaction, when the reply ends —
        also when it is cancelled (Esc), with what was generated so far — so an error or a crash
        leaves no question without its answer. The SavedReply tells where they went: a new branch when
        the session moved on meanwhile (another process replied in it). A failure to store them fails
        the job with StoreError; a failure to store the KV snapshot only notes it in the SavedReply."""
        session = self.store.get_session(session.id)
        if user_text is not None:
            self.check_message(session.system_prompt, user_text)
        saved = saved if saved is not None else SavedReply()
        read = self.prefetch(session)

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            nonlocal session
            session = self.store.get_session(session.id)  # as the turn before this one left it
            seq, info = self.open(session, read)
            job.remote = info.remote_read
            messages = self.messages(session)
            if user_text is not None:
                messages.append({"role": "user", "content": user_text})
            return self.prompt(messages, seq, max_tokens), seq

        def finish(job: Job) -> SavedReply:
            seq = job.seqs[0] if job.seqs else self.live[session.id]
            if store:
                self._finish_reply(session, user_text, seq, job.text(), job.stats[0], saved)
            else:
                self.note_prefill(job.stats[0])
            return saved

        return self._submit(
            session, prepare, finish, sampling, max_tokens=max_tokens, stop=stop, on_event=on_event, cancel=cancel,
            stats=stats, drop_unanswered=drop_unanswered,
        )

    def _submit(self, session: Session, prepare, finish, sampling: SamplingParams | None, **job_args) -> Job:
        """A job for the scheduler, sampling as the session's settings say unless told otherwise;
        prepare(job) is given the job, which exists before the scheduler can run it."""
        job = Job(
            lambda: prepare(job), finish=finish, sampling=sampling or self.sampling(session), session_id=session.id,
            **job_args,
        )
        return self.scheduler.submit(job)

    def reply(
        self,
        session: Session,
        user_text: str | None,
        *,
        on_prefill: Callable[[int, int], None] | None = None,
        **kwargs,
    ) -> Iterator[str]:
        """submit_reply, streamed as text pieces (see jobs.stream_text); arguments as submit_reply's."""
        yield from stream_text(self.submit_reply(session, user_text, **kwargs), on_prefill)

    def check_message(self, system_prompt: str | None, user_text: str) -> None:
        """Refuse a message that is empty, or too long even with every older turn dropped (the system
        prompt stays), so that nothing is stored and nothing computed for it."""
        if not user_text.strip():
            raise ValueError("the message is empty")
        alone = [*system_message(system_prompt), {"role": "user", "content": user_text}]
        check_fits(chat_prompt_ids(self.model, alone, tools=self.tools), self.n_ctx)

    def prompt(self, messages: list[dict], seq: KVSequence, max_tokens: int) -> list[int]:
        """The prompt for the next reply to `messages`; when they outgrow the window, the oldest turns
        go and the cached KV follows by context shift. A reply may use what the window has left."""
        # Room for the reply; what open() restored (up to a full window) is cut down by context shift.
        budget = self.n_ctx - min(max_tokens, self.n_ctx // 2)
        kept, prompt = fit_messages(self.model, messages, budget, tools=self.tools)
        if len(kept) < len(messages):
            shift_to(self.model, seq, prompt)
        return prompt

    def _finish_reply(
        self,
        session: Session,
        user_text: str | None,
        seq: KVSequence,
        text: str,
        stats: GenerationStats,
        saved: SavedReply,
    ) -> None:
        """Store the turn below the head the reply was computed from (`session` as it was), then the KV."""
        reply = Message(0, None, "assistant", text, stats.token_ids, time.time(), reply_stats(stats))
        asked = [] if user_text is None else [Message(0, None, "user", user_text, None, time.time(), None)]
        turn = [*asked, reply]
        try:
            stored, saved.branched = self.store.append_turn(session.id, session.head_id, turn)
        except StoreError as e:
            raise ReplyNotStored(e) from None
        title = named_by(session, user_text) if stored.id == session.id else None
        if title is not None:
            with contextlib.suppress(StoreError):  # the turn is stored; a title is not worth failing it
                self.store.update_session(stored.id, title=title)
                stored = self.store.get_session(stored.id)
        saved.session = stored
        self.note_prefill(stats)
        if stored.id != session.id:  # the KV computed belongs to the new branch now
            self.live[stored.id] = self.live.pop(session.id, seq)
        try:
            # A stopped reply stores the KV it holds: running the rest of a long prompt now would undo the Esc.
            self.snapshot(stored, seq, complete=stats.stop_reason != "cancelled")
        except (StoreError, KeyboardInterrupt) as e:  # KV is a cache; a second Ctrl+C may skip it
            saved.kv_skipped = str(e) or "interrupted"

    def note_prefill(self, stats: GenerationStats) -> None:
        """A reply's prefill speed, what the remote tier's reads must beat (see read_remote)."""
        if stats.prefilled_tokens >= self.model.pool.block_size:  # shorter ones are mostly overhead
            self.kv.prefill_tok_s.add(stats.prefill_tok_s)

    def snapshot(self, session: Session, seq: KVSequence, complete: bool = True) -> None:
        """Bring the KV up to the end of the stored conversation (unless not `complete`: then what it holds
        of it), then store what is new, in one transaction."""
        with self.lock:
            held = self.hold_kv(seq, self.conversation_ids(session), complete)
        self.store_kv(session.id, held)

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

    def store_kv(self, session_id: str, held: KVSequence) -> None:
        """Store what hold_kv kept as the session's KV (encoding only blocks not stored yet), then free it."""
        try:
            full, tail = held.snapshot()
            self.kv.save(
                session_id,
                [(b.key, b.tokens) for b in full],
                lambda i: self.model.pool.block_kv(full[i]),
                tail,
                held.n_tokens,
                held.namespace,
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
            fresh = self.model.new_sequence(self.n_ctx)
            fresh.private = True  # all of it computed now: no block taken from RAM or the store
            self.model.forward(ids, fresh)
            B, parent = self.model.pool.block_size, None
            matched, differed = [], 0
            for i, block in enumerate(fresh.blocks[: len(ids) // B]):
                tokens = ids[i * B : (i + 1) * B]
                parent = prefix_key(self.model.fingerprint, parent, tokens)
                stored = self.kv.load(parent, namespace)
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

    # -- branching -------------------------------------------------------------------------------

    def fork(self, session: Session, at_message: int | None = None, title: str | None = None) -> Session:
        """A new session sharing this one's messages and KV up to `at_message` (default: the head)."""
        with self.lock:
            child = self.store.fork_session(session.id, at_message, title)
            parent_seq = self.live.get(session.id)
            if parent_seq is not None and child.head_id == session.head_id:
                self.live[child.id] = parent_seq.fork()  # O(1): shares every block
            return child

    def submit_regenerate(
        self,
        session: Session,
        n: int = 1,
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int = MAX_TOKENS,
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Job:
        """New replies to the last user message, each in its own sibling branch: one job of n replies,
        decoded in one batch. job.result: [(branch, text)] once it ended."""
        with self.lock:
            head = self.store.message(session.head_id) if session.head_id else None
            if head is None or head.role != "assistant" or head.parent_id is None:
                raise ValueError("nothing to regenerate: the conversation does not end with a reply")
            branches = [
                self.fork(session, head.parent_id, marked_title(session.title, "(regenerated)")) for _ in range(n)
            ]
        read = self.prefetch(branches[0])

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            base, info = self.open(branches[0], read)
            job.remote = info.remote_read
            return self.prompt(self.messages(branches[0]), base, max_tokens), base

        def finish(job: Job) -> list[tuple[Session, str]]:
            out = []
            seqs = job.seqs or [self.live[branches[0].id]] * n
            for i, (branch, seq) in enumerate(zip(branches, seqs, strict=True)):
                old = self.live.get(branch.id)
                if old is not None and old is not seq:
                    old.free()
                self.live[branch.id] = seq
                self._finish_reply(branch, None, seq, job.text(i), job.stats[i], SavedReply())
                out.append((self.store.get_session(branch.id), job.text(i)))
            return out

        return self._submit(
            session, prepare, finish, sampling, n=n, max_tokens=max_tokens, on_event=on_event, cancel=cancel
        )

    def regenerate(
        self, session: Session, n: int = 1, on_prefill: Callable[[int, int], None] | None = None, **kwargs
    ) -> list[tuple[Session, str]]:
        """submit_regenerate, waited for: [(branch, text)]."""
        job = self.submit_regenerate(session, n, **kwargs)
        for _ in stream_text(job, on_prefill):
            pass
        return job.result

    def edit(
        self, session: Session, message_id: int, new_text: str, **kwargs
    ) -> tuple[Session, Iterator[str]]:
        """Change a past user message: a sibling branch with the new text, and its reply streaming."""
        message = self.store.message(message_id)
        if message.role != "user":
            raise ValueError("only a user message can be edited")
        branch = fork_before(self.store, session, message, marked_title(session.title, "(edited)"))
        return branch, self.reply(branch, new_text, **kwargs)  # the new text goes beside the old one

    def close(self, session_id: str) -> None:
        seq = self.live.pop(session_id, None)
        if seq is not None:
            seq.free()
