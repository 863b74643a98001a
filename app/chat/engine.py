"""The chat engine: stored conversations driven through the model, in verbs every front end calls.

reply, regenerate, edit, fork, delete, resume, verify, close: each carries its own locking and order,
so the app, the command line and the server never build a job, take the engine's lock or call a KV
step. A reply renders the conversation, finds the longest prefix whose KV is already held (resume.py:
RAM, the stored blocks, the session's stored tail, the remote tier) and is submitted as a job to the
scheduler, which prefills only the rest and streams it; when it ends, the turn is stored and the new
KV snapshotted. A conversation sent whole (conversations.py) goes the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from llama_chat.inference import (
    GenerationStats,
    KVSequence,
    Model,
    SamplingParams,
    chat_prompt_ids,
    fit_messages,
    shift_to,
)
from llama_chat.inference.catalog import recommended_system_prompt
from llama_chat.inference.thinking import PROMPT_END_TOKENS, ThinkingSplitter
from llama_chat.storage.codec import PLANNED_CODECS
from llama_chat.storage.db import StoreError
from llama_chat.storage.kv_plan import model_plan
from llama_chat.storage.kv_store import KVStore
from llama_chat.storage.remote import RemoteTier
from llama_chat.storage.store import ChatStore, Message, Session, marked_title

from .conversations import Conversation, Conversations, RawText
from .jobs import Event, Job
from .replies import Plan, ReplyNotStored, SavedReply, fitting, reply_message
from .resume import LiveSessions, ResumeInfo, VerifyResult, system_message
from .scheduler import Scheduler
from .settings import CODEC, MAX_TOKENS, N_CTX, model_sampling, sampling_params, template_variables
from .titles import NEW_CHAT, named_by, session_title

__all__ = ["ChatEngine", "Conversation", "RawText", "ReplyNotStored", "ResumeInfo", "SavedReply", "VerifyResult"]


def fork_before(store: ChatStore, session: Session, message: Message, title: str | None = None) -> Session:
    """A new session on `session`'s tree that ends just before `message` (empty, before the first)."""
    branch = store.fork_session(session.id, message.id, title)
    store.set_head(branch.id, message.parent_id)
    return store.get_session(branch.id)


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
        plan = model_plan(model, codec=codec) if codec in PLANNED_CODECS else None
        self.kv = KVStore(store, model.fingerprint, codec, remote, plan)
        self.n_ctx = min(n_ctx, model.config.n_ctx_train)
        self.sampling_defaults = model_sampling(model)  # where a session sets nothing
        self.system_prompt = recommended_system_prompt(model.path)  # a new chat's, where the user sets none
        self.scheduler = scheduler or Scheduler(model)
        self.lock = self.scheduler.lock  # the pool is not thread-safe: KV is touched between steps only
        self.live = LiveSessions(model, store, self.kv, self.lock, self.n_ctx)  # sessions open here
        self.conversations = Conversations(self.live, lambda: self.scheduler.closed)
        self._turns: dict[str, int] = {}  # a session's turns submitted and not ended yet
        self._turns_changed = threading.Condition()
        self._read_pool()  # and again by health(), whenever the lock is free
        model.pool.attach_source(self.kv)  # one source per pool: a second store on this model is refused
        store.add_model(model.fingerprint, model.name, model.config.arch, str(model.path))

    @property
    def tools(self) -> list[dict] | None:
        """The function definitions every session's prompt offers (`chat`'s MCP tools); None: none."""
        return self.live.tools

    @tools.setter
    def tools(self, tools: list[dict] | None) -> None:
        self.live.tools = tools

    @property
    def queue_full(self) -> bool:
        """Whether a reply asked for now would be refused (QueueFull): as many wait as may."""
        return self.scheduler.load()["queued"] >= self.scheduler.max_queued

    # -- sessions --------------------------------------------------------------------------------

    def new_session(
        self, title: str = NEW_CHAT, system_prompt: str | None = None, sampling: dict | None = None
    ) -> Session:
        """A new chat; without a system prompt it takes the model's recommended one ("": none), unless
        tools are offered: the template then writes its own system text on calling them, and ours made
        the default model write bare JSON lines instead of calls (tests/test_mcp_tools.py)."""
        if system_prompt is None:
            system_prompt = None if self.tools else self.system_prompt
        return self.store.create_session(
            session_title(title) or NEW_CHAT,
            model_fingerprint=self.model.fingerprint,
            model_name=self.model.name,
            system_prompt=system_prompt or None,
            sampling=sampling,
        )

    def resume(self, session: Session) -> ResumeInfo:
        """Open a session (the one a front end shows): what only the remote tier holds is read first,
        without the lock (a slow store holds up no reply being decoded); then, under it, the other
        sessions let go of their KV and this one's comes back from RAM, stored blocks and tail."""
        session = self.store.get_session(session.id)
        read = self.live.prefetch(session)
        with self.lock:
            self.live.close_all(but=session.id)
            return self.live.open(session, read)[1]

    def fork(
        self,
        session: Session,
        at_message: int | None = None,
        title: str | None = None,
        *,
        before: int | None = None,
    ) -> Session:
        """A new session sharing this one's messages and KV up to `at_message` (default: the head), or
        ending just before the message `before` (empty, before the first)."""
        if before is not None:
            return fork_before(self.store, session, self.store.message(before), title)
        with self.lock:
            child = self.store.fork_session(session.id, at_message, title)
            parent_seq = self.live.get(session.id)
            if parent_seq is not None and child.head_id == session.head_id:
                self.live.keep(child.id, parent_seq.fork())  # O(1): shares every block
            return child

    def delete(self, session_id: str) -> int:
        """Delete a session once the turns being made in it are stored; its KV in RAM goes with it.
        Messages its forks still reach are kept. Returns how many messages went."""
        with self._turns_changed:
            self._turns_changed.wait_for(lambda: session_id not in self._turns)
        with self.lock:
            self.live.close(session_id)
        return self.store.delete_session(session_id)

    def verify(self, session: Session) -> VerifyResult:
        """Recompute the KV of a session resumed from an imported file (see LiveSessions.verify)."""
        return self.live.verify(session)

    def close(self) -> None:
        """Stop: the replies running or waiting are cancelled (what they made is stored), the
        conversations being stored are waited for, and every open session's KV goes back."""
        self.scheduler.close()
        self.conversations.close()
        with self.lock:
            self.live.close_all()

    def health(self) -> dict:
        """Replies running and waiting, the KV pool's bytes (in use by replies, cached for reuse), and
        the remote tier's numbers when there is one. It never waits on the lock (held through each
        step, seconds of a long prefill: a balancer asking would think the server dead): while a step
        runs, the pool's bytes are those it had when last read."""
        if self.lock.acquire(blocking=False):  # the pool changes at every step
            try:
                self._read_pool()
            finally:
                self.lock.release()
        remote = {} if self.kv.remote is None else {"kv_remote": self.kv.remote.stats()}
        return {**self.scheduler.load(), "kv": self._pool_bytes, **remote}

    def _read_pool(self) -> None:
        memory = self.model.pool.memory_breakdown()
        kinds = ("in_use_bytes", "cached_bytes", "free_bytes", "budget_bytes")
        self._pool_bytes = {k: memory[k] for k in kinds}

    # -- replies ---------------------------------------------------------------------------------

    def check_message(self, system_prompt: str | None, user_text: str) -> None:
        """Refuse a message that is empty, or too long even with every older turn dropped (the system
        prompt stays), so that nothing is stored and nothing computed for it."""
        if not user_text.strip():
            raise ValueError("the message is empty")
        alone = [*system_message(system_prompt), {"role": "user", "content": user_text}]
        fitting(self.n_ctx, lambda limit: chat_prompt_ids(self.model, alone, tools=self.tools, limit=limit))

    def reply(
        self,
        to: Session | Conversation | RawText,
        text: str | None = None,
        *,
        n: int = 1,
        settings: dict | None = None,
        sampling: SamplingParams | None = None,
        grammar: str | None = None,
        logprobs: int | None = None,
        max_tokens: int = MAX_TOKENS,
        stop: Sequence[str] = (),
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
        stats: GenerationStats | None = None,
        saved: SavedReply | None = None,
        store: bool = True,
        keep_kv: bool = True,
        drop_unanswered: bool = False,
    ) -> Job:
        """A reply, as a job on the scheduler: to the user's `text` in a session (None: to its last
        message), or `n` replies to a Conversation sent whole (kept as an API session: job.result is the
        future of that session, None when not kept), or `n` continuations of a RawText (never kept; a
        ValueError names a prompt that cannot be used). Sampling: `sampling` as given, else the session's
        settings overridden by `settings` (the model's defaults where they set nothing), shaped by a
        `grammar`; `logprobs` notes each token's log-probability (and the n likeliest) in job.stats.

        A session's message and its reply are stored together, in one transaction, when the reply ends —
        also when it is cancelled, with what was generated so far — so an error or a crash leaves no
        question without its answer; job.result (and `saved`) is a SavedReply telling where they went:
        a new branch when the session moved on meanwhile (another process replied in it). A failure to
        store them fails the job with ReplyNotStored; a failure to store the KV only notes it. Not
        `store`: nothing is written, the session stays as it was. A job of a session waits for the one
        before it, and starts from what that one stored. Not `keep_kv`: the session's KV goes back to the
        pool's cache when it ends (a server's sessions hold none between turns). `drop_unanswered`: see Job."""
        if isinstance(to, Conversation | RawText):
            plan = self.conversations.plan(to, settings or {}, store)
            sampling = self._sampling({}, settings, sampling, grammar, logprobs)
            return self._submit(plan, sampling, n=n, max_tokens=max_tokens, stop=stop, on_event=on_event,
                                cancel=cancel, stats=stats, drop_unanswered=drop_unanswered,
                                continues_text=isinstance(to, RawText))  # fmt: skip
        if n != 1:
            raise ValueError("a session's turn has one reply: regenerate makes several")
        session = self.store.get_session(to.id)
        if text is not None:
            self.check_message(session.system_prompt, text)
        sampling = self._sampling(session.sampling, settings, sampling, grammar, logprobs)
        variables = template_variables({**session.sampling, **(settings or {})})
        self._count_turn(session.id, +1)  # from here: a delete waits for this turn to be stored
        try:
            plan = self._turn(
                session, text, max_tokens, saved if saved is not None else SavedReply(), store, keep_kv, variables
            )
            return self._submit(plan, sampling, max_tokens=max_tokens, stop=stop, on_event=on_event,
                                cancel=cancel, stats=stats, drop_unanswered=drop_unanswered)  # fmt: skip
        except BaseException:
            self._count_turn(session.id, -1)
            raise

    def regenerate(
        self,
        session: Session,
        n: int = 1,
        *,
        reply_id: int | None = None,
        settings: dict | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int = MAX_TOKENS,
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[list[Session], Job]:
        """New replies to the message a reply answered (`reply_id`, default the head), each in its own
        sibling branch, made now: one job of n replies, decoded in one batch. job.result: a SavedReply
        per branch once it ended."""
        with self.lock:
            target = self.store.message(reply_id or session.head_id) if reply_id or session.head_id else None
            if target is None or target.role != "assistant" or target.parent_id is None:
                raise ValueError("nothing to regenerate: the conversation does not end with a reply")
            title = marked_title(session.title, "(regenerated)")
            branches = [self.fork(session, target.parent_id, title) for _ in range(n)]
        read = self.live.prefetch(branches[0])
        variables = template_variables({**session.sampling, **(settings or {})})

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            base, info = self.live.open(branches[0], read)
            job.remote = info.remote_read
            return self._prompt(self.live.messages(branches[0]), base, max_tokens, variables), base

        def finish(job: Job) -> list[SavedReply]:
            seqs = job.seqs or [self.live[branches[0].id]] * n
            out = []
            for i, (branch, seq) in enumerate(zip(branches, seqs, strict=True)):
                self.live.keep(branch.id, seq)
                out.append(self._store_turn(branch, None, seq, job, i, SavedReply()))
            return out

        sampling = self._sampling(session.sampling, settings, sampling)
        plan = Plan(prepare, finish, session_id=session.id)
        return branches, self._submit(
            plan, sampling, n=n, max_tokens=max_tokens, on_event=on_event, cancel=cancel
        )

    def edit(self, session: Session, message_id: int, new_text: str, **options) -> tuple[Session, Job]:
        """Change a past user message: a sibling branch, made now, with the new text beside the old one,
        and the job of its reply (options as reply's)."""
        message = self.store.message(message_id)
        if message.role != "user":
            raise ValueError("only a user message can be edited")
        self.check_message(session.system_prompt, new_text)
        branch = self.fork(session, title=marked_title(session.title, "(edited)"), before=message_id)
        return branch, self.reply(branch, new_text, **options)

    # -- one pipeline: a plan, a job, its end ------------------------------------------------------

    def _sampling(
        self, base: dict, settings: dict | None, sampling: SamplingParams | None, grammar=None, logprobs=None
    ) -> SamplingParams:
        sampling = sampling or sampling_params({**base, **(settings or {})}, self.sampling_defaults)
        if grammar is None and logprobs is None:
            return sampling
        return replace(sampling, grammar=grammar, logprobs=logprobs)

    def _submit(self, plan: Plan, sampling: SamplingParams, **job_args) -> Job:
        """The plan's job on the scheduler (QueueFull when too many wait, RuntimeError once closed).
        Replies to a chat are told apart into thinking and answer; a raw text's continuation is not."""
        thinking = None if job_args.get("continues_text") else self._thinking
        job = Job(lambda: plan.prepare(job), finish=plan.finish, on_end=plan.ended, sampling=sampling,
                  session_id=plan.session_id, thinking=thinking, **job_args)  # fmt: skip
        return self.scheduler.submit(job)

    def _thinking(self, prompt: list[int]) -> ThinkingSplitter | None:
        """How a reply to `prompt` is told apart (None: this model's template writes no thinking); it
        starts in thinking where the prompt opened it."""
        fmt = self.live.thinking
        if fmt is None:
            return None
        return ThinkingSplitter(fmt, fmt.opened_by(self.model.tokenizer.decode(prompt[-PROMPT_END_TOKENS:])))

    def _count_turn(self, session_id: str, change: int) -> None:
        with self._turns_changed:
            left = self._turns.get(session_id, 0) + change
            if left:
                self._turns[session_id] = left
            else:
                self._turns.pop(session_id, None)
                self._turns_changed.notify_all()

    def _turn(
        self,
        session: Session,
        text: str | None,
        max_tokens: int,
        saved: SavedReply,
        store: bool,
        keep_kv: bool,
        variables: dict,
    ) -> Plan:
        """The plan of a session's next turn: the reply to `text` (None: to its last message), its
        prompt rendered with the template's `variables`."""
        read = self.live.prefetch(session)  # here: a slow store holds up this reply only

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            nonlocal session
            session = self.store.get_session(session.id)  # as the turn before this one left it
            seq, info = self.live.open(session, read)
            job.remote = info.remote_read
            messages = self.live.messages(session)
            if text is not None:
                messages.append({"role": "user", "content": text})
            return self._prompt(messages, seq, max_tokens, variables), seq

        def finish(job: Job) -> SavedReply:
            seq = job.seqs[0] if job.seqs else self.live[session.id]
            if store:
                return self._store_turn(session, text, seq, job, 0, saved)
            self.live.note_prefill(job.stats[0])
            return saved

        def ended(job: Job) -> None:  # on the scheduler thread, which holds the pool
            if not keep_kv:
                self.live.close(session.id)
                if saved.session is not None:
                    self.live.close(saved.session.id)
            self._count_turn(session.id, -1)

        return Plan(prepare, finish, ended, session.id)

    def _prompt(self, messages: list[dict], seq: KVSequence, max_tokens: int, variables: dict) -> list[int]:
        """The prompt for the next reply to `messages`; when they outgrow the window, the oldest turns
        go and the cached KV follows by context shift. A reply may use what the window has left."""
        # Room for the reply; what open() restored (up to a full window) is cut down by context shift.
        budget = self.n_ctx - min(max_tokens, self.n_ctx // 2)
        kept, prompt = fit_messages(self.model, messages, budget, tools=self.tools, variables=variables)
        if len(kept) < len(messages):
            shift_to(self.model, seq, prompt)
        return prompt

    def _store_turn(
        self, session: Session, user_text: str | None, seq: KVSequence, job: Job, alt: int, saved: SavedReply
    ) -> SavedReply:
        """Store the turn below the head the reply was computed from (`session` as it was), then the KV."""
        reply = reply_message(job, alt)
        asked = [] if user_text is None else [Message(0, None, "user", user_text, None, reply.created, None)]
        try:
            stored, saved.branched = self.store.append_turn(session.id, session.head_id, [*asked, reply])
        except StoreError as e:
            raise ReplyNotStored(e) from None
        title = named_by(session, user_text) if stored.id == session.id else None
        if title is not None:
            with contextlib.suppress(StoreError):  # the turn is stored; a title is not worth failing it
                self.store.update_session(stored.id, title=title)
                stored = self.store.get_session(stored.id)
        saved.session = stored
        self.live.note_prefill(job.stats[alt])
        if stored.id != session.id:  # the KV computed belongs to the new branch now
            self.live.move(session.id, stored.id, seq)
        try:
            # A stopped reply stores the KV it holds: running the rest of a long prompt now would undo the Esc.
            self.live.snapshot(stored, seq, complete=job.stats[alt].stop_reason != "cancelled")
        except (StoreError, KeyboardInterrupt) as e:  # KV is a cache; a second Ctrl+C may skip it
            saved.kv_skipped = str(e) or "interrupted"
        return saved
