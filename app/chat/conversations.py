"""Conversations sent whole (OpenAI's way: each request carries its history), replied to and kept.

Its prompt is prefilled into a fresh sequence of the shared block pool, so every full block any
earlier request (or the app, or an earlier process, through the database, or another server, through
the remote tier) computed is reused, not recomputed. When the reply is done the conversation is kept
as a session made by the API — appended to the session where the same history left off, else a new
one — and its KV snapshotted as a session's is. So its blocks outlive the process (and `sessions gc`,
which keeps what sessions use), and the client's next turn after a restart reads them from disk. A
reply not to be stored keeps nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from llama_chat.inference import KVSequence, Model, chat_prompt_ids
from llama_chat.inference.tool_calls import ToolFormat
from llama_chat.storage import ChatStore, Message, Session, StoreError
from llama_chat.storage.records import API_ORIGIN

from .jobs import Job
from .replies import Plan, ReplyNotStored, fitting, make_session, reply_message, store_reply
from .session_cache import SessionCache, kv_salt
from .settings import template_variables
from .titles import TITLE_CHARS, session_title


@dataclass(frozen=True)
class Conversation:
    """A conversation sent whole: its messages (a leading system message is its system prompt), the
    tools offered, and whose it is: a `tenant`'s (and a `cache_key`'s: OpenAI's prompt_cache_key)
    share KV only among themselves (kv_salt), and keep it in sessions of theirs."""

    messages: list[dict]
    tools: list[dict] | None = None
    tenant: str | None = None
    cache_key: str | None = None


@dataclass(frozen=True)
class RawText:
    """A prompt the client wrote whole (OpenAI's legacy Completions): text the model goes on from, with
    no chat template, or its token ids. It shares KV as a Conversation does (same `tenant` and
    `cache_key`), but is never kept: no session holds it, so its blocks stay in RAM only, for the next
    request that begins the same way."""

    prompt: str | list[int]
    tenant: str | None = None
    cache_key: str | None = None


def raw_prompt_ids(model: Model, prompt: str | list[int], limit: int | None = None) -> list[int]:
    """A raw prompt's tokens as llama.cpp's server reads one (tokenize with add_special and
    parse_special): BOS first where the vocabulary asks for it, control-token text as those tokens (the
    client writes its own template); token ids as they are. ValueError names what cannot be used;
    TooManyTokens a text over `limit` tokens, before it is tokenized whole."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_bos=tok.add_bos and tok.bos_id is not None, special=True, limit=limit)
    else:
        ids = list(prompt)
        wrong = next((i for i in ids if not 0 <= i < tok.n_vocab), None)
        if wrong is not None:
            raise ValueError(f"token id {wrong} is not in the vocabulary (0 to {tok.n_vocab - 1})")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """A leading system message becomes the session's system prompt; the rest are its turns."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def title_of(turns: list[dict]) -> str:
    first = next((m["content"] for m in turns if m["role"] == "user"), "")
    return session_title(first)[:TITLE_CHARS].rstrip() or "API chat"


def stored_text(message: dict, fmt: ToolFormat | None) -> str:
    """A message's text as a session keeps it: a reply's tool calls as the model writes them (in the
    template's format `fmt`). (A session keeps text turns; the KV of a conversation with tools is kept
    with it as that conversation's.)"""
    calls = fmt.call_text(message["tool_calls"]) if message.get("tool_calls") and fmt else ""
    return "\n".join(text for text in (message.get("content") or "", calls) if text)


class Conversations:
    def __init__(self, cache: SessionCache, model: Model, store: ChatStore, fmt: ToolFormat | None, closing):
        self.cache, self.model, self.store = cache, model, store
        self.format = fmt  # how the model's chat template writes tool calls (None: it takes none)
        self.closing = closing  # () → whether the engine is closing: a reply cut short by it is kept
        # One thread stores finished conversations in turn (SQLite writes one at a time anyway).
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conversation-writer")

    def plan(self, conversation: Conversation | RawText, settings: dict, store: bool) -> Plan:
        """The plan of replies to a conversation; job.result is the future of the session it is kept in
        (None: not kept; a RawText never is). `settings`: the request's, stored with a new session.
        PromptTooLong, before anything is read or computed, for a prompt that leaves no room for a
        reply (and ValueError for a RawText that is no prompt)."""
        if isinstance(conversation, RawText):
            text = conversation.prompt
            prompt = fitting(self.cache.n_ctx, lambda limit: raw_prompt_ids(self.model, text, limit))
            return self._fresh(prompt, kv_salt(conversation.tenant, conversation.cache_key), self._noted)
        messages, tools, variables = conversation.messages, conversation.tools, template_variables(settings)
        prompt = fitting(
            self.cache.n_ctx,
            lambda n: chat_prompt_ids(self.model, messages, tools=tools, limit=n, variables=variables),
        )
        namespace = kv_salt(conversation.tenant, conversation.cache_key)
        previous = self._previous_ids(messages, prompt, conversation.tools, variables)
        kept = self._kept_session(messages, conversation.tenant, namespace) if previous is not None else None

        def keep(job: Job) -> Future | None:
            self._noted(job)
            ended = job.stats[0].stop_reason in ("eog", "stop", "length")
            # a reply cut short by the engine's closing is kept as it is, as a stopped one (the client
            # is told where); one its client left, or that failed, leaves nothing to continue from
            cut = job.cancelled and self.closing() and job.answered
            if not store or not (ended or cut):
                return None
            return self._keep(conversation, settings, job)

        return self._fresh(prompt, namespace, keep, previous, kept)

    def _fresh(
        self,
        prompt: list[int],
        namespace: bytes | None,
        keep: Callable[[Job], Any],
        previous: list[int] | None = None,
        kept: Session | None = None,
    ) -> Plan:
        """The plan of replies to `prompt` in a fresh sequence of the shared pool (in `namespace`), so
        every full block computed before is reused; a returning conversation (`previous`: its tokens as
        kept after its last reply) takes the tail its `kept` session stored too. keep(job) → job.result,
        where the job made replies."""
        base: list[KVSequence] = []
        # here, not in prepare: a slow store holds up this request only, not the scheduler's thread;
        # as the scheduler's reuse_prefix takes the prompt, with the tail the session cache restores next
        session_id = kept.id if kept else None
        remote = self.cache.read_remote(prompt[:-1], previous, session_id, namespace)

        def prepare(job: Job) -> tuple[list[int], KVSequence]:
            base.append(self.cache.open_fresh(namespace, previous, kept, remote))
            job.remote = remote
            return prompt, base[0]

        def give_back(job: Job) -> None:
            for seq in {id(s): s for s in [*base, *job.seqs]}.values():
                seq.free()

        return Plan(prepare, keep, give_back)

    def _noted(self, job: Job) -> None:
        self.cache.note_prefill(job.stats[0])

    def _previous_ids(
        self, messages: list[dict], prompt: list[int], tools: list[dict] | None, variables: dict
    ) -> list[int] | None:
        """The conversation before its new message as it was kept after its last reply, where the prompt
        goes on from it; None for a first message."""
        if len(split_system(messages)[1]) < 2:
            return None  # a first message: no reply before it
        previous = self.cache.stored_ids(messages[:-1], tools, variables)
        return previous if prompt[: len(previous)] == previous else None

    def _kept_session(
        self, messages: list[dict], tenant: str | None, namespace: bytes | None
    ) -> Session | None:
        """The API session a returning conversation was kept in after its last reply (its tail, the KV
        after its last full block, is stored with it), if it is here. (Full blocks are shared by
        content; a tail by the tokens it ends, or another server's through the remote tier.)"""
        system, turns = split_system(messages)
        try:
            return self.store.session_ending_with(
                API_ORIGIN,
                system,
                [(m["role"], stored_text(m, self.format)) for m in turns[:-1]],
                tenant,
                namespace,
            )
        except StoreError:  # the tail is only a cache: computing it is the way back
            return None

    def _keep(self, conversation: Conversation, settings: dict, job: Job) -> Future:
        """On the scheduler thread, which holds the pool: the KV of the conversation and its reply
        (alternative 0) is brought up to its stored form and held; storing it, and the messages, is
        left to the writer thread, so the replies streaming meanwhile do not wait on SQLite. Returns
        the future of the session they go in (None: not stored)."""
        reply, messages = reply_message(job), conversation.messages
        answer = {"role": "assistant", "content": reply.content}
        if conversation.tools and self.format is not None:  # as the next request sends it back
            answer = self.format.as_message(reply.content)
        if reply.reasoning and self.cache.thinking is not None:  # the KV holds it: as the template renders it
            answer[self.cache.thinking.message_key] = reply.reasoning
        ids = self.cache.stored_ids([*messages, answer], conversation.tools, template_variables(settings))
        # a reply cut short keeps the KV it holds, as a session's do
        held = self.cache.hold(job.seqs[0], ids, not job.cancelled)
        return self.writer.submit(self._store, messages, settings, reply, held, conversation.tenant)

    def _store(
        self, messages: list[dict], settings: dict, reply: Message, held: KVSequence, tenant: str | None
    ) -> Session:
        """The conversation and its reply stored — appended to the API session where the same history
        left off, else in a new one (with the request's settings), in one transaction — then its KV. A
        failure is said on stderr and raises ReplyNotStored: the client still gets its reply."""
        system, turns = split_system(messages)
        asked = [
            Message(0, None, m["role"], stored_text(m, self.format), None, reply.created, None) for m in turns
        ]
        new = partial(make_session, self.store, self.model, title_of(turns), system, settings,
                      origin=API_ORIGIN, tenant=tenant, namespace=held.namespace)  # fmt: skip
        history = [(m["role"], stored_text(m, self.format)) for m in turns[:-1]]
        try:
            session = self.store.session_ending_with(API_ORIGIN, system, history, tenant, held.namespace)
            if session is None:
                stored, _ = store_reply(self.store, lambda turn: new(turn=turn), asked, reply)
            else:
                stored, _ = store_reply(self.store, session, asked[-1:], reply)
        except StoreError as e:
            with self.cache.lock:
                held.free()
            e = e if isinstance(e, ReplyNotStored) else ReplyNotStored(e)
            print(f"llama-chat serve: a conversation was not stored: {e.cause}", file=sys.stderr)
            raise e from None
        try:
            self.cache.store(stored.id, held, travels=True)  # computed here, in the tenant's namespace
        except StoreError as e:
            print(f"llama-chat serve: a conversation's KV was not stored: {e}", file=sys.stderr)
        return stored

    def close(self) -> None:
        """Wait for what the writer has left to store."""
        self.writer.shutdown(wait=True)
