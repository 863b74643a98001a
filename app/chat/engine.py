"""The chat engine: stored conversations driven through the model, in verbs every front end calls.

new_session, reply, regenerate, edit, answer_tool, fork, delete, resume, verify, close: each carries its
own locking and order, so the app, the command line and the server never build a job, take the engine's
lock, touch its store or call a KV step. A session's turn reads its conversation once and renders it
once into the prompt; the session cache (session_cache.py) brings back the longest prefix whose KV is
held — RAM, the stored blocks, the session's stored tail, the remote tier — and the turn's job on the
scheduler prefills only the rest and streams the reply; when it ends, the turn is stored
(replies.store_reply) and the cache snapshots the new KV. A conversation sent whole (conversations.py)
goes the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from llama_chat.inference import (
    GenerationStats,
    KVSequence,
    Model,
    SamplingParams,
    chat_prompt_ids,
    fit_messages,
)
from llama_chat.inference.catalog import recommended_system_prompt
from llama_chat.inference.thinking import reply_splitter
from llama_chat.inference.tokenizer import Tokenizer
from llama_chat.inference.tool_calls import ToolFormat, tool_format
from llama_chat.storage.codec import PLANNED_CODECS
from llama_chat.storage.db import StoreError
from llama_chat.storage.kv_plan import model_plan
from llama_chat.storage.remote import RemoteTier
from llama_chat.storage.store import ChatStore, Message, Session, marked_title

from .conversations import Conversation, Conversations, RawText
from .jobs import Event, Job
from .replies import (
    Plan,
    ReplyNotStored,
    SavedReply,
    check_fits,
    fitting,
    fork_before,
    make_session,
    reply_message,
    store_reply,
    system_message,
    template_message,
)
from .resume import ResumeInfo, VerifyResult
from .scheduler import Scheduler
from .session_cache import SessionCache, kv_salt
from .settings import CODEC, MAX_TOKENS, N_CTX, model_sampling, reply_sampling, template_variables
from .titles import NEW_CHAT, named_by

__all__ = ["ChatEngine", "Conversation", "ModelInfo", "RawText", "ReplyNotStored", "ResumeInfo", "SavedReply",
           "VerifyResult"]  # fmt: skip


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as front ends see it: what it is and is called, its tokenizer (to compile a
    grammar, to decode token ids) and how its chat template writes tool calls (None: it takes none)."""

    name: str  # the GGUF's general.name
    path: Path
    fingerprint: str
    tokenizer: Tokenizer
    tool_format: ToolFormat | None


@dataclass
class _Turn:
    """A session's next turn, its conversation read and rendered once: the session as it was read,
    its stored conversation (as the chat template wants it), the prompt of the reply (with the user's
    new text), and whether the prompt cut the oldest turns to fit the window; the settings the reply
    was asked with over the session's (the template's switches among them)."""

    session: Session
    messages: list[dict]
    prompt: list[int]
    cut: bool
    settings: dict = field(default_factory=dict)


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
        self._model, self._store = model, store
        fmt = tool_format(model.chat_template) if model.has_chat_template else None
        self.model_info = ModelInfo(model.name, model.path, model.fingerprint, model.tokenizer, fmt)
        self.n_ctx = min(n_ctx, model.config.n_ctx_train)
        self.sampling_defaults = model_sampling(model)  # where a session sets nothing
        self.system_prompt = recommended_system_prompt(model.path)  # a new chat's, where the user sets none
        self._scheduler = scheduler or Scheduler(model)
        self._lock = self._scheduler.lock  # the pool is not thread-safe: KV is touched between steps only
        plan = model_plan(model, codec=codec) if codec in PLANNED_CODECS else None
        self._cache = SessionCache(model, store, self._lock, self.n_ctx, codec, remote, plan)
        self._conversations = Conversations(self._cache, model, store, fmt, lambda: self._scheduler.closed)
        self._turns: dict[str | None, list[Job]] = {}  # each session's turns submitted (some may have ended)
        self._turns_lock = threading.Lock()
        self._read_pool()  # and again by health(), whenever the lock is free
        store.add_model(model.fingerprint, model.name, model.config.arch, str(model.path))

    @property
    def tools(self) -> list[dict] | None:
        """The function definitions every session's prompt offers (`chat`'s MCP tools); None: none."""
        return self._cache.tools

    @tools.setter
    def tools(self, tools: list[dict] | None) -> None:
        self._cache.tools = tools

    @property
    def queue_full(self) -> bool:
        """Whether a reply asked for now would be refused (QueueFull): as many wait as may."""
        return self._scheduler.load()["queued"] >= self._scheduler.max_queued

    @property
    def kv_remote(self) -> dict | None:
        """The remote KV tier's numbers (--kv-remote); None: there is none."""
        return None if self._cache.remote is None else self._cache.remote.stats()

    # -- sessions --------------------------------------------------------------------------------

    def new_session(
        self,
        title: str = NEW_CHAT,
        system_prompt: str | None = None,
        sampling: dict | None = None,
        *,
        origin: str | None = None,
        tenant: str | None = None,
    ) -> Session:
        """A new chat (a `tenant`'s, in the KV namespace of its own; made by `origin`: None, a person);
        without a system prompt it takes the model's recommended one ("": none), unless tools are
        offered: the template then writes its own system text on calling them, and ours made the default
        model write bare JSON lines instead of calls (tests/test_mcp_tools.py)."""
        if system_prompt is None:
            system_prompt = None if self.tools else self.system_prompt
        return make_session(self._store, self._model, title, system_prompt or None, sampling,
                            origin=origin, tenant=tenant, namespace=kv_salt(tenant))  # fmt: skip

    def resume(self, session: Session) -> ResumeInfo:
        """Open a session (the one a front end shows): what only the remote tier holds is read first,
        without the lock (a slow store holds up no reply being decoded); then, under it, the other
        sessions let go of their KV and this one's comes back from RAM, stored blocks and tail."""
        session = self._store.get_session(session.id)
        read = self._cache.prefetch(session)
        with self._lock:
            self._cache.close_all(but=session.id)
            return self._cache.open(session, read)[1]

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
            return fork_before(self._store, session, self._store.message(before), title)
        with self._lock:
            child = self._store.fork_session(session.id, at_message, title)
            if child.head_id == session.head_id:
                self._cache.fork(session.id, child.id)  # O(1): shares every block
            return child

    def delete(self, session_id: str) -> int:
        """Delete a session once the turns being made in it are stored; its KV in RAM goes with it.
        Messages its forks still reach are kept. Returns how many messages went."""
        self._wait_for_turns(session_id)
        with self._lock:
            self._cache.close(session_id)
        return self._store.delete_session(session_id)

    def answer_tool(self, session: Session, answer: str) -> Session:
        """Store a tool's answer to a call the session's last reply made (or why there is none) as a
        tool message at its head, once the turn being made in it is stored; returns the session ending
        with it. The model reads it in the next reply (reply(session) with no text)."""
        self._wait_for_turns(session.id)
        self._store.add_message(session.id, "tool", answer)
        return self._store.get_session(session.id)

    def verify(self, session: Session) -> VerifyResult:
        """Recompute the KV of a session resumed from an imported file (see SessionCache.verify)."""
        return self._cache.verify(session)

    def close(self) -> None:
        """Stop: the replies running or waiting are cancelled (what they made is stored), the
        conversations being stored are waited for, and every open session's KV goes back."""
        self._scheduler.close()
        self._conversations.close()
        with self._lock:
            self._cache.close_all()

    def health(self) -> dict:
        """Replies running and waiting, the KV pool's bytes (in use by replies, cached for reuse), and
        the remote tier's numbers when there is one. It never waits on the lock (held through each
        step, seconds of a long prefill: a balancer asking would think the server dead): while a step
        runs, the pool's bytes are those it had when last read."""
        if self._lock.acquire(blocking=False):  # the pool changes at every step
            try:
                self._read_pool()
            finally:
                self._lock.release()
        remote = {} if self.kv_remote is None else {"kv_remote": self.kv_remote}
        return {**self._scheduler.load(), "kv": self._pool_bytes, **remote}

    def _read_pool(self) -> None:
        memory = self._model.pool.memory_breakdown()
        kinds = ("in_use_bytes", "cached_bytes", "free_bytes", "budget_bytes")
        self._pool_bytes = {k: memory[k] for k in kinds}

    # -- replies ---------------------------------------------------------------------------------

    def check_message(self, system_prompt: str | None, user_text: str) -> None:
        """Refuse a message that is empty, or too long even with every older turn dropped (the system
        prompt stays), so that nothing is stored and nothing computed for it."""
        if not user_text.strip():
            raise ValueError("the message is empty")
        alone = [*system_message(system_prompt), {"role": "user", "content": user_text}]
        fitting(self.n_ctx, lambda limit: chat_prompt_ids(self._model, alone, tools=self.tools, limit=limit))

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
        pool's cache when it ends (a server's sessions hold none between turns). `drop_unanswered`: see
        Job."""
        if isinstance(to, Conversation | RawText):
            plan = self._conversations.plan(to, settings or {}, store)
            sampling = reply_sampling(self.sampling_defaults, {}, settings, sampling, grammar, logprobs)
            return self._submit(plan, sampling, n=n, max_tokens=max_tokens, stop=stop, on_event=on_event,
                                cancel=cancel, stats=stats, drop_unanswered=drop_unanswered,
                                continues_text=isinstance(to, RawText))  # fmt: skip
        if n != 1:
            raise ValueError("a session's turn has one reply: regenerate makes several")
        if text is not None and not text.strip():
            raise ValueError("the message is empty")
        turn = self._read_turn(to.id, text, max_tokens, settings)
        if text is not None:  # too long even alone: nothing is stored, nothing computed
            check_fits(turn.prompt, self.n_ctx)
        defaults = self.sampling_defaults
        sampling = reply_sampling(defaults, turn.session.sampling, settings, sampling, grammar, logprobs)
        saved = saved if saved is not None else SavedReply()
        plan = self._plan(turn, text, max_tokens, None, saved, store, keep_kv)
        return self._submit(plan, sampling, max_tokens=max_tokens, stop=stop, on_event=on_event,
                            cancel=cancel, stats=stats, drop_unanswered=drop_unanswered)  # fmt: skip

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
        with self._lock:
            target = self._store.message(reply_id or session.head_id) if reply_id or session.head_id else None
            if target is None or target.role != "assistant" or target.parent_id is None:
                raise ValueError("nothing to regenerate: the conversation does not end with a reply")
            title = marked_title(session.title, "(regenerated)")
            branches = [self.fork(session, target.parent_id, title) for _ in range(n)]
        turn = self._read_turn(branches[0].id, None, max_tokens, settings)
        sampling = reply_sampling(self.sampling_defaults, session.sampling, settings, sampling)
        plan = self._plan(turn, None, max_tokens, branches, None, order=session.id)
        return branches, self._submit(plan, sampling, n=n, max_tokens=max_tokens, on_event=on_event,
                                      cancel=cancel)  # fmt: skip

    def edit(self, session: Session, message_id: int, new_text: str, **options) -> tuple[Session, Job]:
        """Change a past user message: a sibling branch, made now, with the new text beside the old one,
        and the job of its reply (options as reply's)."""
        message = self._store.message(message_id)
        if message.role != "user":
            raise ValueError("only a user message can be edited")
        self.check_message(session.system_prompt, new_text)
        branch = self.fork(session, title=marked_title(session.title, "(edited)"), before=message_id)
        return branch, self.reply(branch, new_text, **options)

    # -- one pipeline: a turn, its plan, its job, its end ----------------------------------------------

    def _submit(self, plan: Plan, sampling: SamplingParams, **job_args) -> Job:
        """The plan's job on the scheduler (QueueFull when too many wait, RuntimeError once closed); its
        replies told apart into thinking and answer, but a raw text's continuation."""
        thinking = None if job_args.get("continues_text") else partial(reply_splitter, self._cache.thinking,
                                                                       self._model.tokenizer)  # fmt: skip
        job = Job(lambda: plan.prepare(job), finish=plan.finish, sampling=sampling,
                  session_id=plan.session_id, thinking=thinking, **job_args)  # fmt: skip
        with self._turns_lock:  # from here until its plan ended, a delete of the session waits
            going = {s: [j for j in jobs if not j.state.ended] for s, jobs in self._turns.items()}
            self._turns = {s: jobs for s, jobs in going.items() if jobs}
            self._turns.setdefault(plan.session_id, []).append(job)
        try:
            return self._scheduler.submit(job)
        except BaseException:
            with self._turns_lock:
                self._turns[plan.session_id].remove(job)
            raise

    def _wait_for_turns(self, session_id: str) -> None:
        """Until the turns being made in the session are stored."""
        with self._turns_lock:
            turns = list(self._turns.get(session_id, []))
        for job in turns:
            job.wait()

    def _read_turn(self, session_id: str, text: str | None, max_tokens: int, settings: dict | None) -> _Turn:
        """The session's next turn: its conversation read, and rendered with the user's `text` (None: a
        reply to its last message) into the prompt, with the template's switches that the session's
        settings and `settings` set. When the conversation outgrows the window its oldest turns go: room
        is left for the reply, which may use what the window has left."""
        session, settings = self._store.get_session(session_id), settings or {}
        messages = self._cache.messages(session)
        asked = messages + ([{"role": "user", "content": text}] if text is not None else [])
        budget = self.n_ctx - min(max_tokens, self.n_ctx // 2)
        variables = template_variables({**session.sampling, **settings})
        kept, prompt = fit_messages(self._model, asked, budget, tools=self.tools, variables=variables)
        return _Turn(session, messages, prompt, len(kept) < len(asked), settings)

    def _plan(
        self,
        turn: _Turn,
        text: str | None,
        max_tokens: int,
        branches: list[Session] | None,
        saved: SavedReply | None,
        store: bool = True,
        keep_kv: bool = True,
        order: str | None = None,
    ) -> Plan:
        """The plan of a session's turn: the reply to `text` (None: to its last message) stored in the
        session, `saved` its result; or, in `branches`, one alternative in each, a SavedReply each their
        result. It waits for the turn before it of the session (`order`, default the turn's own)."""
        session_id, order = turn.session.id, order or turn.session.id
        read = self._cache.prefetch(turn.session, turn.messages)  # here: a slow store holds up one reply

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            nonlocal turn
            session = self._store.get_session(session_id)  # as the turn before this one left it
            if (session.head_id, session.system_prompt) == (turn.session.head_id, turn.session.system_prompt):
                turn = replace(turn, session=session)
            else:
                turn = self._read_turn(session_id, text, max_tokens, turn.settings)
            seq, info = self._cache.open(session, read, turn.prompt, turn.cut)
            job.remote = info.remote_read
            return turn.prompt, seq

        def keep(job: Job) -> SavedReply | list[SavedReply]:
            out = []
            for alt, branch in enumerate(branches or [turn.session]):
                one = saved if saved is not None else SavedReply()
                seq = job.seqs[alt] if job.seqs else self._cache.seq(session_id)
                if store and seq is not None:
                    self._store_turn(branch, turn, text, seq, job, alt, one)
                else:
                    self._cache.note_prefill(job.stats[alt])
                out.append(one)
            return out if saved is None else saved

        def give_back(job: Job) -> None:
            if not keep_kv:
                self._cache.close(session_id)
                if saved is not None and saved.session is not None:
                    self._cache.close(saved.session.id)

        return Plan(prepare, keep, give_back, order)

    def _store_turn(
        self, branch: Session, turn: _Turn, user_text: str | None, seq: KVSequence, job: Job, alt: int,
        saved: SavedReply,
    ) -> None:
        """Store alternative `alt` of the turn's reply in `branch`, below the head it was computed from
        (`turn`'s), then its KV; `saved` says where they went."""
        reply = reply_message(job, alt)
        asked = [] if user_text is None else [Message(0, None, "user", user_text, None, reply.created, None)]
        self._cache.keep(branch.id, seq)  # the branch's KV from now on
        head = replace(branch, head_id=turn.session.head_id)
        stored, saved.branched = store_reply(self._store, head, asked, reply)
        title = named_by(branch, user_text) if stored.id == branch.id else None
        if title is not None:
            with contextlib.suppress(StoreError):  # the turn is stored; a title is not worth failing it
                self._store.update_session(stored.id, title=title)
                stored = self._store.get_session(stored.id)
        saved.session = stored
        self._cache.note_prefill(job.stats[alt])
        conversation = [*turn.messages, *(template_message(m, self._cache.thinking) for m in [*asked, reply])]
        try:
            # A stopped reply stores the KV it holds: running the rest of a long prompt now would undo the
            # Esc.
            complete = job.stats[alt].stop_reason != "cancelled"
            self._cache.snapshot(stored, seq, conversation, complete)
        except (StoreError, KeyboardInterrupt) as e:  # KV is a cache; a second Ctrl+C may skip it
            saved.kv_skipped = str(e) or "interrupted"
