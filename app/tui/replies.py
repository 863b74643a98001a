"""A reply the screen asked for, asked of the chat engine's verbs (reply, regenerate, edit).

The screen makes a `Reply` on the UI thread, with its cancel and the queue the job's events go to (the
scheduler's thread only puts them there); `submit` then runs on a worker thread, since it writes the
store (a new chat, a branch) and waits for the engine's lock. The screen takes the events off the
queue as it draws, never waiting for them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from llama_chat.inference import ModelError
from llama_chat.storage import Message, Session, StoreError

from ..chat.engine import ChatEngine, SavedReply
from ..chat.jobs import Event, JobView
from ..config import ConfigError
from .widgets import MessageView

USER_ERRORS = (ModelError, StoreError, ConfigError, ValueError, OSError)


def error_text(error: BaseException) -> str:
    """An error as the user reads it: one the user can cause says what happened; a bug names itself."""
    return str(error) if isinstance(error, USER_ERRORS) else f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Branch:
    """Where a reply goes: its session (made now when it is a new chat or a new branch), the messages
    it follows, and the user's new text (stored with the reply)."""

    session: Session
    path: list[Message]
    user_text: str | None


@dataclass(eq=False)
class Reply:
    """A reply to ask for: to the user's new `text` in `session` (None: a new chat, made with
    `new_chat`), to its last message (no text), again (`regenerate`: n replies in sibling branches),
    or to an `edited` message of the user (a sibling branch with the new text)."""

    session: Session | None
    text: str | None = None
    max_tokens: int = 512
    new_chat: dict = field(default_factory=dict)  # title, system_prompt, sampling
    regenerate: Message | None = None  # the reply to write again
    edited: Message | None = None  # the message the text replaces
    n: int = 1
    view: MessageView | None = None  # the message it streams into; None: shown once its branch is
    cancel: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    job: JobView | None = None  # once submitted
    started: bool = False  # submitted, and its branch (if it makes one) is on screen

    def take_events(self) -> list[Event]:
        """Every event the job told since the last time (never waits)."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out


def submit(engine: ChatEngine | None, reply: Reply) -> Branch | None:
    """On a worker thread: submit the reply's job, after making the branch it goes to; where it goes
    (None for several alternatives: each has its own branch, known when they end)."""
    if engine is None:
        raise ModelError("no model is loaded (Ctrl+L chooses one)")
    options = dict(max_tokens=reply.max_tokens, cancel=reply.cancel, on_event=reply.events.put)
    if reply.regenerate is not None:  # one job of n replies, decoded together, each in its branch
        branches, reply.job = engine.regenerate(reply.session, reply.n, reply_id=reply.regenerate.id, **options)
        if reply.n > 1:
            return None
        branch = branches[0]
    elif reply.edited is not None:
        branch, reply.job = engine.edit(reply.session, reply.edited.id, reply.text, **options)
    else:
        branch = reply.session or engine.new_session(**reply.new_chat)
        reply.job = engine.reply(branch, reply.text, **options)
    return Branch(branch, engine.store.path(branch.head_id), reply.text)


def saved_replies(reply: Reply) -> list[SavedReply]:
    """Where the reply's job stored what it made, one per alternative (none: it stored nothing)."""
    result = reply.job.result
    return [] if result is None else result if isinstance(result, list) else [result]
