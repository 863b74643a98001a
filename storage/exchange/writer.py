"""Exporting a session to a .llamachat file: its branch (or its whole tree) and its KV as stored, written
whole or not at all."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from llama_chat import __version__

from ..codec import CODECS, CorruptBlockError, checksum, decode_kv, encode_kv
from ..records import Message, Session
from ..store import ChatStore
from ..zstd_frames import compress_frame
from .format import (
    FORMAT,
    MANIFEST_ZSTD_LEVEL,
    MAX_DATA_BYTES,
    MAX_MANIFEST_BYTES,
    SUFFIX,
    VERSION,
    ExchangeError,
    Progress,
    entry_checksum,
    file_digest,
    pack_header,
)


@dataclass
class ExportSummary:
    path: Path
    bytes: int
    sessions: int
    messages: int
    blocks: int  # full KV blocks written
    tails: int  # sessions' last, partial blocks written
    kv_bytes: int

    def describe(self) -> str:
        kv = "no KV"
        if self.blocks or self.tails:
            kv = f"{self.blocks} KV block(s) and {self.tails} tail(s), {self.kv_bytes / 2**20:.1f} MB"
        return (
            f"wrote {self.path}: {self.sessions} session(s), {self.messages} message(s), {kv}; "
            f"{self.bytes / 2**20:.1f} MB in all"
        )


# -- export ------------------------------------------------------------------------------------------


def export_session(
    store: ChatStore,
    session_id: str,
    path: str | Path,
    *,
    with_kv: bool = True,
    codec: str | None = None,
    tree: bool = False,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write a session (its branch, or with tree=True every session on the tree under its root) to
    `path`. KV blocks are copied as stored, or re-encoded when `codec` differs; blocks that fail their
    checksum are left out (the importer recomputes them). The file appears whole or not at all."""
    if codec is not None and codec not in CODECS:
        raise ExchangeError(f"unknown KV codec '{codec}'; expected one of {', '.join(CODECS)}")
    path = Path(path)
    # one consistent snapshot, even while a reply of the same session is being saved
    with store.reading():
        manifest, block_blobs, tail_blobs = _collect(store, session_id, with_kv, codec, tree)
    blobs = block_blobs + tail_blobs
    size = _write_file(path, manifest, blobs, progress)
    return ExportSummary(
        path,
        size,
        len(manifest["sessions"]),
        len(manifest["messages"]),
        len(block_blobs),
        len(tail_blobs),
        sum(map(len, blobs)),
    )


def _collect(
    store: ChatStore, session_id: str, with_kv: bool, codec: str | None, tree: bool
) -> tuple[dict, list[bytes], list[bytes]]:
    """The manifest, the blocks' bytes and the tails' bytes of an export."""
    main = store.get_session(session_id)
    if tree:
        messages = _tree_messages(store, main)
        in_tree = {m.id for m in messages}
        sessions = [main] + [s for s in store.list_sessions() if s.head_id in in_tree and s.id != main.id]
    else:
        messages, sessions = store.path(main.head_id), [main]
    file_ids = {s.id for s in sessions}

    keys = {s.id: store.kv.block_keys(s.id) if with_kv and s.model_fingerprint else [] for s in sessions}
    block_blobs: list[bytes] = []  # the data section: blocks, then tails
    tail_blobs: list[bytes] = []
    block_entries: list[dict] = []
    tails: dict[str, dict] = {}
    seen: set[bytes] = set()
    for s in sessions:
        for key in keys[s.id]:
            if key in seen:
                continue
            seen.add(key)
            block = store.kv.load_block(key, s.model_fingerprint, s.kv_namespace)
            data = block and _export_bytes(block.data, block.checksum, block.codec, codec)
            if data:
                block_blobs.append(data)
                block_entries.append(
                    {
                        "key": key.hex(),
                        "fingerprint": s.model_fingerprint,
                        "codec": codec or block.codec,
                        "n_tokens": block.n_tokens,
                        "tokens": block.tokens,
                        "size": len(data),
                        "checksum": entry_checksum(data),
                    }
                )
        tail = store.kv.load_tail(s.id, s.model_fingerprint) if with_kv and s.model_fingerprint else None
        data = tail and _export_bytes(tail.data, tail.checksum, tail.codec, codec)
        if data:
            tail_blobs.append(data)
            tails[s.id] = {
                "parent_key": tail.parent_key.hex() if tail.parent_key else None,
                "tokens": tail.tokens,
                "codec": codec or tail.codec,
                "size": len(data),
                "checksum": entry_checksum(data),
            }

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "app": f"llama-chat {__version__}",
        "exported": time.time(),
        "model": {"name": main.model_name, "fingerprint": main.model_fingerprint},
        "messages": [
            {
                "id": m.id,
                "parent": m.parent_id,
                "role": m.role,
                "content": m.content,
                "token_ids": m.token_ids,
                "created": m.created,
                "stats": m.stats,
                "reasoning": m.reasoning,
            }
            for m in messages
        ],
        "sessions": [
            {
                "id": s.id,
                "title": s.title,
                "head": s.head_id,
                "model_name": s.model_name,
                "model_fingerprint": s.model_fingerprint,
                "system_prompt": s.system_prompt,
                "sampling": s.sampling,
                "forked_from": s.forked_from if s.forked_from in file_ids else None,
                "n_tokens": s.n_tokens if with_kv else 0,
                "created": s.created,
                "updated": s.updated,
                "blocks": [k.hex() for k in keys[s.id]],
                "tail": tails.get(s.id),
            }
            for s in sessions
        ],
        "blocks": block_entries,
    }
    return manifest, block_blobs, tail_blobs


def _tree_messages(store: ChatStore, main: Session) -> list[Message]:
    """The messages of every tree the session's fork family reaches, parents first: editing a first
    message starts a new root, and that branch belongs to the conversation all the same."""
    everyone = store.list_sessions()
    family, grew = {main.id}, True
    while grew:
        linked = {s.id for s in everyone if s.forked_from in family or s.id in family}
        linked |= {s.forked_from for s in everyone if s.id in family and s.forked_from}
        grew, family = linked != family, linked
    roots = set()
    for s in everyone:
        if s.id in family and s.head_id is not None:
            roots.add(store.path(s.head_id)[0].id)
    messages = {m.id: m for root in roots for m in store.message_tree(root)}
    return [messages[i] for i in sorted(messages)]  # ids grow, so parents come first


def _export_bytes(data: bytes, expected_checksum: str, stored_codec: str, codec: str | None) -> bytes | None:
    """A stored block's bytes for the file: as stored, or re-encoded; None when it is damaged."""
    data = bytes(data)
    if checksum(data) != expected_checksum:
        return None
    if codec is None or codec == stored_codec:
        return data
    try:
        return encode_kv(*decode_kv(data), codec)
    except (CorruptBlockError, ValueError):
        return None  # e.g. non-finite values q8 cannot hold: leave the block to be recomputed


def _write_file(path: Path, manifest: dict, blobs: list[bytes], progress: Progress | None) -> int:
    packed = compress_frame(json.dumps(manifest).encode(), MANIFEST_ZSTD_LEVEL)
    data_size = sum(map(len, blobs))
    if len(packed) > MAX_MANIFEST_BYTES or data_size > MAX_DATA_BYTES:
        raise ExchangeError(f"{path}: the session is too large for one file")
    parts = [pack_header(len(packed), data_size), packed, *blobs]
    digest = file_digest()

    def chunks():
        for i, part in enumerate(parts):
            digest.update(part)
            yield part
            if progress:
                progress(f"writing {path.name}", i + 1, len(parts))
        yield digest.digest()

    return write_whole(path, chunks())


def default_file_name(session: Session, suffix: str = SUFFIX) -> str:
    """`<title>-<id><suffix>`, the title cut to letters, digits and hyphens."""
    slug = re.sub(r"[^a-z0-9]+", "-", session.title.lower()).strip("-")[:40].strip("-")
    return f"{slug or 'session'}-{session.id}{suffix}"


def write_whole(path: Path, chunks) -> int:
    """Write through a temporary file renamed into place, so a failed export leaves no half file."""
    if not path.parent.is_dir():
        raise ExchangeError(f"{path}: no such folder {path.parent}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ExchangeError(f"{path}: cannot write ({e.strerror or e})") from None
    return size
