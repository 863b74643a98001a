"""The replies the chat screen asks for, asked of the chat engine's verbs (reply, regenerate, edit).

The chat's `ReplyFlow` makes a `Reply` on the UI thread, with its cancel and the queue the job's
events go to (the scheduler's thread only puts them there); `submit` then runs on a worker thread,
since it writes the store (a new chat, a branch) and waits for the engine's lock. The flow takes the
events off the queue as the screen draws, never waiting for them, and offers alternatives at the end.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import TYPE_CHECKING

from textual.timer import Timer

from llama_chat.inference import ModelError
from llama_chat.storage import Message, Session, StoreError

from ..chat.attachments import Attachment, with_attachments
from ..chat.sessions import Sessions
from ..chat.titles import title_from_text
from ..config import ConfigError, UserConfig
from .dialogs import AlternativesScreen
from .open_chat import OpenChat
from .sidebar import BRANCH_WORDS
from .widgets import ChatInput, MessageView, speed_text

if TYPE_CHECKING:  # (the engine loads with the model, after the window is drawn)
    from ..chat.engine import ChatEngine, SavedReply
    from ..chat.jobs import Event, JobView

FLUSH_S = 0.05  # a streamed reply reaches the screen in batches this far apart

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
    moved: bool = False  # nothing asked: another process wrote in the session since it was shown


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
    typed: tuple[str, list[Attachment]] | None = None  # what the user sent, given back if it is not
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


def submit(engine: ChatEngine | None, sessions: Sessions, reply: Reply) -> Branch | None:
    """On a worker thread: submit the reply's job, after making the branch it goes to; where it goes
    (None for several alternatives: each has its own branch, known when they end)."""
    if engine is None:
        raise ModelError("no model is loaded (Ctrl+L chooses one)")
    options = dict(max_tokens=reply.max_tokens, cancel=reply.cancel, on_event=reply.events.put)
    if reply.regenerate is not None:  # one job of n replies, decoded together, each in its branch
        branches, reply.job = engine.regenerate(
            reply.session, reply.n, reply_id=reply.regenerate.id, **options
        )
        if reply.n > 1:
            return None
        branch = branches[0]
    elif reply.edited is not None:
        branch, reply.job = engine.edit(reply.session, reply.edited.id, reply.text, **options)
    else:
        branch = reply.session or engine.new_session(**reply.new_chat)
        stored = sessions.get(branch.id)
        if stored.head_id != branch.head_id:  # the reply would follow turns the user has not seen
            return Branch(stored, sessions.messages(stored), reply.text, moved=True)
        reply.job = engine.reply(branch, reply.text, **options)
    return Branch(branch, sessions.messages(branch), reply.text)


def saved_replies(reply: Reply) -> list[SavedReply]:
    """Where the reply's job stored what it made, one per alternative (none: it stored nothing)."""
    result = reply.job.result
    return [] if result is None else result if isinstance(result, list) else [result]


REPLYING = "writing a reply (Esc stops)"


def work_label(reply: Reply) -> str:
    return REPLYING if reply.n == 1 else f"writing {reply.n} alternatives (Esc stops)"


class ReplyFlow:
    """The chat's replies, from the ask to what was stored: one at a time, each submitted from a
    worker (`run`), its job's events drawn every FLUSH_S into the open chat; `on_stored` hears of each
    stored reply (the tool calls it makes are asked about there)."""

    def __init__(
        self,
        chat: OpenChat,
        config: UserConfig,
        chat_input: ChatInput,
        on_stored: Callable[[Session, list[Message]], None],
    ):
        self.chat, self.model, self.run = chat, chat.model, chat.run
        self.config, self.chat_input, self.on_stored = config, chat_input, on_stored
        self.running: list[Reply] = []  # replies being written
        self.alternatives: list[tuple[Session, str]] = []  # replies written side by side, offered at the end
        self.attached: list[Attachment] = []  # files for the next message (F5)
        self._drawing: Timer | None = None

    def can_start(self, what: str) -> bool:
        """One reply at a time; say why not, rather than queue silently. A model load is waited for."""
        if self.running:
            self.chat.notify(f"A reply is being written; Esc stops it, then {what}.", severity="warning")
            return False
        if self.model.loading and what == "change the model":
            self.chat.notify(f"Busy: {self.model.loading}. Wait for it, then {what}.", severity="warning")
            return False
        return True

    def can_reply(self, what: str = "send") -> bool:
        if not self.can_start(what):
            return False
        if self.model.loading is None and self.model.engine is None:
            self.chat.notify("No model is loaded: Ctrl+L chooses one.", severity="error")
            return False
        return True

    def max_tokens(self, session: Session | None) -> int:
        return int((session.sampling if session else {}).get("max_tokens") or self.config.max_tokens)

    async def send(self, text: str) -> None:
        """Send the message; an empty one answers a message of yours left without a reply."""
        session = self.chat.session
        if not self.can_reply():
            return
        if text.strip():
            self.chat_input.clear()
            typed = (text, self.attached)
            text, self.attached = with_attachments(text, self.attached), []
            reply = Reply(session, text, self.max_tokens(session), typed=typed)
            config = self.config
            title = title_from_text(text)
            reply.new_chat = {
                "title": title, "system_prompt": config.system_prompt, "sampling": dict(config.sampling)
            } | self.chat.draft
            sent = [MessageView("user", text)]
        else:
            last = self.chat.conversation.last()
            if session is None or last is None or last.role != "user":
                return
            reply, sent = Reply(session, None, self.max_tokens(session)), []
        reply.view = MessageView("assistant")
        await self.chat.conversation.add(*sent, reply.view)
        self.submit(reply)

    def submit(self, reply: Reply) -> None:
        """Start a reply (it waits for a model being loaded): it is asked of the engine from a worker,
        and its job's events are drawn every FLUSH_S until it ends."""
        self.running.append(reply)
        if reply.view is not None:
            waiting = "waiting for the model" if self.model.loading else "reading the conversation…"
            reply.view.set_note(waiting)
        if not self.model.loading:  # else the load's progress stays on the status line until it is done
            self.start(reply)
        self.draw(True)

    def draw(self, on: bool) -> None:
        """Draw the replies' events every FLUSH_S (or stop, once none is written)."""
        if self._drawing is None:
            self._drawing = self.chat.conversation.set_interval(FLUSH_S, self.render, pause=True)
        if on:
            self._drawing.resume()
        else:
            self._drawing.pause()

    def start_waiting(self) -> None:
        """The model has loaded (or did not load): the replies sent meanwhile start (or fail)."""
        for reply in self.running:
            self.start(reply)

    def start(self, reply: Reply) -> None:
        status = self.chat.status
        status.set(work=work_label(reply))
        if reply.n > 1:  # no text streams before the end: a bar says it works
            status.progress(work_label(reply))
        self.run(
            partial(submit, self.model.engine, self.chat.sessions, reply),
            partial(self.reply_started, reply),
            failed=partial(self.reply_refused, reply),
        )

    async def reply_started(self, reply: Reply, branch: Branch | None) -> None:
        """The job is submitted: show the new branch it goes to, or adopt a new chat."""
        chat = self.chat
        if branch is not None and branch.moved:
            return await self.overtaken(reply, branch)
        if branch is not None and reply.view is None:  # its messages, the new text, the reply to come
            await chat.show(branch.session, branch.path)
            reply.view = MessageView("assistant")
            sent = [MessageView("user", branch.user_text)] if branch.user_text is not None else []
            await chat.conversation.add(*sent, reply.view)
            self.chat_input.focus()  # the message it was made from is gone with the old view
        elif branch is not None and (chat.session is None or chat.session.id != branch.session.id):
            chat.opened(branch.session)  # a new chat, stored now
            await chat.conversation.show_system_prompt(branch.session.system_prompt)
        if reply.view is not None:
            reply.view.set_note("reading the conversation…")
        reply.started = True

    async def overtaken(self, reply: Reply, branch: Branch) -> None:
        """Another process wrote in the chat since it was shown: nothing was asked; the chat is shown
        as stored, and the message sent is back in the input (its files attached again)."""
        await self.chat.show(branch.session, branch.path)
        if reply.typed is not None:
            text, attached = reply.typed
            self.attached = attached + self.attached
            self.chat_input.load_text(text + self.chat_input.text)
            self.chat_input.move_cursor(self.chat_input.document.end)
        self.chat.notify(
            "Another window wrote in this chat: its messages are shown now. Your message is back in "
            "the input; Enter sends it after them.",
            title="Not sent",
            severity="warning",
            timeout=10,
        )
        self.reply_done(reply)

    async def reply_refused(self, reply: Reply, error: str) -> None:
        """The job could not be submitted (an empty message, one longer than the context, no model)."""
        if reply.view is not None and not reply.view.content:
            await reply.view.remove()
        self.chat.notify(error, title="No reply", severity="error", timeout=10)
        self.reply_done(reply)

    async def render(self) -> None:
        """Draw what each reply's job told since the last time: its text in one piece, the newest
        progress of its prompt, its end."""
        for reply in list(self.running):
            if not reply.started:
                continue
            for kind, events in groupby(reply.take_events(), lambda event: event.kind):
                events = list(events)
                if kind == "text":
                    await self.show_text(reply, "".join(e.text for e in events if e.alt == 0))
                elif kind == "thinking":
                    await self.show_text(reply, "".join(e.text for e in events if e.alt == 0), thinking=True)
                elif kind == "prefill":
                    self.show_prefill(reply, events[-1])
                elif kind == "end":
                    await self.reply_ended(reply)

    def show_prefill(self, reply: Reply, event: Event) -> None:
        """How far a long prompt has been read, as a bar; then back to the work that follows."""
        self.chat.status.progress("reading the conversation", event.done, event.total)
        if event.done >= event.total:
            self.chat.status.progress(work_label(reply))

    async def show_text(self, reply: Reply, text: str, thinking: bool = False) -> None:
        view = reply.view
        if not text or view is None:  # (alternatives show when all are written)
            return
        if view.note and view.note != "stopped":
            view.set_note("")
            self.chat.status.done()  # the prefill's bar, if the prompt was long
            self.chat.status.set(work=REPLYING)
        stats = reply.job.stats[0]
        self.chat.show_context(stats.prompt_tokens + stats.generated_tokens)
        await (view.append_thinking(text) if thinking else view.append(text))

    async def reply_ended(self, reply: Reply) -> None:
        """The job ended: what it made is stored (also when stopped, and as far as it got when it failed)."""
        job = reply.job
        if reply.view is not None:
            await reply.view.finish()
        if job.error is not None:
            self.chat.notify(error_text(job.error), title="No reply", severity="error", timeout=10)
        saved = saved_replies(reply)
        if reply.n > 1:
            self.alternatives += [(s.session, job.text(i)) for i, s in enumerate(saved) if s.session]
            return self.reply_done(reply)
        stored = saved[0].session if saved else None
        if saved and saved[0].branched:
            self.say_branched(reply, stored)
        if job.error is None and stored is not None:
            self.run(
                partial(self.chat.sessions.messages, stored),
                partial(self.reply_stored, reply, stored),
                failed=lambda error: self.reply_done(reply),
            )
            return
        session = stored or self.chat.session
        if session is not None:
            self.chat.switch_to(session.id)  # show what was stored
        elif reply.view is not None and not reply.view.content:
            await reply.view.remove()
        self.reply_done(reply)

    def say_branched(self, reply: Reply, branch: Session) -> None:
        """The reply went on a new branch: another process stored a turn in its chat meanwhile. The
        branch is named as the sidebar lists it, under its chat: by its first own words."""
        words = title_from_text(reply.text or reply.job.text(0), BRANCH_WORDS)
        chat = (reply.session or branch).title
        self.chat.notify(
            f"Another window replied in “{chat}” while this reply was written: yours is on a new "
            f"branch of it, “{words}”.",
            title="A new branch",
            severity="warning",
            timeout=15,
        )

    async def reply_stored(self, reply: Reply, session: Session, path: list[Message]) -> None:
        """The stored reply: its message ids to the messages shown (or the conversation drawn again,
        if what is stored differs), its speed and the context it filled."""
        stats = (path[-1].stats or {}) if path else {}
        if self.chat.conversation.adopt(path):
            reply.view.set_note("stopped" if stats.get("stop_reason") == "cancelled" else "")
            self.chat.opened(session)
        else:  # another process's turn came in before this one was asked
            await self.chat.show(session, path)
            self.chat.notify("Another window wrote in this chat: it is shown as stored.", timeout=8)
        self.chat.status.set(speed=speed_text(stats))
        self.chat.show_context(stats.get("prompt_tokens", 0) + stats.get("generated_tokens", 0))
        self.reply_done(reply)
        self.on_stored(session, path)

    def reply_done(self, reply: Reply) -> None:
        if reply in self.running:
            self.running.remove(reply)
        if self.running:
            return
        self.draw(False)
        self.chat.status.done()
        if self.alternatives:
            alternatives = [(session.id, text) for session, text in self.alternatives]
            self.alternatives = []
            self.chat.show_chats()
            self.chat.ask(AlternativesScreen(alternatives), self.open_picked)

    def open_picked(self, session_id: str | None) -> None:
        if session_id:
            self.chat.switch_to(session_id)

    def stop(self) -> bool:
        """Esc: stop the replies at once (what was written is kept); False when none was being written."""
        for reply in self.running:
            reply.cancel.set()
            if reply.view is not None:
                reply.view.set_note("stopped")
        return bool(self.running)

    async def stop_and_wait(self) -> None:
        """Stop every reply and wait (without holding the screen) until what each wrote is stored; one
        waiting for a model being loaded is not written at all."""
        for reply in self.running:
            reply.cancel.set()

        def running(reply: Reply) -> bool:
            return not reply.job.state.ended if reply.job else self.model.loading is None

        while any(running(reply) for reply in self.running):
            await asyncio.sleep(0.02)
