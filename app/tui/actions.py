"""What the chat's keys do, beyond sending and stopping: open chats, branch (regenerate, edit, fork),
rename, delete, settings, model, export, import, attach a file, help, and the command palette built from the bindings.

A part of ChatScreen (it is mixed into it): each action checks what it can, asks in a dialog, and
leaves the store's work to `in_background` and a reply's to `submit`. Handlers are named `on_…`:
Textual's `@on` is collected only in its own classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

from textual.app import SystemCommand
from textual.widgets import Tree

from llama_chat.inference import KNOWN_MODELS
from llama_chat.inference.catalog import model_status
from llama_chat.storage import Message, Session

from ..chat.attachments import AttachmentError, read_attachment
from ..chat.engine import fork_before, session_title
from ..chat.settings import DEFAULT_SAMPLING
from ..config import export_dir
from .dialogs import ConfirmScreen, HelpScreen, ModelScreen, SettingsScreen, TextScreen
from .replies import Reply
from .sidebar import ChatRef, SessionTree
from .widgets import ChatInput, MessageView, WorkDone, model_label


class ChatActions:
    """The actions of ChatScreen that open a dialog or make a branch."""

    def action_choose_model(self) -> None:
        if not self.can_start("change the model"):
            return
        models = []
        for known in KNOWN_MODELS.values():
            status = model_status(known)
            state = "ready" if status["assembled"] else "assembled on first use"
            installed = status["packages_installed"] or status["assembled"]
            models.append((known.name, state if installed else "not installed"))
        current = model_label(self.engine.model) if self.engine else None

        def chosen(name: str | None) -> None:
            if name and self.can_start("change the model"):
                self.loading_model = "loading a model"
                self.load_engine(name, remember=True)

        self.app.push_screen(ModelScreen(models, current), chosen)

    # -- opening chats -------------------------------------------------------------------------

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

    def on_tree_node_selected(self, event: Tree.NodeSelected) -> None:
        ref: ChatRef | None = event.node.data
        if ref is None:
            return
        if self.session is not None and ref.session_id == self.session.id:
            if ref.message_id is not None:
                self.show_message(ref.message_id)
        elif self.can_start("switch chats"):
            self.switch_to(ref.session_id, ref.message_id)

    async def action_new_chat(self) -> None:
        if not self.can_start("start a new chat"):
            return
        await self.show_session(None, [])
        self.query_one(ChatInput).focus()

    def action_search(self) -> None:
        self.show_sidebar(True)
        self.sidebar.search.focus()

    def action_toggle_sidebar(self) -> None:
        self.show_sidebar(not self.sidebar.display)

    def action_toggle_api_chats(self) -> None:
        self.sidebar.hide_api = not self.sidebar.hide_api
        self.sidebar.show_chats(self.session.id if self.session else None)
        self.notify("API chats hidden (F6 shows them)" if self.sidebar.hide_api else "API chats shown", timeout=3)

    def show_sidebar(self, show: bool) -> None:
        """Show or hide the sidebar, whatever the terminal's width would choose."""
        self.set_class(show, "-show-sidebar")
        self.set_class(not show, "-hide-sidebar")
        if not show and self.sidebar.has_focus_within:
            self.query_one(ChatInput).focus()

    # -- replies in a new branch -----------------------------------------------------------------

    def action_regenerate(self) -> None:
        """A new reply in a sibling branch: the old one stays in its own session."""
        target, session = self.conversation.reply_target(), self.session
        if not self.can_reply("regenerate"):
            return
        if target is None or session is None or target.parent_id is None:
            self.notify("There is no reply to regenerate.", severity="warning")
            return
        self.submit(Reply(session, max_tokens=self.max_tokens(session), regenerate=target))

    def action_regenerate_three(self) -> None:
        """Three new replies to the last message, decoded together, each in its own branch."""
        last, session = self.conversation.last(), self.session
        if not self.can_reply("regenerate"):
            return
        if session is None or last is None or last.role != "assistant" or last.message is None:
            self.notify("Regenerate ×3 needs a conversation that ends with a reply.", severity="warning")
            return
        self.submit(Reply(session, max_tokens=self.max_tokens(session), regenerate=last.message, n=3))

    def on_message_view_edit(self, event: MessageView.Edit) -> None:
        """Edit a past message of yours (on a reply: the message it answers); the new text and its
        reply go in a sibling branch."""
        if not self.can_reply("edit"):
            return
        views = self.conversation.views()
        mine = [v for v in views[: views.index(event.view) + 1] if v.role == "user"]
        message, session = mine[-1].message if mine else None, self.session
        if message is None or session is None:
            self.notify("Select one of your messages (↑ from the input) to edit it.", severity="warning")
            return

        def edited(new_text: str | None) -> None:
            if new_text and new_text.strip() and new_text != message.content and self.can_reply("edit"):
                self.submit(Reply(session, new_text, self.max_tokens(session), edited=message))

        self.app.push_screen(
            TextScreen("Edit message (a new branch)", message.content, multiline=True), edited
        )

    # -- branching, renaming, deleting, settings -------------------------------------------------

    def action_fork(self) -> None:
        """Fork at the head into a new session and open it; at a selected reply, fork after it; at a
        selected message of yours, fork before it with its text in the input, ready to change and send
        (a fork that kept it would end on a question without its answer)."""
        if not self.can_start("fork"):
            return
        if self.session is None or self.session.head_id is None:
            self.notify("Nothing to fork yet: send a message first.", severity="warning")
            return
        view = self.conversation.selected()
        self.in_background(partial(self.fork_at, self.session, view.message if view else None), self.forked)

    def fork_at(self, session: Session, at: Message | None) -> tuple[Session, list[Message], str | None, str]:
        """On a worker thread: the fork, its messages, the text to put in the input, what to say."""
        if at is not None and at.role == "user":
            child = fork_before(self.store, session, at)
            draft, done = at.content, "Forked before your message: change it, then Enter sends it"
        else:
            at_id = at.id if at is not None and at.id != session.head_id else None
            engine = self.engine
            child = engine.fork(session, at_id) if engine else self.store.fork_session(session.id, at_id)
            draft, done = None, "Forked after this reply" if at_id else f"Forked into “{child.title}”"
        return child, self.store.path(child.head_id), draft, done

    async def forked(self, result: tuple[Session, list[Message], str | None, str]) -> None:
        """Show the new branch; what the user types next goes to the input (with the draft, if any)."""
        child, path, draft, done = result
        await self.show_session(child, path)
        chat_input = self.query_one(ChatInput)
        if draft is not None:
            chat_input.load_text(draft)
            chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()
        self.notify(done, timeout=5)
        self.resume(child)

    def action_rename(self) -> None:
        session = self.session
        if session is None:
            self.notify("This chat has no title yet: send a message first.", severity="warning")
            return

        def rename(title: str) -> Session:
            self.store.rename_session(session.id, title)
            return self.store.get_session(session.id)

        def renamed(title: str | None) -> None:
            title = session_title(title or "")
            if title and title != session.title:
                self.in_background(partial(rename, title), self.retitled)

        self.app.push_screen(TextScreen("Rename chat", session.title), renamed)

    def retitled(self, session: Session) -> None:
        if self.session is not None and self.session.id == session.id:
            self.opened(session)
        else:
            self.sidebar.show_chats(self.session.id if self.session else None)

    def on_session_tree_delete(self, event: SessionTree.Delete) -> None:
        self.delete(event.session_id)

    def action_delete(self) -> None:
        if self.session is None:
            self.notify("Nothing to delete: this chat is not saved yet.", severity="warning")
            return
        self.delete(self.session.id)

    def delete(self, session_id: str) -> None:
        """Ask, then delete a session; when it was the open one, the newest left opens."""
        if not self.can_start("delete"):
            return

        def ask(session: Session) -> None:
            question = f"Delete “{session.title}”? Messages its forks still reach are kept."
            screen = ConfirmScreen("Delete chat", question, yes="Delete")
            self.app.push_screen(screen, lambda yes: yes and self.in_background(delete, deleted))

        def delete() -> tuple[Session | None, list[Message]] | None:
            self.store.delete_session(session_id)
            if self.engine is not None:
                with self.engine.lock:
                    self.engine.close(session_id)
            if self.session is None or self.session.id != session_id:
                return None
            sessions = self.store.list_sessions()
            return (sessions[0], self.store.path(sessions[0].head_id)) if sessions else (None, [])

        async def deleted(next_open: tuple[Session | None, list[Message]] | None) -> None:
            self.notify("Chat deleted", timeout=3)
            if next_open is None:
                self.sidebar.show_chats(self.session.id if self.session else None)
                return
            await self.show_session(*next_open)
            if next_open[0] is not None:
                self.resume(next_open[0])

        self.in_background(partial(self.store.get_session, session_id), ask)

    def action_settings(self) -> None:
        """System prompt, sampling and title of this chat (a new chat is stored with them)."""
        session = self.session
        title = session.title if session else "New chat"
        system = session.system_prompt if session else self.config.system_prompt
        sampling = session.sampling if session else dict(self.config.sampling)
        defaults = self.engine.sampling_defaults if self.engine else DEFAULT_SAMPLING
        screen = SettingsScreen(title, system, sampling, self.config.max_tokens, defaults)

        def save(settings: dict) -> tuple[Session, list[Message]]:
            settings = {**settings, "title": session_title(settings["title"]) or "New chat"}
            target, engine = session, self.engine
            if target is None:  # a new chat is stored now, with its settings
                title = settings["title"]
                target = engine.new_session(title) if engine else self.store.create_session(title)
            self.store.update_session(target.id, **settings)
            target = self.store.get_session(target.id)
            return target, self.store.path(target.head_id)

        async def saved(result: tuple[Session, list[Message]]) -> None:
            await self.show_session(*result)
            self.notify("Settings saved for this chat", timeout=3)

        self.app.push_screen(
            screen, lambda settings: settings and self.in_background(partial(save, settings), saved)
        )

    # -- export, import, help, commands ----------------------------------------------------------

    def action_export(self) -> None:
        from llama_chat.storage.exchange import default_file_name

        session = self.session
        if session is None:
            self.notify("Nothing to export: this chat is not saved yet.", severity="warning")
            return
        path = export_dir() / default_file_name(session)
        hint = "Enter writes it (a name ending in .md writes a Markdown transcript), Esc cancels"
        screen = TextScreen("Export chat", str(path), hint=hint)

        def write(path: str | None) -> None:
            if path:
                target = Path(path.strip()).expanduser()
                written = partial(self.notify, title="Exported", timeout=8)
                self.in_background(partial(self.export_to, session.id, target), written, title="Not exported")

        self.app.push_screen(screen, write)

    def export_to(self, session_id: str, target: Path) -> str:
        """On a worker thread: write a session to a file; what was written."""
        from llama_chat.storage.exchange import export_session
        from llama_chat.storage.transcript import export_markdown

        try:
            target.parent.mkdir(parents=True, exist_ok=True)  # (the default folder, the first time)
            if target.suffix == ".md":
                export_markdown(self.store, session_id, target)
                return f"wrote {target}"
            return export_session(
                self.store, session_id, target, progress=self.progress_reporter()
            ).describe()
        finally:
            self.post_message(WorkDone())

    def action_import(self) -> None:
        if not self.can_start("import"):
            return
        if self.loading_model:  # KV made by the model here comes in with the messages
            self.notify("The model is loading; wait for it, then import.", severity="warning")
            return
        screen = TextScreen("Import chat", str(Path.cwd()) + "/", hint="The path of a .llamachat file")

        def read(path: str | None) -> None:
            if path:
                source = Path(path.strip()).expanduser()
                self.in_background(partial(self.import_from, source), self.imported, title="Not imported")

        self.app.push_screen(screen, read)

    def import_from(self, path: Path):
        """On a worker thread: add the sessions of a file, with the KV this model made."""
        from llama_chat.storage.exchange import import_session

        fingerprint = self.engine.model.fingerprint if self.engine else None
        try:
            return import_session(
                self.store, path, model_fingerprint=fingerprint, progress=self.progress_reporter()
            )
        finally:
            self.post_message(WorkDone())

    def imported(self, result) -> None:
        self.notify(result.describe(), title="Imported", timeout=8)
        self.switch_to(result.session_ids[0])

    def action_attach(self) -> None:
        screen = TextScreen("Attach file", str(Path.cwd()) + "/", hint="A text file: it goes with your next message")

        def attach(path: str | None) -> None:
            if not path or not path.strip():
                return
            try:
                self.attached.append(read_attachment(str(Path(path.strip()).expanduser())))
            except AttachmentError as e:
                self.notify(str(e), title="Not attached", severity="error", timeout=10)
                return
            names = ", ".join(a.name for a in self.attached)
            self.notify(f"{names}: sent with your next message", title="Attached")

        self.app.push_screen(screen, attach)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.app.key_help(), str(self.config.path)))

    async def act_on_message(self, action: str) -> None:
        """A message's action from the command palette: on the selected message, else the last one."""
        view = self.conversation.selected() or self.conversation.last()
        if view is None:
            self.notify("There is no message yet.", severity="warning")
        else:
            await view.run_action(action)

    def commands(self) -> Iterator[SystemCommand]:
        """The command palette: every binding of the chat and of a message that says what it does."""
        for binding in self.BINDINGS:
            if binding.tooltip:
                yield SystemCommand(
                    binding.description, binding.tooltip, partial(self.run_action, binding.action)
                )
        for binding in MessageView.BINDINGS:
            if binding.tooltip:
                yield SystemCommand(
                    binding.description, binding.tooltip, partial(self.act_on_message, binding.action)
                )
