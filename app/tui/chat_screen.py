"""The chat screen: the sidebar, the conversation, the input and the status line.

The UI thread only draws. A reply is asked of the chat engine (app/chat/) by the screen's reply flow
(replies.py) from a worker, since that writes the store; every FLUSH_S while one runs, the flow draws
the events its job told, so a reply streams into a Markdown stream in batches and the whole message
is never re-rendered per token. The other keys' actions are the screen's ChatActions (actions.py).
What reads or writes the store, or loads the model, runs in a thread worker that hands its result
back to the UI thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as UIMessage
from textual.screen import Screen
from textual.widgets import Footer, Tree
from textual.worker import Worker, WorkerState

from llama_chat.storage import ChatStore, Message, Session

from ..chat.attachments import Attachment
from ..chat.build import open_engine
from ..chat.engine import ChatEngine
from ..config import UserConfig
from .actions import ChatActions
from .conversation import ConversationView
from .mcp_calls import ToolCalls
from .replies import USER_ERRORS, Reply, ReplyFlow, error_text
from .sidebar import SessionTree, Sidebar
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
# -- what workers tell the screen ------------------------------------------------------------------


class ModelReady(UIMessage):
    def __init__(self, error: str | None = None):
        super().__init__()
        self.error = error


class Resumed(UIMessage):
    def __init__(self, session_id: str, text: str, tokens: int):
        super().__init__()
        self.session_id, self.text, self.tokens = session_id, text, tokens


class ChatScreen(Screen):
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
            (
                "f6",
                "toggle_api_chats",
                "API chats",
                False,
                "Show or hide the chats made through llama-chat serve",
            ),
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
        self.flow = ReplyFlow(self)  # the replies asked for, as they are written
        self.actions = ChatActions(self)  # what the other keys do
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
        self.flush_timer = self.set_interval(FLUSH_S, self.flow.render, pause=True)
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
        options = replace(self.app.engine_options, model=name, store=self.store, n_ctx=self.config.n_ctx)
        try:
            engine = open_engine(options, self.progress_reporter())
        except Exception as e:  # a bug, too: replies must not wait for this model forever
            self.post_message(ModelReady(error_text(e)))
            return
        old, self.engine = self.engine, engine
        if old is not None:  # its KV goes with it; no reply runs on it (none starts while a model loads)
            old.close()
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
                model=model_label(self.engine.model_info) if self.engine else f"no model: {event.error}"
            )
            self.notify(event.error, title="The model did not load", severity="error", timeout=10)
        else:
            self.status.set(model=model_label(self.engine.model_info))
            self.show_context(self.session.n_tokens if self.session else 0)
        for reply in self.replies:  # (sent while it loaded: no reply starts while a model loads)
            self.flow.start(reply)

    # -- sessions --------------------------------------------------------------------------------

    def open_in_engine(self, session: Session) -> None:
        """On a worker thread: bring a session's KV back (RAM, stored blocks, tail) and say how; other
        sessions let go."""
        engine = self.engine
        if engine is None:
            return
        info = engine.resume(session)
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

    def switch_to(self, session_id: str, message_id: int | None = None) -> None:
        """Open a session (at one of its messages: a search hit) and resume it."""

        def read() -> tuple[Session, list[Message]]:
            session = self.store.get_session(session_id)
            return session, self.store.path(session.head_id)

        async def opened(result: tuple[Session, list[Message]]) -> None:
            await self.show_session(*result)
            if message_id is not None:
                self.show_message(message_id)
            self.resume(result[0])

        self.in_background(read, opened)

    def show_message(self, message_id: int) -> None:
        if not self.conversation.show_message(message_id):  # among the earliest of a very long chat
            self.notify("That message is further back than the chat shows; Export chat shows it all.")

    def show_context(self, tokens: int) -> None:
        if self.engine is not None:
            self.status.set(context=f"ctx {tokens:,}/{self.engine.n_ctx:,}")

    # -- replies ---------------------------------------------------------------------------------

    @property
    def replies(self) -> list[Reply]:
        """The replies being written."""
        return self.flow.running

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        await self.flow.send(event.text)

    def action_stop(self) -> None:
        """Esc: stop the replies at once (what was written is kept), else leave the search or a message."""
        if not self.flow.stop():
            self.sidebar.leave_search()
            self.query_one(ChatInput).focus()

    def on_unmount(self) -> None:
        self.tool_calls.close()

    @on(ChatInput.LeaveUp)
    def focus_last_message(self) -> None:
        self.conversation.focus_last()

    # -- what the other keys and the sidebar do (actions.py) --------------------------------------

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        self.actions.open_ref(event.node.data)

    def on_session_tree_delete(self, event: SessionTree.Delete) -> None:
        self.actions.delete(event.session_id)

    def on_message_view_edit(self, event: MessageView.Edit) -> None:
        self.actions.edit(event.view)

    async def action_new_chat(self) -> None:
        await self.actions.new_chat()

    def action_fork(self) -> None:
        self.actions.fork()

    def action_regenerate(self) -> None:
        self.actions.regenerate()

    def action_regenerate_three(self) -> None:
        self.actions.regenerate_three()

    def action_search(self) -> None:
        self.actions.search()

    def action_toggle_sidebar(self) -> None:
        self.actions.toggle_sidebar()

    def action_toggle_api_chats(self) -> None:
        self.actions.toggle_api_chats()

    def action_rename(self) -> None:
        self.actions.rename()

    def action_delete(self) -> None:
        self.actions.delete(self.session.id if self.session else None)

    def action_settings(self) -> None:
        self.actions.settings()

    def action_choose_model(self) -> None:
        self.actions.choose_model()

    def action_export(self) -> None:
        self.actions.export()

    def action_import(self) -> None:
        self.actions.import_chat()

    def action_attach(self) -> None:
        self.actions.attach()

    def action_help(self) -> None:
        self.actions.help()
