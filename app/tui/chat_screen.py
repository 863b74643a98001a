"""The chat screen: the sidebar, the conversation, the input and the status line.

The UI thread only draws. A reply is a job of the chat layer's scheduler (app/chat/): the screen
submits it (from a worker: that writes the store) and, every FLUSH_S while one runs, draws the events
its job told, so a reply streams into a Markdown stream in batches and the whole message is never
re-rendered per token. What reads or writes the store, or loads the model, runs in a thread worker
that hands its result back to the UI thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from itertools import groupby
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as UIMessage
from textual.screen import Screen
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from llama_chat.storage import ChatStore, Message, Session

from ..chat.attachments import Attachment, with_attachments
from ..chat.engine import ChatEngine, load_chat_model, title_from_text
from ..chat.jobs import Event
from ..config import UserConfig
from . import replies
from .actions import ChatActions
from .conversation import ConversationView
from .dialogs import AlternativesScreen
from .mcp_calls import ToolCalls
from .replies import USER_ERRORS, Branch, Reply, error_text
from .sidebar import Sidebar
from .widgets import (
    ChatInput,
    MessageView,
    Progress,
    StatusLine,
    model_label,
    resume_text,
    speed_text,
)

FLUSH_S = 0.05  # a streamed reply reaches the screen in batches this far apart
REPLYING = "writing a reply (Esc stops)"


def work_label(reply: Reply) -> str:
    return REPLYING if reply.n == 1 else f"writing {reply.n} alternatives (Esc stops)"


# -- what workers tell the screen ------------------------------------------------------------------


class ModelReady(UIMessage):
    def __init__(self, error: str | None = None):
        super().__init__()
        self.error = error


class Resumed(UIMessage):
    def __init__(self, session_id: str, text: str, tokens: int):
        super().__init__()
        self.session_id, self.text, self.tokens = session_id, text, tokens


class ChatScreen(ChatActions, Screen):
    # Textual focuses this when the screen is first shown (else the first focusable: the sidebar's
    # search box, which took what was typed while the app started)
    AUTO_FOCUS = "ChatInput"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]  # narrow: the sidebar hides (the .tcss)
    # Every action of the chat, once: its key (users remap it by id, the action's name), the footer,
    # the help screen and, by its tooltip, the command palette all come from here.
    BINDINGS = [
        Binding(key, action, title, id=action, show=show, priority=key != "escape", tooltip=tooltip)
        for key, action, title, show, tooltip in [
            ("ctrl+n", "new_chat", "New", True, "Start a new chat"),
            ("ctrl+o", "fork", "Fork", True, "Fork this chat (or at the selected message) into a new branch"),
            (
                "ctrl+r",
                "regenerate",
                "Regenerate",
                True,
                "A new reply to the last (or selected) one, in a branch",
            ),
            ("ctrl+t", "regenerate_three", "Regenerate ×3", False, "Three replies at once, each in a branch"),
            ("escape", "stop", "Stop reply", False, "Stop the reply being written, keeping what it wrote"),
            ("ctrl+f", "search", "Search chats", False, "Search titles and messages"),
            ("ctrl+b", "toggle_sidebar", "Sidebar", False, "Show or hide the list of chats"),
            ("f6", "toggle_api_chats", "API chats", False, "Show or hide the chats made through llama-chat serve"),
            ("f2", "rename", "Rename chat", False, "Give this chat a new title"),
            ("f8", "delete", "Delete chat", False, "Delete this chat (asks first)"),
            ("ctrl+s", "settings", "Settings", True, "System prompt and sampling (temperature, top-k, …)"),
            ("ctrl+l", "choose_model", "Choose model", False, "Load another model"),
            ("f3", "export", "Export chat", False, "Write this chat to a .llamachat (or .md) file"),
            ("f4", "import", "Import chat", False, "Add the chat(s) of a .llamachat file"),
            ("f5", "attach", "Attach file", False, "Attach a text file to your next message"),
            ("f1", "help", "Help", True, "Every key, and how to change them"),
        ]
    ]

    def __init__(self, model: str | None, session_id: str | None):
        super().__init__()
        self.model_name = model  # a known name or a path; None: the default model
        self.wanted_session = session_id
        self.engine: ChatEngine | None = None
        self.loading_model: str | None = "loading the model"  # while a model loads, replies wait for it
        self.session: Session | None = None  # None: a new chat, stored when its first message is sent
        self.replies: list[Reply] = []  # replies being written
        self.alternatives: list[tuple[Session, str]] = []  # replies written side by side, offered at the end
        self.attached: list[Attachment] = []  # files for the next message (F5)
        self.tool_calls = ToolCalls(self)  # MCP servers, and the calls a reply makes

    @property
    def store(self) -> ChatStore:
        return self.app.store

    @property
    def config(self) -> UserConfig:
        return self.app.config

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    @property
    def conversation(self) -> ConversationView:
        return self.query_one(ConversationView)

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one(Sidebar)

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield ConversationView(id="conversation")
                yield ChatInput(id="input")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        self.conversation.anchor()
        self.status.progress("opening conversations")
        self.flush_timer = self.set_interval(FLUSH_S, self.render_replies, pause=True)
        self.in_background(self.last_session, self.started)

    # -- work off the UI thread ------------------------------------------------------------------

    @work(thread=True, exit_on_error=False, group="store")
    def in_background(
        self,
        task: Callable,
        then: Callable | None = None,
        title: str | None = None,
        failed: Callable[[str], object] | None = None,
    ) -> None:
        """Run `task` on a worker thread (it reads or writes the store, or waits for the model) and
        hand what it returns to `then` on the UI thread; an error the user can cause goes to `failed`
        there, else becomes a notice."""
        try:
            result = task()
        except USER_ERRORS as e:
            if failed is not None:
                self.app.call_from_thread(failed, str(e))
            else:
                self.notify(str(e), title=title, severity="error", timeout=10)
            return
        if then is not None:
            self.app.call_from_thread(then, result)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A bug in a worker: say so, and keep the app usable (the conversation is stored as it goes)."""
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            self.notify(f"{type(error).__name__}: {error}", title="Something went wrong", severity="error")

    def progress_reporter(self) -> Callable[[str, int, int], None]:
        """A progress(label, done, total) callback for a worker: the status bar, at most 10 times a second."""
        last = [0.0]

        def report(label: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or (total and done >= total):
                last[0] = now
                self.post_message(Progress(label, done, total))

        return report

    def on_progress(self, event: Progress) -> None:
        self.status.progress(event.label, event.done, event.total)

    def on_work_done(self) -> None:
        self.status.done()

    # -- startup, model --------------------------------------------------------------------------

    def last_session(self) -> tuple[Session | None, list[Message]]:
        """The chat to open first: the one asked for, else the one open last time, else the newest."""
        sessions = self.store.list_sessions()
        wanted = self.wanted_session or self.app.state.last_session(self.store.db_path)
        session = next((s for s in sessions if s.id == wanted), sessions[0] if sessions else None)
        return session, self.store.path(session.head_id) if session else []

    async def started(self, opened: tuple[Session | None, list[Message]]) -> None:
        """The last conversation is on screen: now load the model (and resume it on the model)."""
        await self.show_session(*opened)
        self.load_engine(self.model_name)

    @work(thread=True, exit_on_error=False, group="model")
    def load_engine(self, name: str | None, remember: bool = False) -> None:
        """Load a model, with progress; then resume the open session on it. `remember`: open it next time too."""
        self.post_message(Progress(f"loading {Path(name).name if name else 'the default model'}"))
        try:
            model = load_chat_model(
                name,
                self.progress_reporter(),
                cache_ram_mb=self.app.cache_ram_mb,
                prompt_lookup=self.app.prompt_lookup,
            )
            engine = ChatEngine(model, self.store, n_ctx=self.config.n_ctx, remote=self.app.remote(model.fingerprint))
        except Exception as e:  # a bug, too: replies must not wait for this model forever
            self.post_message(ModelReady(error_text(e)))
            return
        old, self.engine = self.engine, engine
        if old is not None:  # its KV goes with it; no reply runs on it (none starts while a model loads)
            old.scheduler.close()
            with old.lock:
                for session_id in list(old.live):
                    old.close(session_id)
        self.model_name = name
        if self.session is not None:
            self.open_in_engine(self.session)
        self.post_message(ModelReady())
        self.tool_calls.offer(engine)  # after: a server slow to start holds up no reply
        if remember:
            try:
                self.config.save_setting("model", name)
            except USER_ERRORS as e:
                self.notify(str(e), title="Not kept for the next start", severity="error")

    def on_model_ready(self, event: ModelReady) -> None:
        """The model is loaded (or did not load): replies sent meanwhile start (or fail)."""
        self.loading_model = None
        self.status.done()
        if event.error:
            self.status.set(
                model=model_label(self.engine.model) if self.engine else f"no model: {event.error}"
            )
            self.notify(event.error, title="The model did not load", severity="error", timeout=10)
        else:
            self.status.set(model=model_label(self.engine.model))
            self.show_context(self.session.n_tokens if self.session else 0)
        for reply in self.replies:  # (sent while it loaded: no reply starts while a model loads)
            self.start(reply)

    # -- sessions --------------------------------------------------------------------------------

    def open_in_engine(self, session: Session) -> None:
        """On a worker thread: bring a session's KV back (RAM, stored blocks, tail) and say how; other
        sessions let go."""
        engine = self.engine
        if engine is None:
            return
        session = self.store.get_session(session.id)
        read = engine.prefetch(session)  # before the lock: a slow store holds up no reply being decoded
        with engine.lock:
            for other in list(engine.live):
                if other != session.id:
                    engine.close(other)
            _, info = engine.open(session, read)
        self.post_message(Resumed(session.id, resume_text(info), info.tokens))

    def resume(self, session: Session) -> None:
        """Resume a session on the model, unless one is loading (it resumes the open session itself)."""
        if self.loading_model is None and self.engine is not None:
            self.in_background(partial(self.open_in_engine, session))

    def on_resumed(self, event: Resumed) -> None:
        if self.session is not None and event.session_id == self.session.id:
            self.status.set(resumed=event.text)
            self.show_context(event.tokens)

    async def show_session(self, session: Session | None, path: list[Message]) -> None:
        """Draw a whole conversation (on switching, forking, branching); replies stream in afterwards."""
        self.session = session
        await self.conversation.show(session, path)
        last_reply = next((m for m in reversed(path) if m.role == "assistant" and m.stats), None)
        self.status.set(speed=speed_text(last_reply.stats if last_reply else {}), resumed=None)
        self.show_context(session.n_tokens if session else 0)
        self.opened(session)

    def opened(self, session: Session | None) -> None:
        """The chat shown is `session` (a new chat once stored): its title, the sidebar, the next start."""
        self.session = session
        self.app.title = f"llama-chat · {session.title}" if session else "llama-chat"
        self.sidebar.show_chats(session.id if session else None)
        self.app.state.remember_session(self.store.db_path, session.id if session else None)

    def show_message(self, message_id: int) -> None:
        if not self.conversation.show_message(message_id):  # among the earliest of a very long chat
            self.notify("That message is further back than the chat shows; Export chat shows it all.")

    def show_context(self, tokens: int) -> None:
        if self.engine is not None:
            self.status.set(context=f"ctx {tokens:,}/{self.engine.n_ctx:,}")

    # -- replies ---------------------------------------------------------------------------------

    def can_start(self, what: str) -> bool:
        """One reply at a time; say why not, rather than queue silently. A model load is waited for."""
        if self.replies:
            self.notify(f"A reply is being written; Esc stops it, then {what}.", severity="warning")
            return False
        if self.loading_model and what == "change the model":
            self.notify(f"Busy: {self.loading_model}. Wait for it, then {what}.", severity="warning")
            return False
        return True

    def can_reply(self, what: str = "send") -> bool:
        if not self.can_start(what):
            return False
        if self.loading_model is None and self.engine is None:
            self.notify("No model is loaded: Ctrl+L chooses one.", severity="error")
            return False
        return True

    def max_tokens(self, session: Session | None) -> int:
        return int((session.sampling if session else {}).get("max_tokens") or self.config.max_tokens)

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        """Send the message; an empty one answers a message of yours left without a reply."""
        text, session = event.text, self.session
        if not self.can_reply():
            return
        if text.strip():
            self.query_one(ChatInput).clear()
            text, self.attached = with_attachments(text, self.attached), []
            reply = Reply(session, text, self.max_tokens(session))
            reply.new_chat = dict(
                title=title_from_text(text),
                system_prompt=self.config.system_prompt,
                sampling=dict(self.config.sampling),
            )
            sent = [MessageView("user", text)]
        else:
            last = self.conversation.last()
            if session is None or last is None or last.role != "user":
                return
            reply, sent = Reply(session, None, self.max_tokens(session)), []
        reply.view = MessageView("assistant")
        await self.conversation.add(*sent, reply.view)
        self.submit(reply)

    def submit(self, reply: Reply) -> None:
        """Start a reply (it waits for a model being loaded): its job goes to the scheduler from a
        worker, and its events are drawn every FLUSH_S until it ends."""
        self.replies.append(reply)
        if reply.view is not None:
            reply.view.set_note(
                "waiting for the model" if self.loading_model else "reading the conversation…"
            )
        if not self.loading_model:  # else the load's progress stays on the status line until it is done
            self.start(reply)
        self.flush_timer.resume()

    def start(self, reply: Reply) -> None:
        self.status.set(work=work_label(reply))
        if reply.n > 1:  # no text streams before the end: a bar says it works
            self.status.progress(work_label(reply))
        self.in_background(
            partial(replies.submit, self.engine, reply),
            partial(self.reply_started, reply),
            failed=partial(self.reply_refused, reply),
        )

    async def reply_started(self, reply: Reply, branch: Branch | None) -> None:
        """The job is submitted: show the new branch it goes to, or adopt a new chat."""
        if branch is not None and reply.view is None:  # its messages, the new text, the reply to come
            await self.show_session(branch.session, branch.path)
            reply.view = MessageView("assistant")
            sent = [MessageView("user", branch.user_text)] if branch.user_text is not None else []
            await self.conversation.add(*sent, reply.view)
            self.query_one(ChatInput).focus()  # the message it was made from is gone with the old view
        elif branch is not None and (self.session is None or self.session.id != branch.session.id):
            self.opened(branch.session)  # a new chat, stored now
        if reply.view is not None:
            reply.view.set_note("reading the conversation…")
        reply.started = True

    async def reply_refused(self, reply: Reply, error: str) -> None:
        """The job could not be submitted (an empty message, one longer than the context, no model)."""
        if reply.view is not None and not reply.view.content:
            await reply.view.remove()
        self.notify(error, title="No reply", severity="error", timeout=10)
        self.reply_done(reply)

    async def render_replies(self) -> None:
        """Draw what each reply's job told since the last time: its text in one piece, the newest
        progress of its prompt, its end."""
        for reply in list(self.replies):
            if not reply.started:
                continue
            for kind, events in groupby(reply.take_events(), lambda event: event.kind):
                events = list(events)
                if kind == "text":
                    await self.show_text(reply, "".join(e.text for e in events if e.alt == 0))
                elif kind == "prefill":
                    self.show_prefill(reply, events[-1])
                elif kind == "end":
                    await self.reply_ended(reply)

    def show_prefill(self, reply: Reply, event: Event) -> None:
        """How far a long prompt has been read, as a bar; then back to the work that follows."""
        self.status.progress("reading the conversation", event.done, event.total)
        if event.done >= event.total:
            self.status.progress(work_label(reply))

    async def show_text(self, reply: Reply, text: str) -> None:
        view = reply.view
        if not text or view is None:  # (alternatives show when all are written)
            return
        if view.note and view.note != "stopped":
            view.set_note("")
            self.status.done()  # the prefill's bar, if the prompt was long
            self.status.set(work=REPLYING)
        stats = reply.job.stats[0]
        self.show_context(stats.prompt_tokens + stats.generated_tokens)
        await view.append(text)

    async def reply_ended(self, reply: Reply) -> None:
        """The job ended: what it made is stored (also when stopped, and as far as it got when it failed)."""
        job = reply.job
        if reply.view is not None:
            await reply.view.finish()
        if job.error is not None:
            self.notify(error_text(job.error), title="No reply", severity="error", timeout=10)
        if reply.n > 1:
            self.alternatives += job.result or []
            return self.reply_done(reply)
        stored = job.result.session if job.result else None
        if job.error is None and stored is not None:
            self.in_background(
                partial(self.store.path, stored.head_id),
                partial(self.reply_stored, reply, stored),
                failed=lambda error: self.reply_done(reply),
            )
            return
        session = stored or self.session
        if session is not None:
            self.switch_to(session.id)  # show what was stored
        elif reply.view is not None and not reply.view.content:
            await reply.view.remove()
        self.reply_done(reply)

    async def reply_stored(self, reply: Reply, session: Session, path: list[Message]) -> None:
        """The stored reply: its message ids to the messages shown (or the conversation drawn again,
        if what is stored differs), its speed and the context it filled."""
        stats = (path[-1].stats or {}) if path else {}
        if self.conversation.adopt(path):
            reply.view.set_note("stopped" if stats.get("stop_reason") == "cancelled" else "")
            self.opened(session)
        else:
            await self.show_session(session, path)
        self.status.set(speed=speed_text(stats))
        self.show_context(stats.get("prompt_tokens", 0) + stats.get("generated_tokens", 0))
        self.reply_done(reply)
        self.tool_calls.after_reply(session, path)

    def reply_done(self, reply: Reply) -> None:
        if reply in self.replies:
            self.replies.remove(reply)
        if self.replies:
            return
        self.flush_timer.pause()
        self.status.done()
        if self.alternatives:
            alternatives = [(session.id, text) for session, text in self.alternatives]
            self.alternatives = []
            self.sidebar.show_chats(self.session.id if self.session else None)
            self.app.push_screen(AlternativesScreen(alternatives), self.open_picked)

    def open_picked(self, session_id: str | None) -> None:
        if session_id:
            self.switch_to(session_id)

    def on_unmount(self) -> None:
        self.tool_calls.close()

    def action_stop(self) -> None:
        """Esc: stop the replies at once (what was written is kept), else leave the search or a message."""
        if self.replies:
            for reply in self.replies:
                reply.cancel.set()
                if reply.view is not None:
                    reply.view.set_note("stopped")
            return
        self.sidebar.leave_search()
        self.query_one(ChatInput).focus()

    async def stop_replies(self) -> None:
        """Stop every reply and wait (without holding the screen) until what each wrote is stored; one
        waiting for a model being loaded is not written at all."""
        for reply in self.replies:
            reply.cancel.set()

        def running(reply: Reply) -> bool:
            return not reply.job.state.ended if reply.job else self.loading_model is None

        while any(running(reply) for reply in self.replies):
            await asyncio.sleep(0.02)

    @on(ChatInput.LeaveUp)
    def focus_last_message(self) -> None:
        self.conversation.focus_last()
