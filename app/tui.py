"""The Textual chat app: conversations as a tree, the chat as Markdown, a fork key, automatic sessions.

The UI thread only draws. Everything that touches the model or SQLite runs in thread workers, which
report back with messages (posting is thread-safe) or `call_from_thread`; a reply streams in batches
of about 50 ms into a Markdown stream, so the whole message is never re-rendered per token.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message as UIMessage
from textual.screen import Screen
from textual.widgets import Footer, Input, Static, Tree
from textual.worker import Worker, WorkerState

from llama_chat.inference import KNOWN_MODELS, GenerationStats, Model, ModelError, load_model, resolve_model
from llama_chat.inference.catalog import model_status
from llama_chat.storage import ChatStore, Message, Session, StoreError

from .chat.engine import ChatEngine, ResumeInfo, fork_before, session_title
from .chat.settings import CACHE_RAM_MB
from .config import DEFAULT_THEME, Config, ConfigError, State, load_themes
from .screens import AlternativesScreen, ConfirmScreen, HelpScreen, ModelScreen, SettingsScreen, TextScreen
from .widgets import ChatInput, ChatRef, MessageView, SearchHit, SessionTree, StatusLine

FLUSH_S = 0.05  # a streamed reply reaches the screen in batches this far apart
SEARCH_DELAY_S = 0.2  # wait for typing to pause before searching
# Drawing a message costs about 2 ms of the UI thread (Markdown widgets): a very long conversation
# shows its newest messages only, so opening it never holds the screen for long.
MAX_SHOWN = 100
USER_ERRORS = (ModelError, StoreError, ConfigError, ValueError, OSError)
REPLYING = "writing a reply (Esc stops)"


def title_for(text: str) -> str:
    """A chat's title from its first message: one line, single spaces, no space left at the cut."""
    return session_title(text)[:48].rstrip() or "New chat"


def context_used(stats: GenerationStats) -> int:
    """Tokens of the context a reply has filled so far: its prompt and what it wrote."""
    return stats.prompt_tokens + stats.generated_tokens


def model_label(model: Model) -> str:
    """The model as it was chosen: its file's stem, which for a known model is its short name. The
    GGUF's own general.name can describe another build ("… AWQ" on the default Q4_K_M file)."""
    return model.path.stem


def branch_points(store: ChatStore, sessions: list[Session]) -> dict[str, int]:
    """For each fork among `sessions`: how many messages it shares with the session it came from."""
    by_id = {s.id: s for s in sessions}
    paths: dict[str, list[int]] = {}

    def path(session: Session) -> list[int]:
        if session.id not in paths:
            paths[session.id] = [m.id for m in store.path(session.head_id)]
        return paths[session.id]

    points = {}
    for s in sessions:
        parent = by_id.get(s.forked_from)
        if parent is not None:
            pairs = list(zip(path(s), path(parent)))
            points[s.id] = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    return points


def speed_text(prefill_tok_s: float, decode_tok_s: float, drafted: int = 0, accepted: int = 0) -> str | None:
    """The last reply's speeds and, when prompt lookup guessed, how many guessed tokens were kept; a
    part that did not run (a reply stopped while it read) is left out."""
    parts = [f"prefill {prefill_tok_s:,.0f}"] if prefill_tok_s else []
    parts += [f"decode {decode_tok_s:,.1f}"] if decode_tok_s else []
    text = " · ".join(parts) + " tok/s" if parts else None
    return f"{text} · lookup {accepted}/{drafted}" if text and drafted else text


NEW_CHAT_HINT = "A new chat: it is saved as you go. Ctrl+O forks it, F1 lists every key, Ctrl+P every action."


def resume_text(info: ResumeInfo) -> str:
    """How a session came back: "2,048 tokens restored in 38 ms" (or "… of …" when some were not)."""
    if info.restored != info.tokens:
        return info.describe()
    return f"{info.tokens:,} tokens restored in {info.seconds * 1000:.0f} ms"


COMMANDS = [  # (title, help, action): the command palette's entries for the chat
    ("New chat", "Start a new conversation", "new_chat"),
    ("Fork", "Fork this conversation (or at the selected message) into a new branch", "fork"),
    ("Regenerate", "A new reply to the last (or selected) message, in a sibling branch", "regenerate"),
    ("Regenerate ×3", "Three alternative replies at once, each in its own branch", "regenerate_three"),
    ("Edit message", "Edit the selected (or your last) message, in a new branch", "edit_last"),
    ("Stop reply", "Stop the reply being written, keeping what it wrote", "stop"),
    ("Rename chat", "Give this conversation a new title", "rename"),
    ("Delete chat", "Delete this conversation (asks first)", "delete"),
    ("Chat settings", "System prompt and sampling (temperature, top-k, …) of this chat", "settings"),
    ("Choose model", "Load another model", "choose_model"),
    ("Search chats", "Search titles and messages", "search"),
    ("Copy message", "Copy the selected (or last) reply", "copy_reply"),
    ("Copy code block", "Copy a code block of the selected (or last) reply", "copy_code"),
    ("Export chat", "Write this conversation to a .llamachat file (or .md: a transcript)", "export"),
    ("Import chat", "Add the conversation(s) of a .llamachat file", "import"),
    ("Help", "Every key, and how to change them", "help"),
]


# -- what workers tell the screen ------------------------------------------------------------------


class Progress(UIMessage):
    def __init__(self, label: str, done: float | None = None, total: float | None = None):
        super().__init__()
        self.label, self.done, self.total = label, done, total


class WorkDone(UIMessage):
    """Long work has ended: the bar goes. Posted like Progress, so it cannot overtake the last one."""


class ModelReady(UIMessage):
    def __init__(self, error: str | None = None):
        super().__init__()
        self.error = error


class Chunk(UIMessage):
    def __init__(self, view: MessageView, text: str, tokens: int):
        super().__init__()
        self.view, self.text, self.tokens = view, text, tokens  # tokens: the context, reply so far included


class ReplyDone(UIMessage):
    def __init__(self, view, session, path, stats, error=None):
        super().__init__()
        self.view, self.session, self.path, self.stats, self.error = view, session, path, stats, error


class Resumed(UIMessage):
    def __init__(self, session_id: str, text: str, tokens: int):
        super().__init__()
        self.session_id, self.text, self.tokens = session_id, text, tokens


@dataclass
class Reply:
    cancel: threading.Event
    view: MessageView | None


# A reply starts from `prepare(engine, stats, cancel)`, run in the worker: it returns the session the
# reply goes to, the stream of its pieces, and — when it is a new branch to show — the messages before
# the reply and the user's new text.
Prepare = Callable[
    [ChatEngine, GenerationStats, threading.Event], tuple[Session, Iterator[str], list | None, str | None]
]


class ChatScreen(Screen):
    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New", id="new_chat", priority=True),
        Binding("ctrl+o", "fork", "Fork", id="fork", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate", priority=True),
        Binding(
            "ctrl+t", "regenerate_three", "Regenerate ×3", id="regenerate_three", show=False, priority=True
        ),
        Binding("escape", "stop", "Stop reply", id="stop", show=False),
        Binding("ctrl+f", "search", "Search", id="search", show=False, priority=True),
        Binding("f2", "rename", "Rename", id="rename", show=False),
        Binding("ctrl+s", "settings", "Settings", id="settings", priority=True),
        Binding("ctrl+l", "choose_model", "Model", id="choose_model", show=False, priority=True),
        Binding("f1", "help", "Help", id="help"),
    ]

    def __init__(self, model: str | None, session_id: str | None):
        super().__init__()
        self.model_name = model  # a known name or a path; None: the default model
        self.wanted_session = session_id
        self.engine: ChatEngine | None = None
        self.engine_ready = threading.Event()  # set once a model is loaded (or failed to load)
        self.session: Session | None = None  # None: a new chat, stored when its first message is sent
        self.reply: Reply | None = None
        self.busy: str | None = None  # other engine work running (regenerate ×3, model load)
        self.three_cancel: threading.Event | None = None  # set by Esc to stop regenerate ×3
        self.report_prefill = self.progress_reporter()
        self._search_timer = None

    @property
    def store(self) -> ChatStore:
        return self.app.store

    @property
    def config(self) -> Config:
        return self.app.config

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Input(placeholder="Search chats (Ctrl+F)", id="search")
                yield SessionTree(id="sessions")
            with Vertical(id="chat"):
                yield VerticalScroll(id="conversation")
                yield ChatInput(id="input")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ChatInput).focus()
        self.conversation.anchor()
        self.status.progress("opening conversations")
        self.start()

    # -- startup, model, sessions (workers) ------------------------------------------------------

    @work(thread=True, exit_on_error=False, group="startup")
    def start(self) -> None:
        """Show the last conversation at once, then load the model and resume it."""
        sessions = self.store.list_sessions()
        wanted = self.wanted_session or self.app.state.last_session(self.store.db_path)
        session = next((s for s in sessions if s.id == wanted), sessions[0] if sessions else None)
        path = self.store.path(session.head_id) if session else []
        self.app.call_from_thread(self.show_session, session, path)
        self.load_engine(self.model_name)

    def load_engine(self, name: str | None) -> bool:
        """Load a model (in a worker thread), with progress; then resume the open session on it."""
        self.engine_ready.clear()
        self.post_message(Progress(f"loading {Path(name).name if name else 'the default model'}"))
        try:
            model = load_model(
                name,
                progress=self.progress_reporter(),
                cache_ram_mb=self.app.cache_ram_mb,
                prompt_lookup=self.app.prompt_lookup,
            )
            engine = ChatEngine(model, self.store, n_ctx=self.config.n_ctx)
        except USER_ERRORS as e:
            self.engine_ready.set()  # a waiting reply finds the error
            self.post_message(ModelReady(str(e)))
            return False
        if self.engine is not None:
            with self.engine.lock:  # the old model's KV goes with it
                for session_id in list(self.engine.live):
                    self.engine.close(session_id)
        self.engine = engine
        self.engine_ready.set()
        self.model_name = name
        self.post_message(ModelReady())
        if self.session is not None:
            self.open_in_engine(self.session)
        return True

    def progress_reporter(self) -> Callable[[str, int, int], None]:
        """A progress(label, done, total) callback for a worker: the status bar, at most 10 times a second."""
        last = [0.0]

        def report(label: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or (total and done >= total):
                last[0] = now
                self.post_message(Progress(label, done, total))

        return report

    def prefill_progress(self, done: int, total: int) -> None:
        """From an engine worker: how far a long prompt's prefill is, as a bar in the status line."""
        self.report_prefill("reading the conversation", done, total)
        if done >= total:  # back to the work that follows it
            self.post_message(Progress(f"{self.busy} (Esc stops)" if self.busy else REPLYING))

    def on_model_ready(self, event: ModelReady) -> None:
        self.status.done()
        if self.reply is not None:  # sent while the model loaded
            self.status.set(work=REPLYING)
        if event.error:
            self.status.set(model=model_label(self.engine.model) if self.engine else f"no model: {event.error}")
            self.notify(event.error, title="The model did not load", severity="error", timeout=10)
        else:
            self.status.set(model=model_label(self.engine.model))
            self.show_context(self.session.n_tokens if self.session else 0)

    def on_work_done(self) -> None:
        self.status.done()

    def open_in_engine(self, session: Session) -> None:
        """Bring a session's KV back (RAM, stored blocks, tail) and say how; other sessions let go."""
        engine = self.engine
        if engine is None:
            return
        with engine.lock:
            for other in list(engine.live):
                if other != session.id:
                    engine.close(other)
            _, info = engine.open(self.store.get_session(session.id))
        self.post_message(Resumed(session.id, resume_text(info), info.tokens))

    @work(thread=True, exit_on_error=False, group="engine")
    def switch_to(self, session_id: str, message_id: int | None = None) -> None:
        """Open a session (at one of its messages: a search hit) and resume it."""
        try:
            session = self.store.get_session(session_id)
            path = self.store.path(session.head_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return
        self.app.call_from_thread(self.show_session, session, path)
        if message_id is not None:
            self.app.call_from_thread(self.show_message, message_id)
        if self.engine_ready.is_set():
            self.open_in_engine(session)

    def refresh_sidebar(self) -> None:
        """Redraw the sidebar: every session, or the hits of the search being typed."""
        query = self.query_one("#search", Input).value.strip()
        if query:
            self.search_worker(query)
        else:
            self.sessions_worker()

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def sessions_worker(self) -> None:
        sessions = self.store.list_sessions()
        points = branch_points(self.store, sessions)
        self.app.call_from_thread(self.show_sessions, sessions, points)

    def show_sessions(
        self, sessions: list[Session], points: dict[str, int], hits: dict[str, list[SearchHit]] | None = None
    ) -> None:
        current = self.session.id if self.session else None
        self.query_one(SessionTree).show_sessions(sessions, current, points, hits)

    def show_message(self, message_id: int) -> None:
        """Scroll to a message of the open conversation (a search hit) and select it."""
        view = next((v for v in self.views() if v.message and v.message.id == message_id), None)
        if view is None:  # among the earliest messages of a very long conversation, not drawn
            self.notify("That message is further back than the chat shows; Export chat shows it all.")
            return
        self.conversation.anchor(False)  # stay at the message, not at the end
        view.focus(scroll_visible=False)
        self.call_after_refresh(self.conversation.scroll_to_widget, view, animate=False, top=True)

    # -- showing a conversation ------------------------------------------------------------------

    async def show_session(self, session: Session | None, path: list[Message]) -> None:
        """Draw a whole conversation (on switching, forking, branching); replies stream in afterwards."""
        self.session = session
        conversation = self.conversation
        with self.app.batch_update():
            await conversation.remove_children()
            widgets = []
            if len(path) > MAX_SHOWN:
                hidden = f"⋯ {len(path) - MAX_SHOWN:,} earlier messages (Export chat as .md shows them all)"
                widgets.append(Static(hidden, classes="system-prompt", markup=False))
            if session is not None and session.system_prompt:
                widgets.append(
                    Static(f"system: {session.system_prompt}", classes="system-prompt", markup=False)
                )
            widgets += [self.message_view(m) for m in path[-MAX_SHOWN:]]
            if session is None:
                widgets.append(Static(NEW_CHAT_HINT, classes="system-prompt new-chat-hint", markup=False))
            await conversation.mount_all(widgets)
        conversation.scroll_end(animate=False)
        conversation.anchor()
        last_reply = next((m for m in reversed(path) if m.role == "assistant" and m.stats), None)
        stats = last_reply.stats if last_reply else {}
        speed = speed_text(
            stats.get("prefill_tok_s", 0),
            stats.get("decode_tok_s", 0),
            stats.get("drafted_tokens", 0),
            stats.get("accepted_tokens", 0),
        )
        self.status.set(speed=speed, resumed=None)
        self.show_context(session.n_tokens if session else 0)
        self.app.title = f"llama-chat · {session.title}" if session else "llama-chat"
        self.refresh_sidebar()
        self.app.state.remember_session(self.store.db_path, session.id if session else None)

    @staticmethod
    def message_view(m: Message) -> MessageView:
        return MessageView(m.role, m.content, m, note="stopped" if m.stopped else "")

    def show_context(self, tokens: int) -> None:
        if self.engine is not None:
            self.status.set(context=f"ctx {tokens:,}/{self.engine.n_ctx:,}")

    def views(self) -> list[MessageView]:
        return list(self.conversation.query_children(MessageView))

    def selected(self) -> MessageView | None:
        """The message the user moved to (focused), if any."""
        return self.focused if isinstance(self.focused, MessageView) else None

    def on_progress(self, event: Progress) -> None:
        self.status.progress(event.label, event.done, event.total)

    def on_resumed(self, event: Resumed) -> None:
        if self.session is not None and event.session_id == self.session.id:
            self.status.set(resumed=event.text)
            self.show_context(event.tokens)

    # -- replies ---------------------------------------------------------------------------------

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A bug in a worker: say so, and keep the app usable (the conversation is stored as it goes)."""
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            self.notify(f"{type(error).__name__}: {error}", title="Something went wrong", severity="error")

    def can_start(self, what: str) -> bool:
        """One piece of engine work at a time; say why not, rather than queue silently."""
        if self.reply is not None:
            self.notify(f"A reply is being written; Esc stops it, then {what}.", severity="warning")
            return False
        if self.busy:
            self.notify(f"Busy: {self.busy}. Wait for it, then {what}.", severity="warning")
            return False
        return True

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        text = event.text
        if not self.can_start("send"):
            return
        if self.engine_ready.is_set() and self.engine is None:
            self.notify("No model is loaded: Ctrl+L chooses one.", severity="error")
            return
        max_tokens = self.max_tokens(self.session)
        if not text.strip():
            views = self.views()
            if views and views[-1].role == "user" and self.session is not None:  # no reply yet: write one
                session = self.session
                view = MessageView("assistant")
                await self.conversation.mount(view)
                self.start_reply(
                    lambda engine, stats, cancel: (
                        session,
                        engine.reply(
                            session,
                            None,
                            max_tokens=max_tokens,
                            cancel=cancel,
                            stats=stats,
                            on_prefill=self.prefill_progress,
                        ),
                        None,
                        None,
                    ),
                    view,
                )
            return
        self.query_one(ChatInput).clear()
        await self.conversation.query(".new-chat-hint").remove()
        session = self.session
        config = self.config
        view = MessageView("assistant")
        await self.conversation.mount_all([MessageView("user", text), view])
        self.conversation.anchor()  # follow the reply (opening a search hit let go of the end)

        def prepare(engine: ChatEngine, stats, cancel):
            target = session or engine.new_session(
                title_for(text), config.system_prompt, dict(config.sampling)
            )
            pieces = engine.reply(
                target,
                text,
                max_tokens=max_tokens,
                cancel=cancel,
                stats=stats,
                on_prefill=self.prefill_progress,
            )
            return target, pieces, None, None

        self.start_reply(prepare, view)

    def max_tokens(self, session: Session | None) -> int:
        return int((session.sampling if session else {}).get("max_tokens") or self.config.max_tokens)

    def start_reply(self, prepare: Prepare, view: MessageView | None = None) -> None:
        self.reply = Reply(threading.Event(), view)
        if view is not None:
            view.set_note(
                "reading the conversation…" if self.engine_ready.is_set() else "waiting for the model"
            )
        self.status.set(work=REPLYING)
        self.reply_worker(prepare, self.reply.cancel)

    @work(thread=True, exit_on_error=False, group="reply")
    def reply_worker(self, prepare: Prepare, cancel: threading.Event) -> None:
        self.engine_ready.wait()
        stats = GenerationStats()
        session = view = None
        done = None
        try:
            engine = self.engine
            if engine is None:
                raise ModelError("no model is loaded (Ctrl+L chooses one)")
            session, pieces, before, user_text = prepare(engine, stats, cancel)
            view = self.app.call_from_thread(self.reply_started, session, before, user_text)
            batch, flushed = [], time.monotonic()
            for piece in pieces:
                batch.append(piece)
                if time.monotonic() - flushed >= FLUSH_S:
                    self.post_message(Chunk(view, "".join(batch), context_used(stats)))
                    batch, flushed = [], time.monotonic()
            if batch:
                self.post_message(Chunk(view, "".join(batch), context_used(stats)))
            session = self.store.get_session(session.id)
            done = ReplyDone(view, session, self.store.path(session.head_id), stats)
        except USER_ERRORS as e:
            done = ReplyDone(view, session, None, stats, str(e))
        finally:  # whatever happened, the screen gets its input back (a bug is reported on its own)
            self.post_message(done or ReplyDone(view, session, None, stats, "the reply failed"))

    async def reply_started(self, session: Session, before: list[Message] | None, user_text: str | None):
        """On the UI thread, once the reply's session is known: show a new branch, or adopt a new chat."""
        new_chat = self.session is None or self.session.id != session.id
        if before is not None:
            await self.show_session(session, before)
            widgets = [MessageView("user", user_text)] if user_text is not None else []
            self.reply.view = MessageView("assistant")
            await self.conversation.mount_all([*widgets, self.reply.view])
            self.conversation.scroll_end(animate=False)
        elif new_chat:
            self.session = session
            self.app.title = f"llama-chat · {session.title}"
            self.app.state.remember_session(self.store.db_path, session.id)
            self.refresh_sidebar()
        self.reply.view.set_note("reading the conversation…")
        return self.reply.view

    async def on_chunk(self, event: Chunk) -> None:
        if event.view.note and event.view.note != "stopped":
            event.view.set_note("")
            self.status.done()  # the prefill's bar, if the prompt was long
            self.status.set(work=REPLYING)
        self.show_context(event.tokens)
        await event.view.append(event.text)

    async def on_reply_done(self, event: ReplyDone) -> None:
        view = event.view or (self.reply.view if self.reply else None)
        if view is not None:
            await view.finish()
        self.reply = None
        self.status.done()
        if event.error:
            self.notify(event.error, title="No reply", severity="error", timeout=10)
            session = event.session or self.session
            if session is not None:
                self.switch_to(session.id)  # show what was stored
            elif view is not None and not view.content:
                await view.remove()
            return
        self.session = event.session
        views = self.views()
        shown = event.path[-len(views) :] if views else []
        if [v.role for v in views] == [m.role for m in shown]:
            for v, m in zip(views, shown):
                v.message = m
        else:  # e.g. the stored text differs from what was shown: show what is stored
            await self.show_session(event.session, event.path)
        if view is not None:
            view.set_note("stopped" if event.stats.stop_reason == "cancelled" else "")
        s = event.stats
        self.status.set(speed=speed_text(s.prefill_tok_s, s.decode_tok_s, s.drafted_tokens, s.accepted_tokens))
        self.show_context(context_used(event.stats))
        self.refresh_sidebar()

    def action_stop(self) -> None:
        """Esc: stop the reply at once (what was written is kept), else leave the search or a message."""
        if self.reply is not None:
            self.reply.cancel.set()
            if self.reply.view is not None:
                self.reply.view.set_note("stopped")
            return
        if self.three_cancel is not None:  # the alternatives written so far are kept, in their branches
            self.three_cancel.set()
            return
        search = self.query_one("#search", Input)
        if search.has_focus and search.value:
            search.value = ""
        self.query_one(ChatInput).focus()

    # -- branching -------------------------------------------------------------------------------

    def action_fork(self) -> None:
        """Fork at the head into a new session and open it; at a selected reply, fork after it; at a
        selected message of yours, fork before it with its text in the input, ready to change and send
        (a fork that kept it would end on a question without its answer)."""
        if not self.can_start("fork"):
            return
        if self.session is None or self.session.head_id is None:
            self.notify("Nothing to fork yet: send a message first.", severity="warning")
            return
        view = self.selected()
        self.fork_worker(self.session, view.message if view else None)

    @work(thread=True, exit_on_error=False, group="engine")
    def fork_worker(self, session: Session, at: Message | None) -> None:
        try:
            if at is not None and at.role == "user":
                child, draft = fork_before(self.store, session, at), at.content
                done = "Forked before your message: change it, then Enter sends it"
            else:
                at_id = at.id if at is not None and at.id != session.head_id else None
                if self.engine is not None:
                    child = self.engine.fork(session, at_id)
                else:
                    child = self.store.fork_session(session.id, at_id)
                draft, done = None, "Forked after this reply" if at_id else f"Forked into “{child.title}”"
            path = self.store.path(child.head_id)
        except USER_ERRORS as e:
            self.notify(str(e), severity="error")
            return
        self.app.call_from_thread(self.forked, child, path, draft)
        self.notify(done, timeout=5)
        if self.engine_ready.is_set():
            self.open_in_engine(child)

    async def forked(self, child: Session, path: list[Message], draft: str | None) -> None:
        """Show the new branch; what the user types next goes to the input (with the draft, if any)."""
        await self.show_session(child, path)
        chat_input = self.query_one(ChatInput)
        if draft is not None:
            chat_input.load_text(draft)
            chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()

    def reply_target(self) -> Message | None:
        """The reply to regenerate: the selected one, else the last one."""
        view = self.selected()
        if view is not None and view.role == "assistant" and view.message is not None:
            return view.message
        views = self.views()
        if views and views[-1].role == "assistant" and views[-1].message is not None:
            return views[-1].message
        return None

    def action_regenerate(self) -> None:
        """A new reply in a sibling branch: the old one stays in its own session."""
        if not self.can_start("regenerate"):
            return
        target, session = self.reply_target(), self.session
        if target is None or session is None or target.parent_id is None:
            self.notify("There is no reply to regenerate.", severity="warning")
            return
        max_tokens = self.max_tokens(session)

        def prepare(engine: ChatEngine, stats, cancel):
            branch = engine.fork(session, target.parent_id, f"{session.title} (regenerated)")
            pieces = engine.reply(
                branch,
                None,
                max_tokens=max_tokens,
                cancel=cancel,
                stats=stats,
                on_prefill=self.prefill_progress,
            )
            return branch, pieces, engine.store.path(branch.head_id), None

        self.start_reply(prepare)

    def action_regenerate_three(self) -> None:
        """Three new replies to the last message, decoded together, each in its own branch."""
        if not self.can_start("regenerate"):
            return
        views = self.views()
        if self.session is None or not views or views[-1].role != "assistant" or views[-1].message is None:
            self.notify("Regenerate ×3 needs a conversation that ends with a reply.", severity="warning")
            return
        if not self.engine_ready.is_set() or self.engine is None:
            self.notify("The model is not loaded yet.", severity="warning")
            return
        self.busy = "writing three alternatives"
        self.status.progress("writing three alternatives (Esc stops)")
        self.three_cancel = threading.Event()
        self.three_worker(self.session, self.three_cancel)

    @work(thread=True, exit_on_error=False, group="engine")
    def three_worker(self, session: Session, cancel: threading.Event) -> None:
        results = None
        try:
            results = self.engine.regenerate(
                session,
                n=3,
                max_tokens=self.max_tokens(session),
                cancel=cancel,
                on_prefill=self.prefill_progress,
            )
        except USER_ERRORS as e:
            self.notify(str(e), severity="error")
        finally:
            self.app.call_from_thread(self.three_done, results)

    def three_done(self, results: list[tuple[Session, str]] | None) -> None:
        self.busy = None
        self.three_cancel = None
        self.status.done()
        self.refresh_sidebar()
        if results:
            alternatives = [(s.id, text) for s, text in results]
            self.app.push_screen(AlternativesScreen(alternatives), self.open_picked)

    def open_picked(self, session_id: str | None) -> None:
        if session_id:
            self.switch_to(session_id)

    @on(MessageView.Edit)
    def edit_message(self, event: MessageView.Edit) -> None:
        self.edit(event.view)

    def edit(self, view: MessageView | None) -> None:
        """Edit a past user message: the new text and its reply go in a sibling branch."""
        if not self.can_start("edit"):
            return
        if view is None or view.role != "user" or view.message is None or self.session is None:
            self.notify("Select one of your messages (↑ from the input) to edit it.", severity="warning")
            return
        message, session = view.message, self.session

        def edited(new_text: str | None) -> None:
            if new_text is None or not new_text.strip() or new_text == message.content:
                return
            max_tokens = self.max_tokens(session)

            def prepare(engine: ChatEngine, stats, cancel):
                branch, pieces = engine.edit(
                    session,
                    message.id,
                    new_text,
                    max_tokens=max_tokens,
                    cancel=cancel,
                    stats=stats,
                    on_prefill=self.prefill_progress,
                )
                return branch, pieces, engine.store.path(message.parent_id), new_text

            if self.can_start("edit"):
                self.start_reply(prepare)

        self.app.push_screen(
            TextScreen("Edit message (a new branch)", message.content, multiline=True), edited
        )

    # -- sessions --------------------------------------------------------------------------------

    async def action_new_chat(self) -> None:
        if not self.can_start("start a new chat"):
            return
        await self.show_session(None, [])
        self.query_one(ChatInput).focus()

    @on(Tree.NodeSelected, "#sessions")
    def session_selected(self, event: Tree.NodeSelected) -> None:
        ref: ChatRef | None = event.node.data
        if ref is None:
            return
        if self.session is not None and ref.session_id == self.session.id:
            if ref.message_id is not None:
                self.show_message(ref.message_id)
        elif self.can_start("switch chats"):
            self.switch_to(ref.session_id, ref.message_id)

    def action_rename(self) -> None:
        session = self.session
        if session is None:
            self.notify("This chat has no title yet: send a message first.", severity="warning")
            return

        def renamed(title: str | None) -> None:
            title = session_title(title or "")
            if title and title != session.title:
                self.rename_worker(session.id, title)

        self.app.push_screen(TextScreen("Rename chat", session.title), renamed)

    @work(thread=True, exit_on_error=False, group="engine")
    def rename_worker(self, session_id: str, title: str) -> None:
        self.store.rename_session(session_id, title)
        session = self.store.get_session(session_id)
        self.app.call_from_thread(self.renamed, session)

    def renamed(self, session: Session) -> None:
        if self.session is not None and self.session.id == session.id:
            self.session = session
            self.app.title = f"llama-chat · {session.title}"
        self.refresh_sidebar()

    @on(SessionTree.Delete)
    def delete_from_sidebar(self, event: SessionTree.Delete) -> None:
        self.delete(event.session_id)

    def action_delete(self) -> None:
        if self.session is None:
            self.notify("Nothing to delete: this chat is not saved yet.", severity="warning")
            return
        self.delete(self.session.id)

    def delete(self, session_id: str) -> None:
        if not self.can_start("delete"):
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete_worker(session_id)

        self.delete_prompt_worker(session_id, confirmed)

    @work(thread=True, exit_on_error=False, group="engine")
    def delete_prompt_worker(self, session_id: str, confirmed) -> None:
        try:
            session = self.store.get_session(session_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return
        question = f"Delete “{session.title}”? Messages its forks still reach are kept."
        self.app.call_from_thread(
            lambda: self.app.push_screen(ConfirmScreen("Delete chat", question, yes="Delete"), confirmed)
        )

    @work(thread=True, exit_on_error=False, group="engine")
    def delete_worker(self, session_id: str) -> None:
        try:
            self.store.delete_session(session_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return
        if self.engine is not None:
            with self.engine.lock:
                self.engine.close(session_id)
        self.notify("Chat deleted", timeout=3)
        if self.session is not None and self.session.id == session_id:
            sessions = self.store.list_sessions()
            session = sessions[0] if sessions else None
            path = self.store.path(session.head_id) if session else []
            self.app.call_from_thread(self.show_session, session, path)
            if session is not None and self.engine_ready.is_set():
                self.open_in_engine(session)
        else:
            self.app.call_from_thread(self.refresh_sidebar)

    def action_settings(self) -> None:
        """System prompt, sampling and title of this chat (a new chat is stored with them)."""
        session = self.session
        title = session.title if session else "New chat"
        system = session.system_prompt if session else self.config.system_prompt
        sampling = session.sampling if session else dict(self.config.sampling)
        screen = SettingsScreen(title, system, sampling, self.config.max_tokens)
        self.app.push_screen(screen, lambda result: result and self.settings_worker(session, result))

    @work(thread=True, exit_on_error=False, group="engine")
    def settings_worker(self, session: Session | None, settings: dict) -> None:
        settings = {**settings, "title": session_title(settings["title"]) or "New chat"}
        if session is None:
            if self.engine is not None:
                session = self.engine.new_session(settings["title"])
            else:
                session = self.store.create_session(settings["title"])
        self.store.update_session(session.id, **settings)
        session = self.store.get_session(session.id)
        self.app.call_from_thread(self.show_session, session, self.store.path(session.head_id))
        self.notify("Settings saved for this chat", timeout=3)

    # -- search ----------------------------------------------------------------------------------

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    @on(Input.Changed, "#search")
    def search_changed(self, event: Input.Changed) -> None:
        if self._search_timer is not None:
            self._search_timer.stop()
        self._search_timer = self.set_timer(SEARCH_DELAY_S, self.refresh_sidebar)

    @on(Input.Submitted, "#search")
    def search_submitted(self) -> None:
        self.query_one(SessionTree).focus()

    @work(thread=True, exit_on_error=False, group="sidebar", exclusive=True)
    def search_worker(self, query: str) -> None:
        """Sessions whose title contains the words or whose messages match, as a tree (forks under
        their parent); each matching message once, under the first session that had it."""
        words = query.lower().split()
        sessions = self.store.list_sessions()
        try:
            found = self.store.search(query)
        except StoreError:
            found = []
        first: dict[int, tuple[Session, Message]] = {}  # a message forks share is one hit
        for session, message in found:
            if message.id not in first or session.created < first[message.id][0].created:
                first[message.id] = (session, message)
        hits: dict[str, list[SearchHit]] = {}
        for session, message in first.values():
            snippet = f"{message.role}: {' '.join(message.content.split())[:60]}"
            hits.setdefault(session.id, []).append(SearchHit(message.id, snippet))
        matching = [s for s in sessions if s.id in hits or all(w in s.title.lower() for w in words)]
        points = branch_points(self.store, sessions)
        self.app.call_from_thread(self.show_sessions, matching, points, hits)

    # -- model -----------------------------------------------------------------------------------

    def action_choose_model(self) -> None:
        if not self.can_start("change the model"):
            return
        models = []
        for known in KNOWN_MODELS.values():
            status = model_status(known)
            state = "ready" if status["assembled"] else "assembled on first use"
            models.append(
                (
                    known.name,
                    state if status["packages_installed"] or status["assembled"] else "not installed",
                )
            )
        current = model_label(self.engine.model) if self.engine else None

        def chosen(name: str | None) -> None:
            if name and self.can_start("change the model"):
                self.busy = "loading a model"
                self.model_worker(name)

        self.app.push_screen(ModelScreen(models, current), chosen)

    @work(thread=True, exit_on_error=False, group="engine")
    def model_worker(self, name: str) -> None:
        try:
            if name not in KNOWN_MODELS:
                resolve_model(name)  # a wrong path fails now, before the current model is let go
            if self.load_engine(name):
                self.config.save_setting("model", name)  # the next start opens it too
        except USER_ERRORS as e:
            self.notify(str(e), title="The model did not load", severity="error")
        finally:
            self.app.call_from_thread(setattr, self, "busy", None)

    # -- copy, help, commands --------------------------------------------------------------------

    def last_reply_view(self) -> MessageView | None:
        return next((v for v in reversed(self.views()) if v.role == "assistant"), None)

    def action_copy_reply(self) -> None:
        view = self.selected() or self.last_reply_view()
        if view is None:
            self.notify("There is no message to copy.", severity="warning")
        else:
            view.action_copy()

    def action_copy_code(self) -> None:
        view = self.selected() or self.last_reply_view()
        if view is None:
            self.notify("There is no message to copy from.", severity="warning")
        else:
            view.action_copy_code()

    def action_edit_last(self) -> None:
        view = self.selected()
        if view is None or view.role != "user":
            view = next((v for v in reversed(self.views()) if v.role == "user"), None)
        self.edit(view)

    @on(ChatInput.LeaveUp)
    def focus_last_message(self) -> None:
        views = self.views()
        if views:
            views[-1].focus()
            views[-1].scroll_visible()

    # -- export, import ----------------------------------------------------------------------------

    def action_export(self) -> None:
        from llama_chat.storage.exchange import default_file_name

        session = self.session
        if session is None:
            self.notify("Nothing to export: this chat is not saved yet.", severity="warning")
            return
        path = Path.cwd() / default_file_name(session)
        hint = "Enter writes it (a name ending in .md writes a Markdown transcript), Esc cancels"
        screen = TextScreen("Export chat", str(path), hint=hint)
        self.app.push_screen(screen, lambda path: path and self.export_worker(session.id, path.strip()))

    @work(thread=True, exit_on_error=False, group="exchange")
    def export_worker(self, session_id: str, path: str) -> None:
        from llama_chat.storage.exchange import export_markdown, export_session

        target = Path(path).expanduser()
        try:
            if target.suffix == ".md":
                export_markdown(self.store, session_id, target)
                done = f"wrote {target}"
            else:
                summary = export_session(self.store, session_id, target, progress=self.progress_reporter())
                done = summary.describe()
        except USER_ERRORS as e:
            self.notify(str(e), title="Not exported", severity="error", timeout=10)
        else:
            self.notify(done, title="Exported", timeout=8)
        finally:
            self.post_message(WorkDone())

    def action_import(self) -> None:
        if not self.can_start("import"):
            return
        screen = TextScreen("Import chat", str(Path.cwd()) + "/", hint="The path of a .llamachat file")
        self.app.push_screen(screen, lambda path: path and self.import_worker(path.strip()))

    @work(thread=True, exit_on_error=False, group="exchange")
    def import_worker(self, path: str) -> None:
        from llama_chat.storage.exchange import import_session

        self.engine_ready.wait()  # KV made by the model here comes in with the messages
        fingerprint = self.engine.model.fingerprint if self.engine else None
        try:
            result = import_session(
                self.store,
                Path(path).expanduser(),
                model_fingerprint=fingerprint,
                progress=self.progress_reporter(),
            )
        except USER_ERRORS as e:
            self.notify(str(e), title="Not imported", severity="error", timeout=10)
            return
        finally:
            self.post_message(WorkDone())
        self.notify(result.describe(), title="Imported", timeout=8)
        self.app.call_from_thread(self.switch_to, result.session_ids[0])

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.app.key_help(), str(self.config.path)))

    def commands(self) -> Iterator[SystemCommand]:
        """Every action of the chat, for the command palette."""
        for title, help, action in COMMANDS:
            yield SystemCommand(title, help, getattr(self, f"action_{action}"))


class ChatApp(App, inherit_bindings=False):
    """`llama-chat`: the sessions, the conversation, the input; settings and themes from the config dir."""

    CSS_PATH = Path(__file__).parent / "llama_chat.tcss"  # absolute: subclasses live elsewhere
    TITLE = "llama-chat"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True),
        Binding("ctrl+p", "command_palette", "Commands", id="command_palette", show=False, priority=True),
        Binding("ctrl+c", "help_quit", show=False, system=True, id="help_quit"),
    ]

    def __init__(
        self,
        db: Path,
        model: str | None = None,
        session_id: str | None = None,
        config: Config | None = None,
        cache_ram_mb: int = CACHE_RAM_MB,
        prompt_lookup: bool = True,
    ):
        super().__init__()
        self.prompt_lookup = prompt_lookup
        self.config = config or Config.load()
        self.store = ChatStore(db)
        self.state = State()
        self.cache_ram_mb = cache_ram_mb
        # an unknown --session fails here, before the screen opens (one line, exit 2)
        session_id = self.store.get_session(session_id).id if session_id else None
        self.chat = ChatScreen(model or self.config.model, session_id)
        themes, problems = load_themes()
        for theme in themes:
            self.register_theme(theme)
        self.theme_problems = problems
        self.theme = self.config.theme if self.config.theme in self.available_themes else DEFAULT_THEME
        self.set_keymap(self.config.keymap)

    def on_mount(self) -> None:
        self.push_screen(self.chat)
        self.theme_changed_signal.subscribe(self, self.theme_chosen)
        for problem in self.theme_problems:
            self.notify(problem, title="Theme not loaded", severity="warning")
        for problem in self.config.problems:
            self.notify(problem, title="Setting left out", severity="warning")
        if self.config.theme not in self.available_themes:
            self.notify(f"unknown theme '{self.config.theme}' in {self.config.path}", severity="warning")
        unknown = set(self.config.keymap) - {bid for _, rows in self.key_help() for _, _, bid in rows}
        if unknown:
            self.notify(
                f"{self.config.path}: unknown binding id(s) {', '.join(sorted(unknown))}", severity="warning"
            )

    def theme_chosen(self, theme) -> None:
        if theme.name != self.config.theme:
            try:
                self.config.save_setting("theme", theme.name)
            except OSError as e:
                self.notify(f"{self.config.path}: {e}", severity="error")
            except ConfigError as e:  # the file was changed by hand into bad TOML meanwhile
                self.notify(str(e), severity="error")

    def get_system_commands(self, screen: Screen):
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            yield from screen.commands()

    def key_help(self) -> list[tuple[str, list[tuple[str, str, str]]]]:
        """The keys by place, with the user's keymap applied: (heading, [(keys, description, id)])."""

        def rows(bindings, extra=()):
            out = []
            for b in bindings:
                keys = self.config.keymap.get(b.id, b.key)
                out.append((", ".join(k.strip() for k in keys.split(",")), b.description, b.id))
            return out + list(extra)

        return [
            ("Anywhere", rows(ChatScreen.BINDINGS + [b for b in ChatApp.BINDINGS if not b.system])),
            ("Writing a message", rows(ChatInput.BINDINGS, [("up", "to the messages above", "-")])),
            (
                "A selected message (the fork and regenerate keys act on it too)",
                rows(MessageView.BINDINGS, [("escape", "back to the input", "-")]),
            ),
            ("Sidebar", rows(SessionTree.BINDINGS, [("enter", "open the chat", "-")])),
        ]

    async def action_quit(self) -> None:
        """Quit; a reply being written is stopped and stored first."""
        chat = self.chat
        if chat.reply is not None:
            chat.reply.cancel.set()
            await self.workers.wait_for_complete([w for w in self.workers if w.group == "reply"])
        self.exit()


def cmd_tui(args) -> int:
    """`llama-chat` (no command): the full-screen chat."""
    try:
        config = Config.load()
    except ConfigError as e:
        print(f"llama-chat: error: {e}", file=sys.stderr)
        return 2
    model = args.model or config.model
    if model is not None and model not in KNOWN_MODELS:
        resolve_model(model)  # a missing or foreign file: one line and exit 2, before the screen opens
    app = ChatApp(args.db, model, args.session, config, args.cache_ram, not args.no_lookup)
    app.run()
    work = app.chat.busy or (None if app.chat.engine_ready.is_set() else "loading the model")
    if work:  # a worker thread cannot be stopped; the process ends when it does
        print(f"llama-chat: {work}; exiting when it ends", file=sys.stderr)
    return app.return_code or 0
