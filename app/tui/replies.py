"""A reply the screen asked for, submitted as a job to the chat layer's scheduler.

The screen makes a `Reply` on the UI thread, with its cancel and the queue the job's events go to (the
scheduler's thread only puts them there); `submit` then runs on a worker thread, since it writes the
store (a new chat, a branch) and waits for the scheduler's lock. The screen takes the events off the
queue as it draws, never waiting for them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from llama_chat.inference import ModelError
from llama_chat.storage import Message, Session, StoreError
from llama_chat.storage.store import marked_title

from ..chat.engine import ChatEngine, fork_before
from ..chat.jobs import Event, Job
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
    job: Job | None = None  # once submitted
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
    if reply.n > 1:  # one job of n replies, decoded together
        reply.job = engine.submit_regenerate(reply.session, reply.n, **options)
        return None
    store = engine.store
    if reply.edited is not None:
        branch = fork_before(store, reply.session, reply.edited, marked_title(reply.session.title, "(edited)"))
        before = store.path(reply.edited.parent_id)
    else:
        if reply.regenerate is not None:
            title = marked_title(reply.session.title, "(regenerated)")
            branch = engine.fork(reply.session, reply.regenerate.parent_id, title)
        else:
            branch = reply.session or engine.new_session(**reply.new_chat)
        before = store.path(branch.head_id)
    reply.job = engine.submit_reply(branch, reply.text, **options)
    return Branch(branch, before, reply.text)
