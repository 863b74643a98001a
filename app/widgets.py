"""The chat widgets: one message, the input, the sessions sidebar and the status line."""

from __future__ import annotations

from dataclasses import dataclass

from markdown_it import MarkdownIt
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as UIMessage
from textual.widgets import Label, Markdown, ProgressBar, Static, TextArea, Tree

from llama_chat.storage import Message, Session

AUTHORS = {"user": "you", "assistant": "assistant"}


class MessageView(Vertical, can_focus=True):
    """A message of the conversation, as Markdown; focus it (↑ from the input) to act on it."""

    BINDINGS = [
        Binding("e", "edit", "Edit", id="edit_message"),
        Binding("c", "copy", "Copy", id="copy_message"),
        Binding("y", "copy_code", "Copy code", id="copy_code"),
        Binding("up,k", "step(-1)", "Previous", id="previous_message", show=False),
        Binding("down,j", "step(1)", "Next", id="next_message", show=False),
    ]

    class Edit(UIMessage):
        def __init__(self, view: MessageView):
            super().__init__()
            self.view = view

    def __init__(self, role: str, content: str = "", message: Message | None = None, note: str = ""):
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.message = message  # None until it is stored (a reply being streamed)
        self.note = note
        self._stream = None
        self._next_code_block = 0

    def compose(self) -> ComposeResult:
        yield Label(self._heading(), classes="author", markup=False)
        yield Markdown(self.content)

    def _heading(self) -> str:
        author = AUTHORS.get(self.role, self.role)
        return f"{author} · {self.note}" if self.note else author

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".author", Label).update(self._heading())

    async def append(self, text: str) -> None:
        """Add streamed text: the Markdown stream renders only the blocks that changed."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += text
        await self._stream.write(text)

    async def finish(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def code_blocks(self) -> list[str]:
        tokens = MarkdownIt("gfm-like").parse(self.content)
        return [t.content for t in tokens if t.type in ("fence", "code_block")]

    def action_edit(self) -> None:
        self.post_message(self.Edit(self))

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify(f"Copied the message ({len(self.content):,} characters)")

    def action_copy_code(self) -> None:
        blocks = self.code_blocks()
        if not blocks:
            self.notify("This message has no code block", severity="warning")
            return
        i = self._next_code_block % len(blocks)  # pressing again copies the next block
        self._next_code_block = i + 1
        self.app.copy_to_clipboard(blocks[i])
        self.notify(f"Copied code block {i + 1} of {len(blocks)}")

    def action_step(self, delta: int) -> None:
        views = list(self.parent.query_children(MessageView)) if self.parent else []
        i = views.index(self) + delta
        if 0 <= i < len(views):
            views[i].focus()
            views[i].scroll_visible()
        elif delta > 0:
            self.screen.query_one(ChatInput).focus()


class ChatInput(TextArea):
    """The message being written: Enter sends, Ctrl+J (or Shift+Enter where the terminal tells) adds a line."""

    # Priority bindings run as the key arrives, before keys typed just before it (a paste, tmux
    # send-keys) have reached the text, so the actions queue behind them with call_later.
    BINDINGS = [
        Binding("enter", "send", "Send", id="send", priority=True),
        Binding("ctrl+j,shift+enter", "newline", "New line", id="newline", priority=True),
    ]

    class Submitted(UIMessage):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class LeaveUp(UIMessage):
        """↑ on the first line: go to the messages above."""

    def __init__(self, **kwargs):
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            compact=True,
            placeholder="Message (Enter sends, Ctrl+J new line, F1 help)",
            **kwargs,
        )

    def action_send(self) -> None:
        self.call_later(lambda: self.post_message(self.Submitted(self.text)))

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0:
            self.post_message(self.LeaveUp())
        else:
            super().action_cursor_up(select)


@dataclass(frozen=True)
class ChatRef:
    """What a sidebar line opens: a session and, on a search hit, the message that matched."""

    session_id: str
    message_id: int | None = None


@dataclass
class SearchHit:
    message_id: int
    snippet: str


def branch_label(session: Session, parent_title: str, shared: int | None) -> Text:
    """A session's line: a branch under its parent by what it adds to the title ("(fork)") and
    where it left the parent, so that the original and its forks never look the same."""
    title = session.title
    if parent_title and title.startswith(parent_title) and title != parent_title:
        title = title[len(parent_title) :].strip() or title
    label = Text(" ".join(title.split()))  # titles stored before they were tidied
    if shared is not None:
        label.append(f" · after msg {shared}" if shared else " · from the start", style="dim")
    return label


class SessionTree(Tree[ChatRef]):
    """The conversations, newest first, each fork under the session it came from; in search results,
    the matching messages under their session."""

    BINDINGS = [Binding("delete,d", "delete", "Delete", id="delete_session")]

    class Delete(UIMessage):
        def __init__(self, session_id: str):
            super().__init__()
            self.session_id = session_id

    def __init__(self, **kwargs):
        super().__init__("chats", **kwargs)
        self.show_root = False
        self.guide_depth = 2

    def show_sessions(
        self,
        sessions: list[Session],
        current: str | None,
        branch_points: dict[str, int],
        hits: dict[str, list[SearchHit]] | None = None,
    ) -> None:
        """Draw the sessions as a tree; `branch_points`: how many messages a fork shares with its
        parent; `hits`: search results to list under their session (None: not a search)."""
        ids = {s.id for s in sessions}
        children: dict[str | None, list[Session]] = {}
        for s in sessions:
            children.setdefault(s.forked_from if s.forked_from in ids else None, []).append(s)
        for parent, kids in children.items():
            if parent is not None:  # branches in the order they were made; roots stay newest first
                kids.sort(key=lambda s: s.created)
        self.clear()
        current_node = None

        def add(parent, session: Session, parent_title: str = "") -> None:
            nonlocal current_node
            label = branch_label(session, parent_title, branch_points.get(session.id))
            if session.id == current:
                label = Text("● ", style="bold") + label
                label.stylize("bold")
            kids = children.get(session.id, [])
            session_hits = (hits or {}).get(session.id, [])
            ref = ChatRef(session.id)
            node = parent.add(label, data=ref, expand=True) if kids or session_hits else None
            node = node or parent.add_leaf(label, data=ref)
            if session.id == current:
                current_node = node
            for hit in session_hits:
                node.add_leaf(Text(hit.snippet, style="dim"), data=ChatRef(session.id, hit.message_id))
            for kid in kids:
                add(node, kid, session.title)

        for root in children.get(None, []):
            add(self.root, root)
        if hits is not None and not sessions:
            self.root.add_leaf(Text("nothing found", style="dim"))
        # search results from the first one, not from where the cursor was; else at the open chat
        first = self.root.children[0] if self.root.children else None
        target = first if hits is not None else current_node
        if target is not None:  # once drawn: a node has no line before
            self.call_after_refresh(self.move_cursor, target)

    def action_delete(self) -> None:
        node = self.cursor_node
        if node is not None and node.data:
            self.post_message(self.Delete(node.data.session_id))


class StatusLine(Horizontal):
    """Model, context used, speed of the last reply, how the session was resumed; a bar for long work."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fields: dict[str, str] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="status-text")
        yield ProgressBar(id="progress", show_eta=False)

    def set(self, **fields: str | None) -> None:
        """Set (or with None, clear) named parts: model, context, speed, resumed, work."""
        for name, value in fields.items():
            if value is None:
                self.fields.pop(name, None)
            else:
                self.fields[name] = value
        order = ["work", "model", "context", "speed", "resumed"]
        self.query_one("#status-text", Static).update(
            " · ".join(self.fields[k] for k in order if self.fields.get(k))
        )

    def progress(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show long work: a label and a bar (no total: an indeterminate bar)."""
        self.set(work=label)
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=total if total else None, progress=done or 0)

    def done(self) -> None:
        self.set(work=None)
        self.query_one(ProgressBar).display = False
