"""The chat on screen, and what the chat screen's parts share: the model (its engine once loaded), the
work they hand to a worker thread, and the open chat (which session, drawn how, resumed how).

The screen makes one of each and gives every part (the reply flow, the actions, the tool calls) the
ones it uses, never the screen itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from textual.message import Message as UIMessage
from textual.screen import Screen

from llama_chat.storage import Message, Session

from ..chat.sessions import Sessions
from .conversation import ConversationView
from .sidebar import Sidebar
from .widgets import StatusLine, resume_text, speed_text

if TYPE_CHECKING:  # (the engine loads with the model, after the window is drawn)
    from ..chat.engine import ChatEngine, ResumeInfo

T = TypeVar("T")


class Background(Protocol):
    """Run `task` on a worker thread (it reads or writes the store, or waits for the model) and hand what
    it returns to `then` on the UI thread; an error the user can cause goes to `failed` there, else
    becomes a notice titled `title`."""

    def __call__(
        self,
        task: Callable[[], T],
        then: Callable[[T], Any] | None = None,
        title: str | None = None,
        failed: Callable[[str], Any] | None = None,
    ) -> object: ...


@dataclass
class LoadedModel:
    """The model replies come from: its engine once loaded (the one the chats' sessions service goes
    through), and what is loading meanwhile (replies sent then wait for it)."""

    sessions: Sessions
    name: str | None  # a known name or a path; None: the default model
    loading: str | None = "loading the model"

    @property
    def engine(self) -> ChatEngine | None:
        return self.sessions.engine


class ChatOpened(UIMessage):
    """The chat shown is now `session` (None: a new chat): the app's title and next start follow it."""

    def __init__(self, session: Session | None):
        super().__init__()
        self.session = session


class OpenChat:
    """The chat on screen: its session (None: a new chat, stored with its first message, with the
    settings in `draft`), drawn whole, switched to, resumed on the model; and the user told about it."""

    def __init__(
        self,
        sessions: Sessions,
        model: LoadedModel,
        run: Background,
        conversation: ConversationView,
        status: StatusLine,
        sidebar: Sidebar,
    ):
        self.sessions, self.model, self.run = sessions, model, run
        self.conversation, self.status, self.sidebar = conversation, status, sidebar
        self.session: Session | None = None
        self.draft: dict = {}  # a new chat's settings (title, system_prompt, sampling) until it is stored

    def notify(self, message: str, **options) -> None:
        self.conversation.notify(message, **options)

    def ask(self, dialog: Screen, then: Callable[[Any], Any] | None = None) -> None:
        """Show a dialog; `then` gets what it was dismissed with."""
        self.conversation.app.push_screen(dialog, then)

    async def show(self, session: Session | None, path: list[Message]) -> None:
        """Draw a whole conversation (on switching, forking, branching); replies stream in afterwards."""
        self.session = session
        await self.conversation.show(session, path)
        last_reply = next((m for m in reversed(path) if m.role == "assistant" and m.stats), None)
        self.status.set(speed=speed_text(last_reply.stats if last_reply else {}), resumed=None)
        self.show_context(session.n_tokens if session else 0)
        self.opened(session)

    def opened(self, session: Session | None) -> None:
        """The chat shown is `session` (a new chat once stored): the sidebar marks it, the app is told."""
        self.session = session
        if session is not None:
            self.draft = {}  # (a new chat's, once stored)
        self.show_chats()
        self.conversation.post_message(ChatOpened(session))

    def show_chats(self) -> None:
        """Draw the sidebar again, the open chat marked."""
        self.sidebar.show_chats(self.session.id if self.session else None)

    def switch_to(self, session_id: str, message_id: int | None = None) -> None:
        """Open a session (at one of its messages: a search hit) and resume it."""

        async def opened(result: tuple[Session, list[Message]]) -> None:
            await self.show(*result)
            if message_id is not None:
                self.show_message(message_id)
            self.resume(result[0])

        self.run(partial(self.sessions.read, session_id), opened)

    def show_message(self, message_id: int) -> None:
        if not self.conversation.show_message(message_id):  # among the earliest of a very long chat
            self.notify("That message is further back than the chat shows; Export chat shows it all.")

    def resume(self, session: Session) -> None:
        """Resume a session on the model, unless one is loading (it resumes the open session itself)."""
        engine = self.model.engine
        if self.model.loading is None and engine is not None:
            self.run(partial(engine.resume, session), partial(self.resumed, session))

    def resumed(self, session: Session, info: ResumeInfo) -> None:
        """A session's KV is back (RAM, stored blocks, tail): say how, if it is still the one shown."""
        if self.session is not None and session.id == self.session.id:
            self.status.set(resumed=resume_text(info))
            self.show_context(info.tokens)

    def show_context(self, tokens: int) -> None:
        engine = self.model.engine
        if engine is not None:
            self.status.set(context=f"ctx {tokens:,}/{engine.n_ctx:,}")
