"""The chat's own widgets: one message, the input, the status line and what it says."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message as UIMessage
from textual.widgets import Collapsible, Label, Markdown, ProgressBar, Static, TextArea

from llama_chat.storage import Message
from llama_chat.storage.fragments import parts

from .message_text import fenced, markdown_parser, size_text

if TYPE_CHECKING:
    from ..chat.engine import ModelInfo
    from ..chat.resume import ResumeInfo

AUTHORS = {"user": "you", "assistant": "assistant"}


class MessageView(Vertical, can_focus=True):
    """A message of the conversation as it was written (message_text.py): Markdown, each attached file
    folded with its name and size, a reply's thinking folded above its answer; focus it (↑ from the
    input) to act on it."""

    BINDINGS = [
        # a tooltip puts the action in the command palette, where it acts on the selected (or last) message
        Binding("e", "edit", "Edit", id="edit_message", tooltip="Edit a message of yours, in a new branch"),
        Binding("c", "copy", "Copy", id="copy_message", tooltip="Copy the message"),
        Binding("y", "copy_code", "Copy code", id="copy_code", tooltip="Copy a code block (again: the next)"),
        Binding("t", "thinking", "Thinking", id="show_thinking", tooltip="Unfold (or fold) its thinking"),
        Binding("up,k", "step(-1)", "Previous", id="previous_message", show=False),
        Binding("down,j", "step(1)", "Next", id="next_message", show=False),
    ]

    class Edit(UIMessage):
        def __init__(self, view: MessageView):
            super().__init__()
            self.view = view

    def __init__(
        self, role: str, content: str = "", message: Message | None = None, note: str = "", thinking: str = ""
    ):
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.thinking = thinking
        self.message = message  # None until it is stored (a reply being streamed)
        self.note = note
        self._stream = None
        self._next_code_block = 0

    def compose(self) -> ComposeResult:
        yield Label(self._heading(), classes="author", markup=False)
        if self.thinking:
            yield thinking_fold(self.thinking)
        for name, text in parts(self.content) or [(None, "")]:
            if name is None:
                yield Markdown(fenced(text), parser_factory=markdown_parser)
            else:
                title = Text(f"{name} · {size_text(text)}")  # a file's name as it is written, not markup
                yield Collapsible(Static(text, markup=False), title=title, classes="attachment")

    def _heading(self) -> str:
        author = AUTHORS.get(self.role, self.role)
        return f"{author} · {self.note}" if self.note else author

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".author", Label).update(self._heading())

    async def append(self, text: str) -> None:
        """Add streamed text: the Markdown stream renders only the blocks that changed."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query(Markdown).last())
        self.content += text
        await self._stream.write(text)

    async def append_thinking(self, text: str) -> None:
        """Add streamed thinking, to its fold (made when the first of it comes)."""
        self.thinking += text
        if self.query(".thinking"):
            self.query_one(".thinking-text", Static).update(self.thinking)
        else:
            await self.mount(thinking_fold(self.thinking), after=self.query_one(".author"))
            self.refresh_bindings()  # its key on the footer now

    async def finish(self) -> None:
        """The reply is written: drawn again whole, its code written without a fence fenced."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
            written = fenced(self.content)
            if written != self.content:
                await self.query(Markdown).last().update(written)

    def code_blocks(self) -> list[str]:
        written = "\n".join(fenced(text) for name, text in parts(self.content) if name is None)
        return [t.content for t in markdown_parser().parse(written) if t.type in ("fence", "code_block")]

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

    def check_action(self, action: str, parameters: tuple) -> bool:
        """`t` where there is thinking to unfold: on the footer of those messages only."""
        return action != "thinking" or bool(self.thinking)

    def action_thinking(self) -> None:
        folds = self.query(".thinking")
        if not folds:
            self.notify("This message has no thinking", severity="warning")
            return
        fold = folds.first(Collapsible)
        fold.collapsed = not fold.collapsed

    def action_step(self, delta: int) -> None:
        views = list(self.parent.query_children(MessageView)) if self.parent else []
        i = views.index(self) + delta
        if 0 <= i < len(views):
            views[i].focus()
            views[i].scroll_visible()
        elif delta > 0:
            self.screen.query_one(ChatInput).focus()


def thinking_fold(text: str) -> Collapsible:
    """A reply's thinking, folded: its text as written (no Markdown: it is notes, not the answer)."""
    text_view = Static(text, markup=False, classes="thinking-text")
    return Collapsible(text_view, title="thinking", classes="thinking")


class ChatInput(TextArea):
    """The message being written: Enter sends, Ctrl+J (or Shift+Enter where the terminal tells) adds a
    line."""

    # Priority bindings run as the key arrives, before keys typed just before it (a paste, tmux
    # send-keys) have reached the text, so the actions queue behind them with call_later.
    BINDINGS = [
        # (not on the footer: the empty input says them, and F1; the footer's room is the chat's keys')
        Binding("enter", "send", "Send", id="send", priority=True, show=False),
        Binding("ctrl+j,shift+enter", "newline", "New line", id="newline", priority=True, show=False),
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


def model_label(model: ModelInfo) -> str:
    """The model as it was chosen: its file's stem, which for a known model is its short name. The
    GGUF's own general.name can describe another build ("… AWQ" on the default Q4_K_M file)."""
    return model.path.stem


def resume_text(info: ResumeInfo) -> str:
    """How a session came back: "2,048 tokens restored in 38 ms" (or "… of …" when some were not)."""
    if info.restored != info.tokens:
        return info.describe()
    return f"{info.tokens:,} tokens restored in {info.seconds * 1000:.0f} ms"


def speed_text(stats: dict) -> str | None:
    """A stored reply's speeds and, when prompt lookup guessed, how many guessed tokens were kept; a
    part that did not run (a reply stopped while it read) is left out."""
    prefill, decode = stats.get("prefill_tok_s", 0), stats.get("decode_tok_s", 0)
    parts = [f"prefill {prefill:,.0f} tok/s"] if prefill else []
    parts += [f"decode {decode:,.1f} tok/s"] if decode else []
    text = " · ".join(parts) or None
    drafted, accepted = stats.get("drafted_tokens", 0), stats.get("accepted_tokens", 0)
    return f"{text} · lookup {accepted}/{drafted}" if text and drafted else text


# -- what workers tell the status line (posting is thread-safe) ---------------------------------


class Progress(UIMessage):
    def __init__(self, label: str, done: float | None = None, total: float | None = None):
        super().__init__()
        self.label, self.done, self.total = label, done, total


class WorkDone(UIMessage):
    """Long work has ended: the bar goes. Posted like Progress, so it cannot overtake the last one."""


SHOWN = ("work", "model", "context", "speed", "resumed")  # the status line's parts, left to right
KEPT = ("work", "context", "speed", "resumed", "model")  # the first kept when the line is short of room
MODEL_COLUMNS = 12  # the model's name is cut to the room left, down to this many columns, else left out


def fitting(fields: dict[str, str], width: int) -> str:
    """The status line in `width` columns: its parts in KEPT's order while they fit (the first always:
    it wraps; the model's name cut with "…" to the room left), shown in SHOWN's order; all of them
    before the line is laid out (`width` 0)."""
    kept: dict[str, str] = {}
    for name in (n for n in KEPT if fields.get(n)):
        text = fields[name]
        room = width - cell_len(" · ".join([*kept.values(), ""]))  # after the parts kept and a " · "
        if kept and width > 0 and cell_len(text) > room:
            if name != "model" or room < MODEL_COLUMNS:
                continue
            cut = Text(text)
            cut.truncate(room, overflow="ellipsis")
            text = cut.plain
        kept[name] = text
    return " · ".join(kept[n] for n in SHOWN if n in kept)


class StatusLine(Horizontal):
    """Model, context used, speed of the last reply, how the session was resumed, what fits of them
    on one line; a bar for long work (told by workers with Progress and WorkDone, posted to it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fields: dict[str, str] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="status-text", markup=False)  # a model's file name, as it is written
        yield ProgressBar(id="progress", show_eta=False)

    def set(self, **fields: str | None) -> None:
        """Set (or with None, clear) named parts: model, context, speed, resumed, work."""
        for name, value in fields.items():
            if value is None:
                self.fields.pop(name, None)
            else:
                self.fields[name] = value
        self.show()

    def show(self) -> None:
        bar = self.query_one(ProgressBar)
        width = self.content_size.width - (bar.outer_size.width if bar.display else 0)
        self.query_one("#status-text", Static).update(fitting(self.fields, width))

    def on_resize(self) -> None:
        self.show()

    def progress(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show long work: a label and a bar (no total: an indeterminate bar)."""
        self.set(work=label)
        bar = self.query_one(ProgressBar)
        if not bar.display:
            bar.display = True
            self.call_after_refresh(self.show)  # in the room the bar leaves, once it is laid out
        bar.update(total=total if total else None, progress=done or 0)

    def done(self) -> None:
        self.query_one(ProgressBar).display = False
        self.set(work=None)

    def on_progress(self, event: Progress) -> None:
        self.progress(event.label, event.done, event.total)

    def on_work_done(self) -> None:
        self.done()

    def reporter(self) -> Callable[[str, int, int], None]:
        """A progress(label, done, total) callback for a worker thread: this line's bar, at most 10
        times a second."""
        last = [0.0]

        def report(label: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or (total and done >= total):
                last[0] = now
                self.post_message(Progress(label, done, total))

        return report
