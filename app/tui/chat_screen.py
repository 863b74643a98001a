"""The chat screen: the sidebar, the conversation, the input and the status line, and the keys.

The UI thread only draws. The screen makes the chat's parts and gives each the ones it uses, never
itself: the open chat (open_chat.py: which session, drawn and resumed), its reply flow (replies.py: a
reply asked of the chat engine from a worker, its job's events drawn every FLUSH_S into a Markdown
stream), the tool calls a reply makes (mcp_calls.py) and the other keys' actions (actions.py), whose
methods its bindings call. What reads or writes the store, or loads the model, runs in a thread worker
that hands its result back to the UI thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as UIMessage
from textual.screen import Screen
from textual.widgets import Footer, Tree
from textual.worker import Worker, WorkerState

from llama_chat.storage import Message, Session, StoreError

from ..chat.build import EngineOptions, open_engine
from ..chat.sessions import Sessions
from ..config import UserConfig
from .actions import ChatActions
from .conversation import ConversationView
from .dialogs import HelpScreen
from .mcp_calls import ToolCalls
from .open_chat import LoadedModel, OpenChat
from .other_windows import OtherWindows
from .replies import USER_ERRORS, Reply, ReplyFlow, error_text
from .sidebar import WIDTH_STEP, SessionTree, Sidebar
from .widgets import ChatInput, MessageView, Progress, StatusLine, WorkDone, model_label

if TYPE_CHECKING:  # (the engine loads with the model, after the window is drawn)
    from ..chat.engine import ChatEngine


class ModelReady(UIMessage):
    """The model has loaded (or, with an `error`, has not)."""

    def __init__(self, error: str | None = None):
        super().__init__()
        self.error = error


LAST = ("escape", "ctrl+c")  # keys whose action comes after the focused widget's own


class ChatScreen(Screen):
    # Textual focuses this when the screen is first shown (else the first focusable: the sidebar's
    # search box, which took what was typed while the app started)
    AUTO_FOCUS = "ChatInput"
    # narrow: the sidebar hides, the footer leaves Ctrl+P out; widest: a wider sidebar (the .tcss)
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide"), (160, "-widest")]
    # Every action of the chat, once: its key (users remap it by id, the action's name), the footer,
    # the help screen and, by its tooltip, the command palette all come from here; what does it is a
    # method of the chat's actions (bind_actions), or the screen's own for its layout and help.
    BINDINGS = [
        Binding(key, action, title, id=action, show=show, priority=key not in LAST, tooltip=tooltip)
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
            ("ctrl+c", "stop_reply", "Stop reply", False, None),  # (as in `chat`; idle: Textual's own)
            ("ctrl+f", "search", "Search chats", False, "Search titles and messages"),
            ("ctrl+b", "toggle_sidebar", "Sidebar", False, "Show or hide the list of chats"),
            ("f6", "toggle_api_chats", "API chats", False, "The chats made through serve, or yours"),
            ("alt+right", "wider_sidebar", "Wider sidebar", False, "Make the list of chats wider"),
            ("alt+left", "narrower_sidebar", "Narrower sidebar", False, "Make the list of chats narrower"),
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

    def __init__(
        self,
        sessions: Sessions,
        config: UserConfig,
        engine_options: EngineOptions,
        model: str | None,
        session_id: str | None,
        sidebar_width: int | None = None,
    ):
        super().__init__()
        self.config = config
        # how the chat engine is built (--cache-ram, --kv-remote, …); its model, conversations and
        # context window are the app's: the model chosen, the chats shown, the config's n_ctx
        self.engine_options = engine_options
        self.wanted_session = session_id  # the chat to open first (else the newest)
        self.model = LoadedModel(sessions, model)
        self.sidebar = Sidebar(sessions, sidebar_width, id="sidebar")  # (as wide as the user left it)
        self.conversation = ConversationView(id="conversation")
        self.chat_input = ChatInput(id="input")
        self.status = StatusLine(id="status")
        self.open_chat = OpenChat(
            sessions, self.model, self.in_background, self.conversation, self.status, self.sidebar
        )
        self.flow = ReplyFlow(self.open_chat, config, self.chat_input, on_stored=self._reply_stored)
        self.tool_calls = ToolCalls(self.flow, config.mcp_servers)  # MCP servers, and the calls a reply makes
        self.other_windows = OtherWindows(self.flow)  # turns other processes write, shown
        self.actions = ChatActions(self.flow, config, self.chat_input, self.load_model)
        self.bind_actions()

    def bind_actions(self) -> None:
        """Each key's action is the chat actions' own method: Textual calls the screen's `action_<name>`."""
        actions = self.actions
        done_by = {
            "new_chat": actions.new_chat,
            "fork": actions.fork,
            "regenerate": actions.regenerate,
            "regenerate_three": actions.regenerate_three,
            "stop": actions.stop,
            "stop_reply": actions.stop_reply,
            "rename": actions.rename,
            "delete": actions.delete,
            "settings": actions.settings,
            "choose_model": actions.choose_model,
            "export": actions.export,
            "import": actions.import_chat,
            "attach": actions.attach,
        }
        for name, method in done_by.items():
            setattr(self, f"action_{name}", method)

    # what the app and its tests read: the chat shown, the model, the replies being written
    @property
    def session(self) -> Session | None:
        return self.open_chat.session

    @property
    def engine(self) -> ChatEngine | None:
        return self.model.engine

    @property
    def loading_model(self) -> str | None:
        """What is loading (replies wait for it), or None."""
        return self.model.loading

    @property
    def replies(self) -> list[Reply]:
        return self.flow.running

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield self.sidebar
            with Vertical(id="chat"):
                yield self.conversation
                yield self.chat_input
        yield self.status
        yield Footer()

    def on_mount(self) -> None:
        self.chat_input.focus()
        self.conversation.anchor()
        self.status.progress("opening conversations")
        self.in_background(self.last_session, self.started)
        self.other_windows.watch()

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

    # -- startup, model --------------------------------------------------------------------------

    def last_session(self) -> tuple[Session | None, list[Message]]:
        """The chat to open first: the one asked for (or open last time), else the newest."""
        chats = self.model.sessions
        session = None
        if self.wanted_session:
            with contextlib.suppress(StoreError):  # deleted since, perhaps by another window
                session = chats.get(self.wanted_session)
        session = session or (chats.list(limit=1) or [None])[0]
        return session, chats.messages(session) if session else []

    async def started(self, opened: tuple[Session | None, list[Message]]) -> None:
        """The last conversation is on screen: now load the model (and resume it on the model)."""
        await self.open_chat.show(*opened)
        self.load_engine(self.model.name)

    def load_model(self, name: str) -> None:
        """Load another model (Ctrl+L), and open it next time too."""
        self.model.loading = "loading a model"
        self.load_engine(name, remember=True)

    @work(thread=True, exit_on_error=False, group="model")
    def load_engine(self, name: str | None, remember: bool = False) -> None:
        """Load a model, with progress; then resume the open session on it. `remember`: open it next time
        too."""
        self.status.post_message(Progress(f"loading {Path(name).name if name else 'the default model'}"))
        options = replace(
            self.engine_options, model=name, sessions=self.model.sessions, n_ctx=self.config.n_ctx
        )
        old = self.model.engine
        try:
            engine = open_engine(options, self.status.reporter())
        except Exception as e:  # a bug, too: replies must not wait for this model forever
            self.post_message(ModelReady(error_text(e)))
            return
        if old is not None:  # its KV goes with it; no reply runs on it (none starts while a model loads)
            old.close()
        self.model.name = name
        session = self.open_chat.session
        if session is not None:  # its KV back (RAM, stored blocks, tail); other sessions let go
            self.app.call_from_thread(self.open_chat.resumed, session, engine.resume(session))
        self.post_message(ModelReady())
        self.tool_calls.offer(engine)  # after: a server slow to start holds up no reply
        if remember:
            try:
                self.config.save_setting("model", name)
            except USER_ERRORS as e:
                self.notify(str(e), title="Not kept for the next start", severity="error")

    def on_model_ready(self, event: ModelReady) -> None:
        """The model is loaded (or did not load): replies sent meanwhile start (or fail)."""
        self.model.loading = None
        # posted to the status line, behind the load's last Progress: done() here could come first
        self.status.post_message(WorkDone())
        engine = self.model.engine
        if event.error:
            self.status.set(model=model_label(engine.model_info) if engine else f"no model: {event.error}")
            self.notify(event.error, title="The model did not load", severity="error", timeout=10)
        else:
            self.status.set(model=model_label(engine.model_info))
            self.open_chat.show_context(self.session.n_tokens if self.session else 0)
        self.flow.start_waiting()

    # -- what the chat's widgets tell it -----------------------------------------------------------

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        await self.flow.send(event.text)

    @on(ChatInput.LeaveUp)
    def focus_last_message(self) -> None:
        self.conversation.focus_last()

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        self.actions.open_ref(event.node.data)

    def on_session_tree_delete(self, event: SessionTree.Delete) -> None:
        self.actions.delete(event.session_id)

    def on_message_view_edit(self, event: MessageView.Edit) -> None:
        self.actions.edit(event.view)

    def _reply_stored(self, session: Session, path: list[Message]) -> None:
        self.tool_calls.after_reply(session, path)  # (made after the flow: its answers go on through it)

    def on_unmount(self) -> None:
        self.tool_calls.close()

    # -- the layout, help and the command palette ---------------------------------------------------

    def action_search(self) -> None:
        self.show_sidebar(True)
        self.sidebar.search.focus()

    def action_toggle_sidebar(self) -> None:
        self.show_sidebar(not self.sidebar.display)

    def action_toggle_api_chats(self) -> None:
        """F6: the chats clients of `llama-chat serve` made, listed apart from the user's own."""
        api = not self.sidebar.api_chats
        self.sidebar.show_api_chats(api)
        self.show_sidebar(True)
        self.open_chat.show_chats()
        self.notify("The chats made through serve (F6: yours)" if api else "Your chats", timeout=3)

    def action_wider_sidebar(self) -> None:
        self.widen_sidebar(WIDTH_STEP)

    def action_narrower_sidebar(self) -> None:
        self.widen_sidebar(-WIDTH_STEP)

    def widen_sidebar(self, columns: int) -> None:
        """Alt+→ and Alt+←: the sidebar wider or narrower (shown first, if it was hidden)."""
        if not self.sidebar.display:
            self.show_sidebar(True)
        self.sidebar.widen(columns)

    def show_sidebar(self, show: bool) -> None:
        """Show or hide the sidebar, whatever the terminal's width would choose."""
        self.set_class(show, "-show-sidebar")
        self.set_class(not show, "-hide-sidebar")
        if not show and self.sidebar.has_focus_within:
            self.chat_input.focus()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.app.key_help(), str(self.config.path)))

    def commands(self) -> Iterator[SystemCommand]:
        """The command palette: every binding of the chat and of a message that says what it does."""
        for binding in self.BINDINGS:
            if binding.tooltip:
                act = partial(self.run_action, binding.action)
                yield SystemCommand(binding.description, binding.tooltip, act)
        for binding in MessageView.BINDINGS:
            if binding.tooltip:
                act = partial(self.act_on_message, binding.action)
                yield SystemCommand(binding.description, binding.tooltip, act)

    async def act_on_message(self, action: str) -> None:
        """A message's action from the command palette: on the selected message, else the last one."""
        view = self.conversation.selected() or self.conversation.last()
        if view is None:
            self.notify("There is no message yet.", severity="warning")
        else:
            await view.run_action(action)
