"""What the chat's keys do, beyond sending and stopping: open chats, branch (regenerate, edit, fork),
rename, delete, settings, model, export, import, attach a file, help, and the command palette built
from the bindings.

ChatActions is held by the chat screen, whose actions and handlers call it: each checks what it can,
asks in a dialog, and leaves the store's work to the screen's `in_background` and a reply's to its
reply flow.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

from textual.app import SystemCommand

from llama_chat.inference import KNOWN_MODELS
from llama_chat.inference.catalog import model_status
from llama_chat.storage import Message, Session

from ..chat.attachments import AttachmentError, read_attachment
from ..chat.engine import fork_before
from ..chat.replies import make_session
from ..chat.settings import DEFAULT_SAMPLING
from ..chat.titles import session_title
from ..config import export_dir
from .dialogs import ConfirmScreen, HelpScreen, ModelScreen, SettingsScreen, TextScreen
from .replies import Reply
from .sidebar import ChatRef
from .widgets import ChatInput, MessageView, WorkDone, model_label


class ChatActions:
    """The actions of the chat screen that open a dialog or make a branch."""

    def __init__(self, screen):
        self.screen = screen  # the ChatScreen

    def choose_model(self) -> None:
        if not self.screen.flow.can_start("change the model"):
            return
        models = []
        for known in KNOWN_MODELS.values():
            status = model_status(known)
            state = "ready" if status["assembled"] else "assembled on first use"
            installed = status["packages_installed"] or status["assembled"]
            models.append((known.name, state if installed else "not installed"))
        current = model_label(self.screen.engine.model_info) if self.screen.engine else None

        def chosen(name: str | None) -> None:
            if name and self.screen.flow.can_start("change the model"):
                self.screen.loading_model = "loading a model"
                self.screen.load_engine(name, remember=True)

        self.screen.app.push_screen(ModelScreen(models, current), chosen)

    # -- opening chats -------------------------------------------------------------------------

    def open_ref(self, ref: ChatRef | None) -> None:
        """A chat (or a message of one) picked in the sidebar."""
        if ref is None:
            return
        if self.screen.session is not None and ref.session_id == self.screen.session.id:
            if ref.message_id is not None:
                self.screen.show_message(ref.message_id)
        elif self.screen.flow.can_start("switch chats"):
            self.screen.switch_to(ref.session_id, ref.message_id)

    async def new_chat(self) -> None:
        if not self.screen.flow.can_start("start a new chat"):
            return
        await self.screen.show_session(None, [])
        self.screen.query_one(ChatInput).focus()

    def search(self) -> None:
        self.show_sidebar(True)
        self.screen.sidebar.search.focus()

    def toggle_sidebar(self) -> None:
        self.show_sidebar(not self.screen.sidebar.display)

    def toggle_api_chats(self) -> None:
        self.screen.sidebar.hide_api = not self.screen.sidebar.hide_api
        self.screen.sidebar.show_chats(self.screen.session.id if self.screen.session else None)
        self.screen.notify(
            "API chats hidden (F6 shows them)" if self.screen.sidebar.hide_api else "API chats shown",
            timeout=3,
        )

    def show_sidebar(self, show: bool) -> None:
        """Show or hide the sidebar, whatever the terminal's width would choose."""
        self.screen.set_class(show, "-show-sidebar")
        self.screen.set_class(not show, "-hide-sidebar")
        if not show and self.screen.sidebar.has_focus_within:
            self.screen.query_one(ChatInput).focus()

    # -- replies in a new branch -----------------------------------------------------------------

    def regenerate(self) -> None:
        """A new reply in a sibling branch: the old one stays in its own session."""
        target, session = self.screen.conversation.reply_target(), self.screen.session
        if not self.screen.flow.can_reply("regenerate"):
            return
        if target is None or session is None or target.parent_id is None:
            self.screen.notify("There is no reply to regenerate.", severity="warning")
            return
        self.screen.flow.submit(
            Reply(session, max_tokens=self.screen.flow.max_tokens(session), regenerate=target)
        )

    def regenerate_three(self) -> None:
        """Three new replies to the last message, decoded together, each in its own branch."""
        last, session = self.screen.conversation.last(), self.screen.session
        if not self.screen.flow.can_reply("regenerate"):
            return
        if session is None or last is None or last.role != "assistant" or last.message is None:
            self.screen.notify(
                "Regenerate ×3 needs a conversation that ends with a reply.", severity="warning"
            )
            return
        self.screen.flow.submit(
            Reply(session, max_tokens=self.screen.flow.max_tokens(session), regenerate=last.message, n=3)
        )

    def edit(self, view: MessageView) -> None:
        """Edit a past message of yours (on a reply, `view`: the message it answers); the new text and
        its reply go in a sibling branch."""
        if not self.screen.flow.can_reply("edit"):
            return
        views = self.screen.conversation.views()
        mine = [v for v in views[: views.index(view) + 1] if v.role == "user"]
        message, session = mine[-1].message if mine else None, self.screen.session
        if message is None or session is None:
            self.screen.notify(
                "Select one of your messages (↑ from the input) to edit it.", severity="warning"
            )
            return

        def edited(new_text: str | None) -> None:
            if (
                new_text
                and new_text.strip()
                and new_text != message.content
                and self.screen.flow.can_reply("edit")
            ):
                self.screen.flow.submit(
                    Reply(session, new_text, self.screen.flow.max_tokens(session), edited=message)
                )

        self.screen.app.push_screen(
            TextScreen("Edit message (a new branch)", message.content, multiline=True), edited
        )

    # -- branching, renaming, deleting, settings -------------------------------------------------

    def fork(self) -> None:
        """Fork at the head into a new session and open it; at a selected reply, fork after it; at a
        selected message of yours, fork before it with its text in the input, ready to change and send
        (a fork that kept it would end on a question without its answer)."""
        if not self.screen.flow.can_start("fork"):
            return
        if self.screen.session is None or self.screen.session.head_id is None:
            self.screen.notify("Nothing to fork yet: send a message first.", severity="warning")
            return
        view = self.screen.conversation.selected()
        self.screen.in_background(
            partial(self.fork_at, self.screen.session, view.message if view else None), self.forked
        )

    def fork_at(self, session: Session, at: Message | None) -> tuple[Session, list[Message], str | None, str]:
        """On a worker thread: the fork, its messages, the text to put in the input, what to say."""
        engine = self.screen.engine
        if at is not None and at.role == "user":
            child = (
                engine.fork(session, before=at.id) if engine else fork_before(self.screen.store, session, at)
            )
            draft, done = at.content, "Forked before your message: change it, then Enter sends it"
        else:
            at_id = at.id if at is not None and at.id != session.head_id else None
            child = (
                engine.fork(session, at_id) if engine else self.screen.store.fork_session(session.id, at_id)
            )
            draft, done = None, "Forked after this reply" if at_id else f"Forked into “{child.title}”"
        return child, self.screen.store.path(child.head_id), draft, done

    async def forked(self, result: tuple[Session, list[Message], str | None, str]) -> None:
        """Show the new branch; what the user types next goes to the input (with the draft, if any)."""
        child, path, draft, done = result
        await self.screen.show_session(child, path)
        chat_input = self.screen.query_one(ChatInput)
        if draft is not None:
            chat_input.load_text(draft)
            chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()
        self.screen.notify(done, timeout=5)
        self.screen.resume(child)

    def rename(self) -> None:
        session = self.screen.session
        if session is None:
            self.screen.notify("This chat has no title yet: send a message first.", severity="warning")
            return

        def rename(title: str) -> Session:
            self.screen.store.rename_session(session.id, title)
            return self.screen.store.get_session(session.id)

        def renamed(title: str | None) -> None:
            title = session_title(title or "")
            if title and title != session.title:
                self.screen.in_background(partial(rename, title), self.retitled)

        self.screen.app.push_screen(TextScreen("Rename chat", session.title), renamed)

    def retitled(self, session: Session) -> None:
        if self.screen.session is not None and self.screen.session.id == session.id:
            self.screen.opened(session)
        else:
            self.screen.sidebar.show_chats(self.screen.session.id if self.screen.session else None)

    def delete(self, session_id: str | None) -> None:
        """Ask, then delete a session; when it was the open one, the newest left opens."""
        if session_id is None:
            self.screen.notify("Nothing to delete: this chat is not saved yet.", severity="warning")
            return
        if not self.screen.flow.can_start("delete"):
            return

        def ask(session: Session) -> None:
            question = f"Delete “{session.title}”? Messages its forks still reach are kept."
            screen = ConfirmScreen("Delete chat", question, yes="Delete")
            self.screen.app.push_screen(
                screen, lambda yes: yes and self.screen.in_background(delete, deleted)
            )

        def delete() -> tuple[Session | None, list[Message]] | None:
            if self.screen.engine is not None:  # its KV goes too
                self.screen.engine.delete(session_id)
            else:
                self.screen.store.delete_session(session_id)
            if self.screen.session is None or self.screen.session.id != session_id:
                return None
            sessions = self.screen.store.list_sessions()
            return (sessions[0], self.screen.store.path(sessions[0].head_id)) if sessions else (None, [])

        async def deleted(next_open: tuple[Session | None, list[Message]] | None) -> None:
            self.screen.notify("Chat deleted", timeout=3)
            if next_open is None:
                self.screen.sidebar.show_chats(self.screen.session.id if self.screen.session else None)
                return
            await self.screen.show_session(*next_open)
            if next_open[0] is not None:
                self.screen.resume(next_open[0])

        self.screen.in_background(partial(self.screen.store.get_session, session_id), ask)

    def settings(self) -> None:
        """System prompt, sampling and title of this chat (a new chat is stored with them)."""
        session = self.screen.session
        title = session.title if session else "New chat"
        system = session.system_prompt if session else self.screen.config.system_prompt
        if session is None and system is None and self.screen.engine:
            system = self.screen.engine.system_prompt  # the model's, which a new chat takes
        sampling = session.sampling if session else dict(self.screen.config.sampling)
        defaults = self.screen.engine.sampling_defaults if self.screen.engine else DEFAULT_SAMPLING
        screen = SettingsScreen(title, system, sampling, self.screen.config.max_tokens, defaults)

        def save(settings: dict) -> tuple[Session, list[Message]]:
            settings = {**settings, "title": session_title(settings["title"]) or "New chat"}
            target, engine = session, self.screen.engine
            if target is None:  # a new chat is stored now, with its settings
                title = settings["title"]
                target = engine.new_session(title) if engine else make_session(self.screen.store, None, title)
            self.screen.store.update_session(target.id, **settings)
            target = self.screen.store.get_session(target.id)
            return target, self.screen.store.path(target.head_id)

        async def saved(result: tuple[Session, list[Message]]) -> None:
            await self.screen.show_session(*result)
            self.screen.notify("Settings saved for this chat", timeout=3)

        self.screen.app.push_screen(
            screen, lambda settings: settings and self.screen.in_background(partial(save, settings), saved)
        )

    # -- export, import, help, commands ----------------------------------------------------------

    def export(self) -> None:
        from llama_chat.storage.exchange import default_file_name

        session = self.screen.session
        if session is None:
            self.screen.notify("Nothing to export: this chat is not saved yet.", severity="warning")
            return
        path = export_dir() / default_file_name(session)
        hint = "Enter writes it (a name ending in .md writes a Markdown transcript), Esc cancels"
        screen = TextScreen("Export chat", str(path), hint=hint)

        def write(path: str | None) -> None:
            if path:
                target = Path(path.strip()).expanduser()
                written = partial(self.screen.notify, title="Exported", timeout=8)
                self.screen.in_background(
                    partial(self.export_to, session.id, target), written, title="Not exported"
                )

        self.screen.app.push_screen(screen, write)

    def export_to(self, session_id: str, target: Path) -> str:
        """On a worker thread: write a session to a file; what was written."""
        from llama_chat.storage.exchange import export_session
        from llama_chat.storage.transcript import export_markdown

        try:
            target.parent.mkdir(parents=True, exist_ok=True)  # (the default folder, the first time)
            if target.suffix == ".md":
                export_markdown(self.screen.store, session_id, target)
                return f"wrote {target}"
            return export_session(
                self.screen.store, session_id, target, progress=self.screen.progress_reporter()
            ).describe()
        finally:
            self.screen.post_message(WorkDone())

    def import_chat(self) -> None:
        if not self.screen.flow.can_start("import"):
            return
        if self.screen.loading_model:  # KV made by the model here comes in with the messages
            self.screen.notify("The model is loading; wait for it, then import.", severity="warning")
            return
        screen = TextScreen("Import chat", str(Path.cwd()) + "/", hint="The path of a .llamachat file")

        def read(path: str | None) -> None:
            if path:
                source = Path(path.strip()).expanduser()
                self.screen.in_background(
                    partial(self.import_from, source), self.imported, title="Not imported"
                )

        self.screen.app.push_screen(screen, read)

    def import_from(self, path: Path):
        """On a worker thread: add the sessions of a file, with the KV this model made."""
        from llama_chat.storage.exchange import import_session

        fingerprint = self.screen.engine.model_info.fingerprint if self.screen.engine else None
        try:
            return import_session(
                self.screen.store,
                path,
                model_fingerprint=fingerprint,
                progress=self.screen.progress_reporter(),
            )
        finally:
            self.screen.post_message(WorkDone())

    def imported(self, result) -> None:
        self.screen.notify(result.describe(), title="Imported", timeout=8)
        self.screen.switch_to(result.session_ids[0])

    def attach(self) -> None:
        """F5: a text file for the next message (the screen's `attached`, sent with it)."""
        screen = TextScreen("Attach file", str(Path.cwd()) + "/", hint="A text file: it goes with your next message")

        def attach(path: str | None) -> None:
            if not path or not path.strip():
                return
            try:
                self.screen.attached.append(read_attachment(str(Path(path.strip()).expanduser())))
            except AttachmentError as e:
                self.screen.notify(str(e), title="Not attached", severity="error", timeout=10)
                return
            names = ", ".join(a.name for a in self.screen.attached)
            self.screen.notify(f"{names}: sent with your next message", title="Attached")

        self.screen.app.push_screen(screen, attach)

    def help(self) -> None:
        self.screen.app.push_screen(HelpScreen(self.screen.app.key_help(), str(self.screen.config.path)))

    async def act_on_message(self, action: str) -> None:
        """A message's action from the command palette: on the selected message, else the last one."""
        view = self.screen.conversation.selected() or self.screen.conversation.last()
        if view is None:
            self.screen.notify("There is no message yet.", severity="warning")
        else:
            await view.run_action(action)

    def commands(self) -> Iterator[SystemCommand]:
        """The command palette: every binding of the chat and of a message that says what it does."""
        for binding in self.screen.BINDINGS:
            if binding.tooltip:
                yield SystemCommand(
                    binding.description, binding.tooltip, partial(self.screen.run_action, binding.action)
                )
        for binding in MessageView.BINDINGS:
            if binding.tooltip:
                yield SystemCommand(
                    binding.description, binding.tooltip, partial(self.act_on_message, binding.action)
                )
