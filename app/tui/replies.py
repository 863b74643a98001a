"""Replies as jobs: what the screen asks for, the state a reply is in, and the events it renders.

The screen submits a `ReplyJob` and renders the events it tells, never waiting for them; until the
chat layer's scheduler runs jobs, each runs here on a thread of its own, through the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from llama_chat.inference import GenerationStats, ModelError
from llama_chat.storage import Message, Session, StoreError

from ..config import ConfigError
from ..engine import ChatEngine

USER_ERRORS = (ModelError, StoreError, ConfigError, ValueError, OSError)


def error_text(error: Exception) -> str:
    """An error as the user reads it: one the user can cause says what happened; a bug names itself."""
    return str(error) if isinstance(error, USER_ERRORS) else f"{type(error).__name__}: {error}"


class State(Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


ENDED = (State.DONE, State.CANCELLED, State.FAILED)


@dataclass(frozen=True)
class Prefill:
    """How much of the prompt has been read."""

    done: int
    total: int


@dataclass(frozen=True)
class Branch:
    """The session the reply goes to is known: the messages before it, and the user's new text."""

    session: Session
    path: list[Message]
    user_text: str | None


@dataclass(frozen=True)
class Piece:
    text: str
    context: int  # tokens of the context filled so far, the reply included


@dataclass(frozen=True)
class Stored:
    """A reply ended (also when stopped) and is stored: its session and the path that ends with it."""

    session: Session
    path: list[Message]

    @property
    def stats(self) -> dict:
        return self.path[-1].stats or {}


@dataclass(frozen=True)
class Failed:
    error: str
    session: Session | None  # where what was stored is, if the reply got that far


Event = Prefill | Branch | Piece | Stored | Failed


@dataclass(eq=False)
class ReplyJob:
    """A reply to ask for: to the user's new `text` in `session` (None: a new chat, made with
    `new_chat`), to its last message (no text), again (`regenerate`: n replies in sibling branches),
    or to an `edited` message (a sibling branch with the new text)."""

    session: Session | None
    text: str | None = None
    max_tokens: int = 512
    new_chat: dict = field(default_factory=dict)  # title, system_prompt, sampling
    regenerate: Message | None = None  # the reply to write again
    edited: Message | None = None  # the message the text replaces
    n: int = 1
    state: State = State.QUEUED
    cancel: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def take_events(self) -> list[Event]:
        """Every event told so far (never waits)."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out


def start(engine: ChatEngine, job: ReplyJob) -> None:
    threading.Thread(target=run, args=(engine, job), name="reply", daemon=True).start()


def run(engine: ChatEngine, job: ReplyJob) -> None:
    """Run a job to its end, telling its events; whatever happens, it ends in an ended state."""
    tell = job.events.put
    stats = GenerationStats()
    branch: Session | None = None

    def prefilled(done: int, total: int) -> None:
        job.state = State.PREFILLING if done < total else State.DECODING
        tell(Prefill(done, total))

    options = dict(max_tokens=job.max_tokens, cancel=job.cancel, on_prefill=prefilled)
    try:
        if engine is None:
            raise ModelError("no model is loaded (Ctrl+L chooses one)")
        if job.n > 1:  # decoded together: the engine tells no piece before the end
            for branch, _ in engine.regenerate(job.session, n=job.n, **options):
                tell(Stored(branch, engine.store.path(branch.head_id)))
        else:
            branch, before, pieces = begin(engine, job, stats=stats, **options)
            tell(Branch(branch, before, job.text))
            for piece in pieces:
                job.state = State.DECODING
                tell(Piece(piece, stats.prompt_tokens + stats.generated_tokens))
            branch = engine.store.get_session(branch.id)  # its head is the reply now
            tell(Stored(branch, engine.store.path(branch.head_id)))
    except Exception as e:  # a bug, too, ends the job: the screen gets its input back and says why
        job.state = State.FAILED
        tell(Failed(error_text(e), branch))
    else:
        job.state = State.CANCELLED if job.cancel.is_set() else State.DONE


def begin(engine: ChatEngine, job: ReplyJob, **options) -> tuple[Session, list[Message], Iterator[str]]:
    """A single reply: the session it goes to (made now when it is new), the messages before it, and
    its pieces as they are written."""
    store = engine.store
    if job.edited is not None:
        branch, pieces = engine.edit(job.session, job.edited.id, job.text, **options)
        return branch, store.path(job.edited.parent_id), pieces
    if job.regenerate is not None:
        branch = engine.fork(job.session, job.regenerate.parent_id, f"{job.session.title} (regenerated)")
    else:
        branch = job.session or engine.new_session(**job.new_chat)
    return branch, store.path(branch.head_id), engine.reply(branch, job.text, **options)
