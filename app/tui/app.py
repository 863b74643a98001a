"""`llama-chat`'s full-screen app: the chat screen, settings and themes from the config dir, the keys."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.driver import Driver
from textual.screen import Screen

from llama_chat.inference import KNOWN_MODELS, resolve_model

from ..chat.build import EngineOptions
from ..chat.sessions import Sessions
from ..config import DEFAULT_THEME, ConfigError, State, UserConfig, load_themes
from ..flags import engine_options
from .chat_screen import ChatScreen
from .open_chat import ChatOpened
from .sidebar import SessionTree, Sidebar
from .widgets import ChatInput, MessageView


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
        config: UserConfig | None = None,
        engine: EngineOptions | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ):
        """`progress` hears how far an upgrade of a database an older llama-chat wrote has come."""
        super().__init__()
        self.config = config or UserConfig.load()
        self.sessions = Sessions(db, progress)  # the chats, shown before the model has loaded
        self.state = State()  # the chat open last time, per database
        # an unknown --session fails here, before the screen opens (one line, exit 2)
        if session_id:
            session_id = self.sessions.get(session_id).id
        else:
            session_id = self.state.last_session(self.sessions.db_path)
        options = engine or EngineOptions()
        model = model or self.config.model
        width = self.state.sidebar_width()  # as the user left it
        self.chat = ChatScreen(self.sessions, self.config, options, model, session_id, width)
        themes, problems = load_themes()
        for theme in themes:
            self.register_theme(theme)
        self.theme_problems = problems
        self.theme = self.theme_named(self.config.theme) or DEFAULT_THEME
        self.set_keymap(self.config.keymap)

    def on_mount(self) -> None:
        self.push_screen(self.chat)
        self.theme_changed_signal.subscribe(self, self.theme_chosen)
        for problem in self.theme_problems:
            self.notify(problem, title="Theme not loaded", severity="warning")
        for problem in self.config.problems:
            self.notify(problem, title="Setting left out", severity="warning")
        if self.theme_named(self.config.theme) is None:
            self.notify(f"unknown theme '{self.config.theme}' in {self.config.path}", severity="warning")
        unknown = set(self.config.keymap) - {bid for _, rows in self.key_help() for _, _, bid in rows}
        if unknown:
            self.notify(
                f"{self.config.path}: unknown binding id(s) {', '.join(sorted(unknown))}", severity="warning"
            )

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity="information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Every notification as written, never as markup: they name chats, files and models, and errors
        that quote them (Textual reads a message as markup by default, where a title such as
        "[@click=app.quit]" would act). Screens' and widgets' notify() come here too."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for this terminal; on Linux and macOS one that reads the keys typed while
        the app started as they were meant (early_keys.py)."""
        driver = super().get_driver_class()
        if driver.__name__ == "LinuxDriver":
            from .early_keys import EarlyKeysDriver

            return EarlyKeysDriver
        return driver

    def on_chat_opened(self, event: ChatOpened) -> None:
        """The chat shown: the title says it, and it opens first next time."""
        session = event.session
        self.title = f"llama-chat · {session.title}" if session else "llama-chat"
        self.state.remember_session(self.sessions.db_path, session.id if session else None)

    def on_sidebar_resized(self, event: Sidebar.Resized) -> None:
        """The sidebar's width, as the user set it, is its width at the next start too."""
        try:
            self.state.remember_sidebar_width(event.width)
        except OSError as e:
            self.notify(f"{self.state.path}: {e}", title="Not kept for the next start", severity="warning")

    def theme_named(self, name: str) -> str | None:
        """The theme a name means: its own, or one of ours by its short name ("dark": llama-dark)."""
        for candidate in (name, f"llama-{name}"):
            if candidate in self.available_themes:
                return candidate
        return None

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
        await self.chat.flow.stop_and_wait()
        self.exit()


def cmd_tui(args) -> int:
    """`llama-chat` (no command): the full-screen chat."""
    from ..progress import ProgressBar  # (a bar before the screen opens: an older database upgraded)

    try:
        config = UserConfig.load()
    except ConfigError as e:
        print(f"llama-chat: error: {e}", file=sys.stderr)
        return 2
    model = args.model or config.model
    if model is not None and model not in KNOWN_MODELS:
        resolve_model(model)  # a missing or foreign file: one line and exit 2, before the screen opens
    with ProgressBar() as bar:  # (before the screen opens: drawn on stderr, as the commands draw it)
        app = ChatApp(args.db, model, args.session, config, engine_options(args), bar)
    app.run()
    if app.chat.loading_model:  # a worker thread cannot be stopped; the process ends when it does
        print(f"llama-chat: {app.chat.loading_model}; exiting when it ends", file=sys.stderr)
    return app.return_code or 0
