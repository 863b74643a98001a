"""The stored conversations as every front end sees them: list, search, read, rename, delete, fork,
export and import, the same before a model has loaded as after.

A front end opens its conversations here and never the store itself. Once a chat engine is built on
them (build.open_engine), the verbs that concern the KV it holds go through the engine: a fork shares
the parent's KV in RAM, a delete waits for a turn being stored and lets its KV go. Making a session and
replying in one are the engine's verbs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llama_chat.storage.store import ChatStore, Message, Session
from llama_chat.storage.transcript import export_markdown, markdown_transcript

from .titles import session_title

if TYPE_CHECKING:  # (the engine loads with a model: listing and reading chats need neither)
    from llama_chat.storage.exchange import ExportSummary, ImportResult, SessionFile

    from .engine import ChatEngine

# what a front end checks of a file before it is read (the server, of an upload as it arrives): the
# exchange's names, loaded when first named, as the exchange loads the KV codecs, which listing and
# reading chats never need
FROM_EXCHANGE = (
    "HEADER_SIZE",
    "MAX_DATA_BYTES",
    "MAX_MANIFEST_BYTES",
    "SUFFIX",
    "ExchangeError",
    "ImportResult",
    "declared_size",
    "read_session_file",
)
__all__ = [*FROM_EXCHANGE, "Sessions", "export_file_name"]


def __getattr__(name: str):
    if name not in FROM_EXCHANGE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(exchange(), name)


def exchange():
    """storage.exchange, imported on first use."""
    from llama_chat.storage import exchange

    return exchange


Progress = Callable[[str, int, int], None]


def export_file_name(session: Session, markdown: bool = False) -> str:
    """The name an export of `session` gets where none is given: its title and id."""
    return exchange().default_file_name(session, ".md" if markdown else exchange().SUFFIX)


class Sessions:
    """The conversations of one database; `engine`, once one is built on them, hears of forks and
    deletes. Safe to call from worker threads, as the store is."""

    def __init__(self, db: Path | str, progress: Progress | None = None):
        self._store = ChatStore(db, progress)  # an older file upgraded, telling `progress`
        self.engine: ChatEngine | None = None  # set by build.open_engine
        self._seen_version = self._store.connection.data_version()  # what changed_elsewhere() compares with

    @property
    def store(self) -> ChatStore:
        """The database, for the chat layer alone: the engine is built on it (front ends use the verbs)."""
        return self._store

    @property
    def db_path(self) -> Path:
        return self._store.db_path

    @property
    def on_wait(self) -> Callable[[float], None] | None:
        """Called while another process holds the write lock, with the seconds waited so far."""
        return self._store.on_wait

    @on_wait.setter
    def on_wait(self, callback: Callable[[float], None] | None) -> None:
        self._store.on_wait = callback

    def changed_elsewhere(self) -> bool:
        """Whether another process (`ask --session`, a second app, `serve`) has written to the
        database since this was last asked (or since it was opened). Cheap enough to poll: SQLite's
        data_version, no table read; this process's own writes do not count."""
        version = self._store.connection.data_version()
        changed, self._seen_version = version != self._seen_version, version
        return changed

    def check_writable(self) -> None:
        """StoreError when nothing could be stored (a read-only file or folder)."""
        self._store.check_writable()

    def close(self) -> None:
        self._store.close()

    # -- reading -----------------------------------------------------------------------------------

    def list(
        self, tenant: str | None = None, limit: int | None = None, offset: int = 0, **which
    ) -> list[Session]:
        """The sessions, newest first (a page: `limit` of them from `offset` on); with a `tenant`, that
        tenant's only; `which`: by whom they were made, by words of their title (ChatStore.list_sessions)."""
        return self._store.list_sessions(tenant, limit, offset, **which)

    def get(self, id_or_prefix: str, tenant: str | None = None) -> Session:
        """A session by its id or a unique prefix of it (StoreError names one that is unknown)."""
        return self._store.get_session(id_or_prefix, tenant)

    def messages(self, session: Session) -> list[Message]:
        """The session's conversation, oldest first: the messages from the tree's root to its head."""
        return self._store.path(session.head_id)

    def read(self, session_id: str) -> tuple[Session, list[Message]]:
        """A session as it is stored now, and its conversation."""
        session = self._store.get_session(session_id)
        return session, self._store.path(session.head_id)

    def message(self, message_id: int) -> Message:
        return self._store.message(message_id)

    def search(self, text: str) -> list[tuple[Session, Message]]:
        """Each session whose conversation holds the words, with the message that does (full text)."""
        return self._store.search(text)

    # -- changing ----------------------------------------------------------------------------------

    def rename(self, session_id: str, title: str) -> Session:
        self._store.rename_session(session_id, session_title(title))
        return self._store.get_session(session_id)

    def update(self, session_id: str, **settings) -> Session:
        """Change a session's settings (title, system_prompt, sampling); the session as it is now."""
        if "title" in settings:
            settings["title"] = session_title(settings["title"])
        self._store.update_session(session_id, **settings)
        return self._store.get_session(session_id)

    def delete(self, session_id: str) -> int:
        """Delete a session (through the engine, when there is one: its turn being made is stored
        first, its KV goes). Messages its forks still reach are kept; returns how many went."""
        if self.engine is not None:
            return self.engine.delete(session_id)
        return self._store.delete_session(session_id)

    def fork(
        self,
        session: Session,
        at_message: int | None = None,
        title: str | None = None,
        *,
        before: int | None = None,
    ) -> Session:
        """A new session sharing `session`'s messages up to `at_message` (default: its head), or ending
        just before the message `before`; through the engine when there is one (it shares the KV in RAM)."""
        title = session_title(title) if title else None
        if self.engine is not None:
            return self.engine.fork(session, at_message, title, before=before)
        if before is not None:
            from .replies import fork_before

            return fork_before(self._store, session, self._store.message(before), title)
        return self._store.fork_session(session.id, at_message, title)

    def collect_garbage(self, budget_bytes: int | None = None) -> dict:
        """Remove the KV blocks no session uses (and, past `budget_bytes`, the least recently used)."""
        return self._store.kv.gc(budget_bytes)

    # -- files -------------------------------------------------------------------------------------

    def export(
        self,
        session_id: str,
        path: Path,
        *,
        with_kv: bool = True,
        codec: str | None = None,
        tree: bool = False,
        progress: Progress | None = None,
    ) -> ExportSummary:
        """Write a session (with `tree`, every session of its tree) to a .llamachat file."""
        return exchange().export_session(
            self._store, session_id, path, with_kv=with_kv, codec=codec, tree=tree, progress=progress
        )

    def export_markdown(self, session_id: str, path: Path) -> None:
        """Write a session's conversation to a Markdown transcript, for people."""
        export_markdown(self._store, session_id, path)

    def transcript(self, session_id: str) -> str:
        """A session's conversation as a Markdown transcript."""
        return markdown_transcript(self._store, session_id)

    def import_file(
        self,
        source: SessionFile | Path,
        *,
        model_fingerprint: str | None = None,
        progress: Progress | None = None,
        tenant: str | None = None,
        kv_namespace: bytes | None = None,
    ) -> ImportResult:
        """Add the sessions of a .llamachat file under new ids, with the KV made by the model whose
        `model_fingerprint` is given (default: the engine's)."""
        if model_fingerprint is None and self.engine is not None:
            model_fingerprint = self.engine.model_info.fingerprint
        return exchange().import_session(
            self._store,
            source,
            model_fingerprint=model_fingerprint,
            progress=progress,
            tenant=tenant,
            kv_namespace=kv_namespace,
        )
