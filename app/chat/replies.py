"""What every reply shares, a session's turn or a conversation sent whole: the plan a job is made
from, the message a reply is stored as (and a stored one as a chat template reads it), the one way a
session is made (new, or forked before a message) and a reply stored, and why a reply was refused or
not stored."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llama_chat.inference import GenerationStats, KVSequence, Model
from llama_chat.inference.errors import ContextFullError, TooManyTokens
from llama_chat.inference.thinking import ThinkingFormat
from llama_chat.storage.db import StoreError
from llama_chat.storage.store import ChatStore, Message, Session

from .jobs import Job
from .titles import NEW_CHAT, session_title


class ReplyNotStored(StoreError):
    """A reply was made but could not be stored (the disk is full, …): whoever made it still has it."""

    def __init__(self, e: StoreError):
        super().__init__(f"the reply was not stored: {e}", e.brief, e.full)
        self.cause = e


class PromptTooLong(ContextFullError):
    """A prompt that leaves no room for a reply in the context window; prompt_tokens None: tokenizing
    it stopped once it reached n_ctx tokens."""

    def __init__(self, prompt_tokens: int | None, n_ctx: int):
        size = f"{n_ctx:,} tokens or more" if prompt_tokens is None else f"{prompt_tokens:,} tokens"
        super().__init__(f"the prompt is {size}; the context window holds {n_ctx:,} (--ctx)")
        self.prompt_tokens, self.n_ctx = prompt_tokens, n_ctx


def check_fits(prompt: list[int], n_ctx: int) -> None:
    """Refuse a prompt that leaves no room for a reply, before anything is stored or computed."""
    if len(prompt) >= n_ctx:
        raise PromptTooLong(len(prompt), n_ctx)


def fitting(n_ctx: int, tokenize: Callable[[int], list[int]]) -> list[int]:
    """The prompt tokenize(limit) makes, or PromptTooLong when it leaves no room for a reply: found out
    before a much longer one is tokenized whole (tokenizing stops past `limit`: Tokenizer.encode)."""
    try:
        prompt = tokenize(n_ctx - 1)
    except TooManyTokens:
        raise PromptTooLong(None, n_ctx) from None
    check_fits(prompt, n_ctx)
    return prompt


@dataclass
class SavedReply:
    """Where a session's reply was stored: its job's result, filled in when it ends."""

    session: Session | None = None  # the session ending with the reply; None: not stored (an error says why)
    branched: bool = False  # the session had moved on meanwhile: the reply went on a new branch of it
    kv_skipped: str | None = None  # why the KV snapshot was not stored (it is recomputed when needed)


@dataclass
class Plan:
    """A reply as the scheduler runs it, a session's turn or a conversation sent whole: prepare(job) →
    (prompt, sequence) when its job is admitted; keep(job) → job.result where the job made replies
    (however short: a cancel, a failure); give_back(job) however it ended: the KV it does not keep."""

    prepare: Callable[[Job], tuple[list[int], KVSequence]]
    keep: Callable[[Job], Any]
    give_back: Callable[[Job], None]
    session_id: str | None = None  # the jobs of one session run one after another

    def finish(self, job: Job) -> Any:
        """The job's end, on the scheduler's thread (which holds the pool): what it made kept, then
        what it held given back, whatever keeping it raised."""
        try:
            return self.keep(job) if job.has_reply else None
        finally:
            self.give_back(job)


def system_message(system_prompt: str | None) -> list[dict]:
    """A system prompt as the first message of a conversation, if there is one."""
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def template_message(message: Message, thinking: ThinkingFormat | None) -> dict:
    """A stored message as a chat template reads it: a reply's thinking where the template looks for
    it (it keeps or drops it, as its model was trained: Qwen3's keeps the last reply's only)."""
    out = {"role": message.role, "content": message.content}
    if message.reasoning and thinking is not None:
        out[thinking.message_key] = message.reasoning
    return out


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


def reply_message(job: Job, alt: int = 0) -> Message:
    """Alternative `alt` of a job's replies, as it is stored: its answer, and its thinking apart."""
    stats = job.stats[alt]
    thinking = job.thinking(alt) or None
    stored = reply_stats(stats)
    return Message(0, None, "assistant", job.text(alt), stats.token_ids, time.time(), stored, thinking)



def fork_before(store: ChatStore, session: Session, message: Message, title: str | None = None) -> Session:
    """A new session on `session`'s tree that ends just before `message` (empty, before the first)."""
    branch = store.fork_session(session.id, message.id, title)
    store.set_head(branch.id, message.parent_id)
    return store.get_session(branch.id)


def make_session(
    store: ChatStore,
    model: Model | None,
    title: str = NEW_CHAT,
    system_prompt: str | None = None,
    sampling: dict | None = None,
    *,
    origin: str | None = None,
    tenant: str | None = None,
    namespace: bytes | None = None,
    turn: Sequence[Message] = (),
) -> Session:
    """The one way a session is made: its title as stored, the model it is made with (None: none is
    loaded yet), its system prompt (None: none) and settings, who made it (`origin`: None, a
    person) and whose it is (`tenant`, its KV in `namespace`); with a first `turn`, in one transaction."""
    return store.create_session(
        session_title(title) or NEW_CHAT,
        model_fingerprint=model.fingerprint if model is not None else None,
        model_name=model.name if model is not None else None,
        system_prompt=system_prompt,
        sampling=sampling,
        origin=origin,
        tenant=tenant,
        kv_namespace=namespace,
        turn=list(turn),
    )


def store_reply(
    store: ChatStore,
    where: Session | Callable[[list[Message]], Session],
    asked: list[Message],
    reply: Message,
) -> tuple[Session, bool]:
    """The one place a reply is stored, with the messages it answers, in one transaction: below the head
    the session `where` had when the reply was computed — on a new branch when the session moved on
    meanwhile (another process replied in it: then True) — or as the first turn of the session `where`
    makes of them. ReplyNotStored says why it could not be."""
    try:
        if isinstance(where, Session):
            return store.append_turn(where.id, where.head_id, [*asked, reply])
        return where([*asked, reply]), False
    except StoreError as e:
        raise ReplyNotStored(e) from None
