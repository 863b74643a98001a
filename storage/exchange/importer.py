"""Importing a .llamachat file into the store: its sessions under new ids, its KV in a namespace of its
own until `sessions verify` checks it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from ..records import marked_title
from ..store import ChatStore
from .format import Progress
from .reader import SessionFile, read_session_file


@dataclass
class ImportResult:
    session_ids: list[str]  # the new ids, the exported session's first
    title: str
    messages: int
    kv: str  # "imported"; "none": the file has no KV; "recompute": made by a model not here
    blocks_added: int  # in the import's own namespace
    model_name: str | None

    def describe(self) -> str:
        head = f"imported '{self.title}' as {self.session_ids[0]}"
        if len(self.session_ids) > 1:
            head += f" (and {len(self.session_ids) - 1} more session(s) of its tree)"
        head += f": {self.messages} message(s)"
        if self.kv == "imported":
            return (
                f"{head}, with its saved model state (so it resumes at once). That state came from a file: "
                f"only this chat uses it until `llama-chat sessions verify {self.session_ids[0]}` checks it"
            )
        if self.kv == "none":
            return f"{head}; the file holds no KV, so the first reply computes it"
        return (
            f"{head}; its KV was made by {self.model_name or 'another model'}, which is not the model "
            f"here: it will be recomputed on first use"
        )


def import_session(
    store: ChatStore,
    source: SessionFile | str | Path,
    *,
    model_fingerprint: str | None,
    progress: Progress | None = None,
    tenant: str | None = None,
    kv_namespace: bytes | None = None,
) -> ImportResult:
    """Add the session(s) of a file under new ids, in one transaction; never overwrites anything.

    `model_fingerprint` is the model that will resume them here (None: no model). KV made by
    another model is left out: the messages come in, and the first reply recomputes it. A file is
    read and checked whole before the database is touched, so a bad file leaves it as it was; its KV
    bytes are then read again a block at a time as they are stored (a file changed meanwhile fails
    the transaction), so no import holds more than a block of them.

    A file's KV is not trusted: its blocks could hold anything under any key, and a block stored
    under a key other sessions use would change their replies. So they go into a namespace of this
    import's own (vLLM's cache_salt), which only its sessions and their forks read, until `sessions
    verify` recomputes and compares them. Blocks without their tokens (files from before blocks
    carried them) are left out: a block is used only where its tokens match. A file without KV makes
    sessions in `kv_namespace` (a server's tenant's), and makes them that tenant's (`tenant`)."""
    file = source if isinstance(source, SessionFile) else read_session_file(source, progress)
    keep = {s.id for s in file.sessions if model_fingerprint and s.model_fingerprint == model_fingerprint}
    sessions = [s if s.id in keep else replace(s, n_tokens=0) for s in file.sessions]
    sessions = [replace(s, title=marked_title(s.title, "(imported)")) for s in sessions]  # not its original
    blocks = [(fp, b) for fp, b in file.blocks if fp == model_fingerprint and b.tokens]
    block_lists = {sid: keys for sid, keys in file.block_lists.items() if sid in keep}
    tails = {sid: replace(t, data=file.data(sid)) for sid, t in file.tails.items() if sid in keep}
    namespace = secrets.token_bytes(16) if blocks or tails else kv_namespace
    if progress:
        progress(f"importing {file.path.name}", 0, 1)
    blocks_read = ((fp, replace(b, data=file.data(b.key))) for fp, b in blocks)  # one at a time, as stored
    new_ids, added = store.add_imported(
        file.messages, sessions, blocks_read, block_lists, tails, namespace, tenant
    )
    if progress:
        progress(f"importing {file.path.name}", 1, 1)
    main = file.sessions[0]
    if not file.has_kv:
        kv = "none"
    else:
        kv = "imported" if blocks or tails else "recompute"
    return ImportResult(
        session_ids=[new_ids[s.id] for s in file.sessions],
        title=main.title,
        messages=len(file.messages),
        kv=kv,
        blocks_added=added,
        model_name=main.model_name,
    )
