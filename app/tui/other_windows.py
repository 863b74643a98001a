"""What other processes write into the chats (`llama-chat ask --session`, a second app, `serve`):
noticed by polling the database's change counter off the UI thread, and shown, so that the screen
shows the conversation the next reply is computed from.

A reply sent before the poll has seen a change is not computed either: the reply flow checks the
session's head as it submits (replies.submit) and gives the message back to the input; a reply that
another process's turn overtook while it was written is stored on a new branch, and the flow says so.
"""

from __future__ import annotations

from textual.timer import Timer

from llama_chat.storage import Message, Session

from .replies import ReplyFlow

POLL_S = 1.0  # how soon a turn written elsewhere shows; a poll is one PRAGMA, no table read


def more_messages(count: int) -> str:
    return f"{count} new message{'s' if count != 1 else ''}"


class OtherWindows:
    """Polls the database for changes made by other processes: the sidebar is drawn again, and the
    open chat too when its conversation moved on (unless a reply is being written: its end shows it)."""

    def __init__(self, flow: ReplyFlow):
        self.flow, self.chat = flow, flow.chat
        self.polling: Timer | None = None
        self._looking = False  # a poll is on a worker thread

    def watch(self) -> None:
        """Start polling (once the screen is mounted)."""
        self.polling = self.chat.conversation.set_interval(POLL_S, self.poll)

    def poll(self) -> None:
        if self._looking:
            return
        self._looking = True
        self.chat.run(self.look, self.seen, failed=self.lost)

    def look(self) -> tuple[bool, Session | None, list[Message]]:
        """On a worker thread: whether anything changed elsewhere, and the open chat as stored now."""
        session = self.chat.session
        if not self.chat.sessions.changed_elsewhere():
            return False, None, []
        if session is None:
            return True, None, []
        return (True, *self.chat.sessions.read(session.id))

    async def seen(self, found: tuple[bool, Session | None, list[Message]]) -> None:
        """On the UI thread: draw what changed elsewhere."""
        self._looking = False
        changed, stored, path = found
        if not changed:
            return
        shown = self.chat.session
        if stored is None or shown is None or stored.id != shown.id or self.flow.running:
            self.chat.show_chats()  # (the open chat as it was; a reply being written shows the rest)
            return
        if stored.head_id == shown.head_id:
            self.chat.opened(stored)  # a new title, say
            return
        added = self.added(path)
        await self.chat.show(stored, path)
        self.chat.notify(f"{more_messages(added)} from another window", title=stored.title)

    def added(self, path: list[Message]) -> int:
        """How many of the stored messages the screen did not show."""
        shown = {v.message.id for v in self.chat.conversation.views() if v.message is not None}
        return sum(1 for m in path if m.id not in shown)

    def lost(self, error: str) -> None:
        """The open chat could not be read (another process deleted it, say): the sidebar shows what is
        left."""
        self._looking = False
        self.chat.show_chats()
        self.chat.notify(error, title="This chat changed in another window", severity="warning")
