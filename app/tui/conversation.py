"""The conversation: its messages as Markdown, oldest at the top; a reply streams into the last one."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static

from llama_chat.storage import Message, Session

from .widgets import MessageView

# Drawing a message costs about 2 ms of the UI thread (Markdown widgets): a very long conversation
# shows its newest messages only, so opening it never holds the screen for long.
MAX_SHOWN = 100
NEW_CHAT_HINT = "A new chat: it is saved as you go. Ctrl+O forks it, F1 lists every key, Ctrl+P every action."


def message_view(message: Message) -> MessageView:
    return MessageView(message.role, message.content, message, note="stopped" if message.stopped else "")


def system_line(system_prompt: str | None) -> list[Static]:
    """A system prompt as the conversation's first line (none without one)."""
    if not system_prompt:
        return []
    return [Static(f"system: {system_prompt}", classes="system-prompt system-line", markup=False)]


class ConversationView(VerticalScroll):
    """The messages of the open chat, following the newest unless the user went back to an old one."""

    async def show(self, session: Session | None, path: list[Message]) -> None:
        """Draw a whole conversation (on switching, forking, branching); replies stream in afterwards."""
        with self.app.batch_update():
            await self.remove_children()
            widgets = []
            if len(path) > MAX_SHOWN:
                hidden = f"⋯ {len(path) - MAX_SHOWN:,} earlier messages (Export chat as .md shows them all)"
                widgets.append(Static(hidden, classes="system-prompt", markup=False))
            widgets += system_line(session.system_prompt if session else None)
            widgets += [message_view(m) for m in path[-MAX_SHOWN:]]
            if session is None:
                widgets.append(Static(NEW_CHAT_HINT, classes="system-prompt new-chat-hint", markup=False))
            await self.mount_all(widgets)
        self.scroll_end(animate=False)
        self.anchor()

    async def show_system_prompt(self, system_prompt: str | None) -> None:
        """A new chat's system prompt (as set, or as the engine stored it from the settings or the
        model's catalog entry) above its first message, as `show` draws it on reopening."""
        await self.query(".system-line").remove()
        line = system_line(system_prompt)
        if line:
            await self.mount_all(line, before=0 if self.children else None)

    async def add(self, *views: MessageView) -> None:
        """New messages at the end (a message sent, the reply it streams into), followed as they grow."""
        await self.query(".new-chat-hint").remove()
        await self.mount_all(views)
        self.scroll_end(animate=False)
        self.anchor()  # follow the reply (opening a search hit let go of the end)

    def views(self) -> list[MessageView]:
        return list(self.query_children(MessageView))

    def selected(self) -> MessageView | None:
        """The message the user moved to (focused), if any."""
        focused = self.screen.focused
        return focused if isinstance(focused, MessageView) else None

    def last(self, role: str | None = None) -> MessageView | None:
        """The newest message (of this role)."""
        return next((v for v in reversed(self.views()) if role in (None, v.role)), None)

    def reply_target(self) -> Message | None:
        """The reply to regenerate: the selected one, else the last message if it is a stored reply."""
        for view in (self.selected(), self.last()):
            if view is not None and view.role == "assistant" and view.message is not None:
                return view.message
        return None

    def adopt(self, path: list[Message]) -> bool:
        """Give the messages on screen the stored messages they show (ids: forkable, editable);
        False when they are not the end of `path` (show it again then)."""
        views = self.views()
        shown = path[-len(views) :] if views else []
        if [v.role for v in views] != [m.role for m in shown]:
            return False
        for view, message in zip(views, shown):
            view.message = message
        return True

    def show_message(self, message_id: int) -> bool:
        """Scroll to a message (a search hit) and select it; False when it is too far back to be drawn."""
        view = next((v for v in self.views() if v.message and v.message.id == message_id), None)
        if view is None:
            return False
        self.anchor(False)  # stay at the message, not at the end
        view.focus(scroll_visible=False)
        self.call_after_refresh(self.scroll_to_widget, view, animate=False, top=True)
        return True

    def focus_last(self) -> None:
        views = self.views()
        if views:
            views[-1].focus()
            views[-1].scroll_visible()
