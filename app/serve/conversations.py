"""Replies for clients of the server, as jobs on the one scheduler every client shares.

Two kinds of request:
- a conversation sent whole (OpenAI's way: each request carries its history). Its prompt is prefilled
  into a fresh sequence of the shared block pool, so every full block any earlier request (or the TUI,
  or an earlier process, through the database, or another server, through the remote tier) computed
  is reused, not recomputed. When the reply is
  done the conversation is kept as a session made by the API — appended to the session where the
  same history left off, else a new one — and its KV snapshotted as the TUI's is. So its blocks
  outlive the process (and `sessions gc`, which keeps what sessions use), and the client's next turn
  after a restart reads them from disk. A request with `"store": false` keeps nothing.
- a turn of a stored session: the chat engine's own reply, resumed from RAM, stored blocks and the
  session's stored tail, so only the new turn is computed.

No HTTP here: the server's routes (app.py) parse requests and render the jobs' events.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from llama_chat.inference import KVSequence, chat_prompt_ids
from llama_chat.storage import Message, Session, StoreError

from ..chat.engine import ChatEngine, ReplyNotStored, reply_stats, session_title
from ..chat.jobs import Event, Job
from ..chat.settings import max_tokens as longest

API_ORIGIN = "api"  # sessions.origin of the conversations this server keeps
TITLE_CHARS = 48


def kv_salt(tenant: str | None, cache_key: str | None = None) -> bytes | None:
    """The KV namespace of a tenant's requests (vLLM's cache_salt), narrowed by a prompt_cache_key: no
    block, in RAM or stored, is shared across two, so no cached_tokens tell of another's prompts. None,
    without either: the blocks every session shares (and the remote tier, which only those reach)."""
    if tenant is None and cache_key is None:
        return None
    return hashlib.sha256(json.dumps(["llama-chat kv salt", tenant, cache_key]).encode()).digest()[:16]


def split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """A leading system message becomes the session's system prompt; the rest are its turns."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def title_of(turns: list[dict]) -> str:
    first = next((m["content"] for m in turns if m["role"] == "user"), "")
    return session_title(first)[:TITLE_CHARS].rstrip() or "API chat"


class Conversations:
    def __init__(self, engine: ChatEngine):
        self.engine = engine
        self.model = engine.model
        # One thread stores finished conversations in turn (SQLite writes one at a time anyway).
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conversation-writer")
        self._turns: dict[str, int] = {}  # a stored session's turns submitted and not ended yet
        self._turns_changed = threading.Condition()

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt of a conversation sent whole, as the model's chat template renders it."""
        return chat_prompt_ids(self.model, messages, tools=tools)

    def submit(
        self,
        messages: list[dict],
        prompt: list[int],
        *,
        n: int,
        sampling: dict,
        max_tokens: int | None,
        stop: list[str],
        store: bool,
        on_event: Callable[[Event], None],
        grammar: str | None = None,
        logprobs: int | None = None,
        tenant: str | None = None,
        cache_key: str | None = None,
    ) -> Job:
        """A conversation sent whole: n replies to its prompt, in one job; job.result is the future of
        the session it is kept in (None: not kept). A `grammar` (inference.constrain) shapes the replies;
        `logprobs` notes each token's log-probability (and the n likeliest) in the job's stats. A
        `tenant`'s (and a `cache_key`'s: OpenAI's prompt_cache_key) share KV only among themselves
        (kv_salt), and keep it in sessions of theirs."""
        engine = self.engine
        base: list[KVSequence] = []
        namespace = kv_salt(tenant, cache_key)
        previous = self._previous_ids(messages, prompt)
        kept = self._kept_session(messages, tenant, namespace) if previous is not None else None
        # here, not in prepare: a slow store holds up this request only, not the scheduler's thread;
        # as the scheduler's reuse_prefix takes the prompt, with the tail restore_tail asks for next
        remote = None
        if namespace is None:  # (a namespace's KV never travels, as an import's does not)
            remote = engine.read_remote(prompt[:-1], tail_of=previous, session_id=kept.id if kept else None)

        def prepare() -> tuple[list[int], KVSequence]:
            seq = self.model.new_sequence(engine.n_ctx, namespace=namespace)
            base.append(seq)
            job.remote = remote
            if previous is not None:  # a returning conversation takes the tail its last reply left too
                seq.reuse_prefix(previous)
                engine.restore_tail(kept, seq, previous)
            return prompt, seq

        def finish(job: Job) -> Future | None:
            engine.note_prefill(job.stats[0])
            ended = job.stats[0].stop_reason in ("eog", "stop", "length")
            # a reply cut short by the server's closing is kept as it is, as a stopped one (the client
            # is told where); one its client left, or that failed, leaves nothing to continue from
            cut = job.cancelled and engine.scheduler.closed and job.answered
            if not store or not (ended or cut):
                return None
            return self._keep(messages, sampling, job, tenant)

        def on_end(event: Event) -> None:
            if event.kind == "end":  # on the scheduler thread, which holds the pool: give the KV back
                for seq in {id(s): s for s in [*base, *event.job.seqs]}.values():
                    seq.free()
            on_event(event)

        job = Job(
            prepare,
            n=n,
            sampling=replace(engine.sampling_for(sampling), grammar=grammar, logprobs=logprobs),
            max_tokens=engine.n_ctx if max_tokens is None else max_tokens,
            stop=stop,
            finish=finish,
            on_event=on_end,
        )
        return engine.scheduler.submit(job)  # `job` is bound before prepare can run

    def _previous_ids(self, messages: list[dict], prompt: list[int]) -> list[int] | None:
        """The conversation before its new message as it was kept after its last reply, where the prompt
        goes on from it; None for a first message."""
        if len(split_system(messages)[1]) < 2:
            return None  # a first message: no reply before it
        previous = self.engine.window_ids(messages[:-1])
        return previous if prompt[: len(previous)] == previous else None

    def _kept_session(self, messages: list[dict], tenant: str | None, namespace: bytes | None) -> Session | None:
        """The API session a returning conversation was kept in after its last reply (its tail, the KV
        after its last full block, is stored with it), if it is here. (Full blocks are shared by
        content; a tail by the tokens it ends, or another server's through the remote tier.)"""
        system, turns = split_system(messages)
        try:
            return self.engine.store.session_ending_with(
                API_ORIGIN, system, [(m["role"], m["content"]) for m in turns[:-1]], tenant, namespace
            )
        except StoreError:  # the tail is only a cache: computing it is the way back
            return None

    def _keep(self, messages: list[dict], sampling: dict, job: Job, tenant: str | None) -> Future:
        """On the scheduler thread, which holds the pool: the KV of the conversation and its reply
        (alternative 0) is brought up to its stored form and held; storing it, and the messages, is
        left to the writer thread, so the replies streaming meanwhile do not wait on SQLite. Returns
        the future of the session they go in (None: not stored)."""
        stats = job.stats[0]
        reply = Message(0, None, "assistant", job.text(0), stats.token_ids, time.time(), reply_stats(stats))
        conversation = [*messages, {"role": "assistant", "content": reply.content}]
        # a reply cut short keeps the KV it holds, as the chat engine's do
        held = self.engine.hold_kv(job.seqs[0], self.engine.window_ids(conversation), not job.cancelled)
        return self.writer.submit(self._store, messages, sampling, reply, held, tenant)

    def _store(
        self, messages: list[dict], sampling: dict, reply: Message, held: KVSequence, tenant: str | None
    ) -> Session:
        """The conversation and its reply stored — appended to the API session where the same history
        left off, else in a new one (with the request's sampling settings), in one transaction — then
        its KV. A failure is said on stderr and raises ReplyNotStored: the client still gets its reply."""
        store = self.engine.store
        system, turns = split_system(messages)
        asked = [Message(0, None, m["role"], m["content"], None, reply.created, None) for m in turns]
        try:
            history = [(m["role"], m["content"]) for m in turns[:-1]]
            session = store.session_ending_with(API_ORIGIN, system, history, tenant, held.namespace)
            if session is None:
                stored = store.create_session(
                    title_of(turns),
                    model_fingerprint=self.model.fingerprint,
                    model_name=self.model.name,
                    system_prompt=system,
                    sampling=sampling,
                    origin=API_ORIGIN,
                    turn=[*asked, reply],
                    tenant=tenant,
                    kv_namespace=held.namespace,
                )
            else:
                stored, _ = store.append_turn(session.id, session.head_id, [asked[-1], reply])
        except StoreError as e:
            with self.engine.lock:
                held.free()
            print(f"llama-chat serve: a conversation was not stored: {e}", file=sys.stderr)
            raise ReplyNotStored(e) from None
        try:
            self.engine.store_kv(stored.id, held)
        except StoreError as e:
            print(f"llama-chat serve: a conversation's KV was not stored: {e}", file=sys.stderr)
        return stored

    def close(self) -> None:
        """Wait for what the writer has left to store."""
        self.writer.shutdown(wait=True)

    def submit_turn(
        self,
        session: Session,
        text: str,
        *,
        sampling: dict,
        max_tokens: int | None,
        stop: list[str],
        store: bool,
        on_event: Callable[[Event], None],
    ) -> Job:
        """The next turn of a stored session, as long as the request or else the session's settings allow;
        job.result is a SavedReply (where it was stored; not `store`: nowhere). It waits in the
        scheduler's queue with every other reply, behind the session's earlier turns; cancelled before
        its first token (its client left), it stores nothing. The session's KV stays in RAM only as
        cached blocks once it ended, so that no session holds the pool: the next turn takes them back
        (or reads them from the database)."""
        engine = self.engine

        def on_end(event: Event) -> None:
            if event.kind == "end":  # on the scheduler thread, which holds the pool
                saved = event.job.result
                engine.close(session.id)
                if saved is not None and saved.session is not None:
                    engine.close(saved.session.id)
                if isinstance(event.job.error, ReplyNotStored):  # the client still gets the reply
                    print(f"llama-chat serve: session {session.id}: {event.job.error}", file=sys.stderr)
                self._count_turn(session.id, -1)
            on_event(event)

        self._count_turn(session.id, +1)
        try:
            return engine.submit_reply(
                session,
                text,
                sampling=engine.sampling_for({**session.sampling, **sampling}),
                max_tokens=longest(session.sampling, engine.n_ctx) if max_tokens is None else max_tokens,
                stop=stop,
                on_event=on_end,
                store=store,
                drop_unanswered=True,
            )
        except BaseException:
            self._count_turn(session.id, -1)
            raise

    def _count_turn(self, session_id: str, change: int) -> None:
        with self._turns_changed:
            left = self._turns.get(session_id, 0) + change
            if left:
                self._turns[session_id] = left
            else:
                self._turns.pop(session_id, None)
                self._turns_changed.notify_all()

    def wait_for_turns(self, session_id: str) -> None:
        """Until no turn of the session waits or runs: a delete comes after the turn being stored."""
        with self._turns_changed:
            self._turns_changed.wait_for(lambda: session_id not in self._turns)
