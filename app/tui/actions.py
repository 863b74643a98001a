"""What the chat's keys do, beyond sending and the screen's layout: stop, open chats, branch
(regenerate, edit, fork), rename, delete, settings, model, export, import, attach a file.

The chat screen's bindings call ChatActions' methods themselves: each checks what it can, asks in a
dialog, and leaves the store's work to a worker (the open chat's `run`) and a reply's to the reply flow.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from textual.actions import SkipAction

from llama_chat.inference import KNOWN_MODELS
from llama_chat.inference.catalog import model_path, model_status
from llama_chat.storage import Message, Session

from ..chat.attachments import AttachmentError, named_in, read_attachment
from ..chat.sessions import export_file_name
from ..chat.settings import DEFAULT_SAMPLING
from ..chat.titles import NEW_CHAT, session_title
from ..config import UserConfig, export_dir
from .dialogs import ConfirmScreen, ModelScreen, SettingsScreen, TextScreen
from .replies import Reply, ReplyFlow
from .sidebar import ChatRef
from .widgets import ChatInput, MessageView, WorkDone, model_label


class ChatActions:
    """The chat's actions that open a dialog or make a branch, on the open chat and its reply flow;
    `load_model(name)` loads another model (and keeps it for the next start)."""

    def __init__(
        self, flow: ReplyFlow, config: UserConfig, chat_input: ChatInput, load_model: Callable[[str], None]
    ):
        self.flow, self.chat, self.model = flow, flow.chat, flow.model
        self.config, self.chat_input, self.load_model = config, chat_input, load_model

    def stop(self) -> None:
        """Esc (and Ctrl+C): stop the replies at once (what was written is kept), else leave the search or
        a message for the input."""
        if not self.flow.stop():
            self.chat.sidebar.leave_search()
            self.chat_input.focus()

    def stop_reply(self) -> None:
        """Ctrl+C: stop the replies being written, as Esc does (and as `chat` does); with none, the key
        goes on to what it does elsewhere (copy a selection, else say how to quit)."""
        if not self.flow.stop():
            raise SkipAction()

    def choose_model(self) -> None:
        if not self.flow.can_start("change the model"):
            return
        from llama_chat.inference.packed_file import holds_model  # (numba: only once a model is chosen)

        models = []
        for known in KNOWN_MODELS.values():
            status = model_status(known)
            ready = status["assembled"] or holds_model(model_path(known))  # (packed: its GGUF not kept)
            state = "ready" if ready else "assembled on first use"
            installed = status["packages_installed"] or ready
            models.append((known.name, state if installed else "not installed"))
        current = model_label(self.model.engine.model_info) if self.model.engine else None

        def chosen(name: str | None) -> None:
            if name and self.flow.can_start("change the model"):
                self.load_model(name)

        self.chat.ask(ModelScreen(models, current), chosen)

    # -- opening chats -------------------------------------------------------------------------

    def open_ref(self, ref: ChatRef | None) -> None:
        """A chat (or a message of one) picked in the sidebar."""
        if ref is None:
            return
        if self.chat.session is not None and ref.session_id == self.chat.session.id:
            if ref.message_id is not None:
                self.chat.show_message(ref.message_id)
        elif self.flow.can_start("switch chats"):
            self.chat.switch_to(ref.session_id, ref.message_id)

    async def new_chat(self) -> None:
        if not self.flow.can_start("start a new chat"):
            return
        await self.chat.show(None, [])
        self.chat.draft = {}
        self.chat_input.focus()

    # -- replies in a new branch -----------------------------------------------------------------

    def regenerate(self) -> None:
        """A new reply in a sibling branch: the old one stays in its own session."""
        target, session = self.chat.conversation.reply_target(), self.chat.session
        if not self.flow.can_reply("regenerate"):
            return
        if target is None or session is None or target.parent_id is None:
            self.chat.notify("There is no reply to regenerate.", severity="warning")
            return
        self.flow.submit(Reply(session, max_tokens=self.flow.max_tokens(session), regenerate=target))

    def regenerate_three(self) -> None:
        """Three new replies to the last message, decoded together, each in its own branch."""
        last, session = self.chat.conversation.last(), self.chat.session
        if not self.flow.can_reply("regenerate"):
            return
        if session is None or last is None or last.role != "assistant" or last.message is None:
            self.chat.notify("Regenerate ×3 needs a conversation that ends with a reply.", severity="warning")
            return
        self.flow.submit(
            Reply(session, max_tokens=self.flow.max_tokens(session), regenerate=last.message, n=3)
        )

    def edit(self, view: MessageView) -> None:
        """Edit a past message of yours (on a reply, `view`: the message it answers); the new text and
        its reply go in a sibling branch."""
        if not self.flow.can_reply("edit"):
            return
        views = self.chat.conversation.views()
        mine = [v for v in views[: views.index(view) + 1] if v.role == "user"]
        message, session = mine[-1].message if mine else None, self.chat.session
        if message is None or session is None:
            self.chat.notify("Select one of your messages (↑ from the input) to edit it.", severity="warning")
            return

        def edited(new_text: str | None) -> None:
            if (
                new_text
                and new_text.strip()
                and new_text != message.content
                and self.flow.can_reply("edit")
            ):
                self.flow.submit(Reply(session, new_text, self.flow.max_tokens(session), edited=message))

        self.chat.ask(TextScreen("Edit message (a new branch)", message.content, multiline=True), edited)

    # -- branching, renaming, deleting, settings -------------------------------------------------

    def fork(self) -> None:
        """Fork at the head into a new session and open it; at a selected reply, fork after it; at a
        selected message of yours, fork before it with its text in the input, ready to change and send
        (a fork that kept it would end on a question without its answer)."""
        if not self.flow.can_start("fork"):
            return
        if self.chat.session is None or self.chat.session.head_id is None:
            self.chat.notify("Nothing to fork yet: send a message first.", severity="warning")
            return
        view = self.chat.conversation.selected()
        self.chat.run(partial(self.fork_at, self.chat.session, view.message if view else None), self.forked)

    def fork_at(self, session: Session, at: Message | None) -> tuple[Session, list[Message], str | None, str]:
        """On a worker thread: the fork, its messages, the text to put in the input, what to say."""
        sessions = self.chat.sessions
        if at is not None and at.role == "user":
            child = sessions.fork(session, before=at.id)
            draft, done = at.content, "Forked before your message: change it, then Enter sends it"
        else:
            at_id = at.id if at is not None and at.id != session.head_id else None
            child = sessions.fork(session, at_id)
            draft, done = None, "Forked after this reply" if at_id else f"Forked into “{child.title}”"
        return child, sessions.messages(child), draft, done

    async def forked(self, result: tuple[Session, list[Message], str | None, str]) -> None:
        """Show the new branch; what the user types next goes to the input (with the draft, if any)."""
        child, path, draft, done = result
        await self.chat.show(child, path)
        if draft is not None:
            self.chat_input.load_text(draft)
            self.chat_input.move_cursor(self.chat_input.document.end)
        self.chat_input.focus()
        self.chat.notify(done, timeout=5)
        self.chat.resume(child)

    def rename(self) -> None:
        session = self.chat.session
        if session is None:
            self.chat.notify("This chat has no title yet: send a message first.", severity="warning")
            return

        def renamed(title: str | None) -> None:
            title = session_title(title or "")
            if title and title != session.title:
                self.chat.run(partial(self.chat.sessions.rename, session.id, title), self.retitled)

        self.chat.ask(TextScreen("Rename chat", session.title), renamed)

    def retitled(self, session: Session) -> None:
        if self.chat.session is not None and self.chat.session.id == session.id:
            self.chat.opened(session)
        else:
            self.chat.show_chats()

    def delete(self, session_id: str | None = None) -> None:
        """Ask, then delete a session (the open one unless another is given); when it was the open
        one, the newest left opens."""
        session_id = session_id or (self.chat.session.id if self.chat.session else None)
        if session_id is None:
            self.chat.notify("Nothing to delete: this chat is not saved yet.", severity="warning")
            return
        if not self.flow.can_start("delete"):
            return

        def ask(session: Session) -> None:
            question = f"Delete “{session.title}”? Messages its forks still reach are kept."
            screen = ConfirmScreen("Delete chat", question, yes="Delete")
            self.chat.ask(screen, lambda yes: yes and self.chat.run(delete, deleted))

        def delete() -> tuple[Session | None, list[Message]] | None:
            self.chat.sessions.delete(session_id)  # (its KV too, when a model holds it)
            if self.chat.session is None or self.chat.session.id != session_id:
                return None
            left = self.chat.sessions.list(limit=1)
            return (left[0], self.chat.sessions.messages(left[0])) if left else (None, [])

        async def deleted(next_open: tuple[Session | None, list[Message]] | None) -> None:
            self.chat.notify("Chat deleted", timeout=3)
            if next_open is None:
                self.chat.show_chats()
                return
            await self.chat.show(*next_open)
            if next_open[0] is not None:
                self.chat.resume(next_open[0])

        self.chat.run(partial(self.chat.sessions.get, session_id), ask)

    def settings(self) -> None:
        """System prompt, sampling and title of this chat. A new chat keeps them until its first
        message stores it, as the engine makes every chat (with the model's fingerprint, and its
        system prompt where none is set), whether the model had loaded when they were set or not."""
        session, draft, engine = self.chat.session, self.chat.draft, self.model.engine
        if session is not None:
            title, system, sampling = session.title, session.system_prompt, session.sampling
        else:
            title = draft.get("title", NEW_CHAT)
            system = draft.get("system_prompt", self.config.system_prompt)
            if system is None and engine:
                system = engine.system_prompt  # the model's, which a new chat takes
            sampling = draft.get("sampling", dict(self.config.sampling))
        defaults = engine.sampling_defaults if engine else DEFAULT_SAMPLING
        screen = SettingsScreen(title, system, sampling, self.config.max_tokens, defaults)

        def save(settings: dict) -> tuple[Session, list[Message]]:
            return self.chat.sessions.read(self.chat.sessions.update(session.id, **settings).id)

        async def saved(result: tuple[Session, list[Message]]) -> None:
            await self.chat.show(*result)
            self.chat.notify("Settings saved for this chat", timeout=3)

        async def chosen(settings: dict | None) -> None:
            if not settings:
                return
            if session is not None:
                self.chat.run(partial(save, settings), saved)
                return
            if settings["system_prompt"] is None and system:
                settings["system_prompt"] = ""  # the prompt shown was cleared: none, not the model's
            if session_title(settings["title"]) in ("", NEW_CHAT):
                del settings["title"]  # the first message names it
            self.chat.draft = settings
            shown = settings["system_prompt"] if settings["system_prompt"] is not None else system
            await self.chat.conversation.show_system_prompt(shown)
            self.chat.notify("Settings kept for this chat: it is stored with its first message", timeout=3)

        self.chat.ask(screen, chosen)

    # -- export, import, attach ------------------------------------------------------------------

    def export(self) -> None:
        session = self.chat.session
        if session is None:
            self.chat.notify("Nothing to export: this chat is not saved yet.", severity="warning")
            return
        path = export_dir() / export_file_name(session)
        hint = "Enter writes it (a name ending in .md: a Markdown transcript), Tab completes, Esc cancels"
        screen = TextScreen("Export chat", str(path), hint=hint, path=True)

        def write(path: str | None) -> None:
            if path:
                target = Path(path.strip()).expanduser()
                written = partial(self.chat.notify, title="Exported", timeout=8)
                self.chat.run(partial(self.export_to, session.id, target), written, title="Not exported")

        self.chat.ask(screen, write)

    def export_to(self, session_id: str, target: Path) -> str:
        """On a worker thread: write a session to a file; what was written."""
        sessions = self.chat.sessions
        try:
            target.parent.mkdir(parents=True, exist_ok=True)  # (the default folder, the first time)
            if target.suffix == ".md":
                sessions.export_markdown(session_id, target)
                return f"wrote {target}"
            return sessions.export(session_id, target, progress=self.chat.status.reporter()).describe()
        finally:
            self.chat.status.post_message(WorkDone())

    def import_chat(self) -> None:
        if not self.flow.can_start("import"):
            return
        if self.model.loading:  # KV made by the model here comes in with the messages
            self.chat.notify("The model is loading; wait for it, then import.", severity="warning")
            return
        hint = "The path of a .llamachat file (Tab completes)"
        screen = TextScreen("Import chat", str(Path.cwd()) + "/", hint=hint, path=True)

        def read(path: str | None) -> None:
            if path:
                source = Path(path.strip()).expanduser()
                self.chat.run(partial(self.import_from, source), self.imported, title="Not imported")

        self.chat.ask(screen, read)

    def import_from(self, path: Path):
        """On a worker thread: add the sessions of a file, with the KV this model made."""
        try:
            return self.chat.sessions.import_file(path, progress=self.chat.status.reporter())
        finally:
            self.chat.status.post_message(WorkDone())

    def imported(self, result) -> None:
        self.chat.notify(result.describe(), title="Imported", timeout=8)
        self.chat.switch_to(result.session_ids[0])

    def attach(self) -> None:
        """F5: a text file for the next message (the reply flow's `attached`, sent with it)."""
        hint = "A text file: it goes with your next message (Tab completes the path)"
        screen = TextScreen("Attach file", str(Path.cwd()) + "/", hint=hint, path=True)

        def attach(path: str | None) -> None:
            if not path or not path.strip():
                return
            source = Path(path.strip()).expanduser()
            try:  # named as `chat` started here names it: its path from here, else its file name
                self.flow.attached.append(read_attachment(str(source), name=named_in(source, Path.cwd())))
            except AttachmentError as e:
                self.chat.notify(str(e), title="Not attached", severity="error", timeout=10)
                return
            names = ", ".join(a.name for a in self.flow.attached)
            self.chat.notify(f"{names}: sent with your next message", title="Attached")

        self.chat.ask(screen, attach)
