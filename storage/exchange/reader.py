"""Reading a .llamachat file back, with every check: sizes before reading, the digest before parsing,
each block before decoding. It reads only; nothing here writes a file or the database.

A file is read in pieces, never whole: the digest as it streams by, then the manifest, then each KV
entry on its own; the entries' bytes stay in the file until an import stores them (SessionFile.data),
so reading any file, however large or damaged, holds a piece of it at a time."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..codec import MAX_ELEMENTS, STORED_CODECS, CorruptBlockError, block_info, checksum, decode_kv
from ..records import Message, Session, StoredBlock, StoredTail
from ..zstd_frames import FrameError, decompress_frame
from .format import (
    DIGEST_SIZE,
    FORMAT,
    HEADER,
    MAX_EXPANSION,
    MAX_MANIFEST_BYTES,
    MAX_TOKEN_ID,
    ROLES,
    VERSION,
    ExchangeError,
    Progress,
    declared_sections,
    entry_checksum,
    file_digest,
    file_size,
)

PIECE = 1 << 20  # bytes read at a time while the digest is checked


class _Invalid(Exception):
    """Something in a file's manifest or data that is missing, of the wrong kind or inconsistent."""


# -- what a file holds -----------------------------------------------------------------------------


@dataclass
class SessionFile:
    """The checked content of a .llamachat file; reading it touched no database.

    Ids are the file's own (the exporting database's): messages' id and parent_id, sessions' id,
    head_id and forked_from; block_lists and tails are keyed by the file's session id."""

    path: Path
    size: int
    exported: float
    model_name: str | None
    model_fingerprint: str | None
    messages: list[Message]  # parents before children
    sessions: list[Session]  # the exported session first
    blocks: list[tuple[str, StoredBlock]]  # (model fingerprint, block), its bytes left in the file: data()
    block_lists: dict[str, list[bytes]]
    tails: dict[str, StoredTail]  # its bytes left in the file too
    # where each block's bytes (by key) and each tail's (by session id) lie: (offset, size, entry_checksum)
    spans: dict[bytes | str, tuple[int, int, str]]

    @property
    def has_kv(self) -> bool:
        return bool(self.blocks or self.tails)

    def data(self, where: bytes | str) -> bytes:
        """The bytes of the block with key `where` (or the tail of session `where`), read from the file
        again as they are stored; ExchangeError if they are no longer those it was checked with."""
        offset, size, digest = self.spans[where]
        try:
            with open(self.path, "rb") as f:
                piece = os.pread(f.fileno(), size, offset)
        except OSError as e:
            raise ExchangeError(f"{self.path}: cannot read ({e.strerror or e})") from None
        if len(piece) != size or entry_checksum(piece) != digest:
            raise ExchangeError(f"{self.path}: changed since it was read")
        return piece


# -- reading -------------------------------------------------------------------------------------------


def read_session_file(path: str | Path, progress: Progress | None = None) -> SessionFile:
    """Read and check a whole .llamachat file: sizes against hard caps before reading, the digest
    before parsing, every block's checksum and layout before decoding it. Raises ExchangeError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data_size = _check_header(path, f.read(HEADER.size), size)
            _check_digest(f, path, size, progress)
            data_start = size - DIGEST_SIZE - data_size
            try:
                manifest = _decompress_manifest(os.pread(f.fileno(), data_start - HEADER.size, HEADER.size))
                return _parse(path, size, manifest, _Section(f.fileno(), data_start, data_size), progress)
            except _Invalid as e:
                raise ExchangeError(f"{path}: invalid session file: {e}") from None
    except IsADirectoryError:
        raise ExchangeError(f"{path}: is a directory, not a session file") from None
    except FileNotFoundError:
        raise ExchangeError(f"{path}: no such file") from None
    except OSError as e:
        raise ExchangeError(f"{path}: cannot read ({e.strerror or e})") from None


def _check_digest(f, path: Path, size: int, progress: Progress | None) -> None:
    """The digest of everything before the file's last DIGEST_SIZE bytes, read a PIECE at a time,
    against those bytes."""
    digest, piece = file_digest(), bytearray(PIECE)
    f.seek(0)
    done, end = 0, size - DIGEST_SIZE
    while done < end:
        n = f.readinto(memoryview(piece)[: min(PIECE, end - done)])
        if not n:
            raise ExchangeError(f"{path}: truncated while reading ({done:,} of {size:,} bytes)")
        digest.update(memoryview(piece)[:n])
        done += n
        if progress:
            progress(f"reading {path.name}", done, size)
    if f.read(DIGEST_SIZE + 1) != digest.digest():  # (a byte more: a file that grew meanwhile)
        raise ExchangeError(f"{path}: checksum mismatch: the file is damaged or incomplete")


def _check_header(path: Path, head: bytes, size: int) -> int:
    """The data size the header declares, once magic, version and sizes are plausible."""
    if not head:
        raise ExchangeError(f"{path}: an empty file, not a llama-chat session file")
    manifest_size, data_size = declared_sections(str(path), head)
    expected = file_size(manifest_size, data_size)
    if size < expected:
        raise ExchangeError(f"{path}: truncated ({size:,} of {expected:,} bytes)")
    if size > expected:
        raise ExchangeError(
            f"{path}: damaged ({size:,} bytes, {size - expected:,} more than its header declares)"
        )
    return data_size


def _decompress_manifest(packed) -> dict:
    try:
        raw = decompress_frame(bytes(packed), "the manifest", limit=MAX_MANIFEST_BYTES)
    except FrameError as e:
        raise _Invalid(str(e)) from None
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _Invalid(f"the manifest is not JSON ({str(e)[:80]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _Invalid(f"the manifest is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise _Invalid(f"the manifest has version {manifest.get('version')!r}, the header {VERSION}")
    return manifest


# Kinds of manifest values: a check and the name an error message gives it.
def _is_text(v) -> bool:
    if not isinstance(v, str):
        return False
    try:
        v.encode()  # a lone surrogate would fail inside the database transaction
    except UnicodeEncodeError:
        return False
    return True


def _is_int(v) -> bool:
    return type(v) is int


def _is_number(v) -> bool:
    # bounded so that SQLite (64-bit integers) and float() take it without overflowing
    return (type(v) is float and math.isfinite(v)) or (type(v) is int and abs(v) < 2**53)


def _is_token_list(v) -> bool:
    return isinstance(v, list) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in v)


def _is_hex(n: int):
    return lambda v: isinstance(v, str) and len(v) == 2 * n and re.fullmatch("[0-9a-f]*", v) is not None


_KINDS = {
    "text": _is_text,
    "integer": _is_int,
    "number": _is_number,
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "token list": _is_token_list,
    "16-byte hex key": _is_hex(16),
    "checksum": _is_hex(16),
    "fingerprint": lambda v: _is_text(v) and 0 < len(v) <= 128,
}


def _get(obj: dict, name: str, kind: str, where: str, optional: bool = False):
    if name not in obj:
        raise _Invalid(f"{where} has no '{name}'")
    value = obj[name]
    if value is None and optional:
        return None
    if not _KINDS[kind](value):
        raise _Invalid(f"{where}.{name} is not a {kind}")
    return value


def _objects(manifest: dict, name: str) -> list[dict]:
    items = _get(manifest, name, "list", "the manifest")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _Invalid(f"{name}[{i}] is not an object")
    return items


@dataclass
class _Section:
    """The data section of an open file, read an entry at a time."""

    fd: int
    start: int  # its offset in the file
    size: int

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, self.start + offset)


def _parse(path: Path, size: int, manifest: dict, data: _Section, progress: Progress | None) -> SessionFile:
    """Turn a manifest and its data section into checked records; nothing inconsistent gets through."""
    model = _get(manifest, "model", "object", "the manifest")
    exported = _get(manifest, "exported", "number", "the manifest")

    messages: list[Message] = []
    ids: set[int] = set()
    for i, m in enumerate(_objects(manifest, "messages")):
        where = f"messages[{i}]"
        mid = _get(m, "id", "integer", where)
        parent = _get(m, "parent", "integer", where, optional=True)
        if mid in ids:
            raise _Invalid(f"{where} repeats message id {mid}")
        if parent is not None and parent not in ids:  # parents first: also rules out cycles
            raise _Invalid(f"{where} has parent {parent}, not a message before it")
        role = _get(m, "role", "text", where)
        if role not in ROLES:
            raise _Invalid(f"{where}.role is {role[:20]!r}, not one of {', '.join(ROLES)}")
        stats = _get(m, "stats", "object", where, optional=True)
        messages.append(
            Message(
                mid,
                parent,
                role,
                _get(m, "content", "text", where),
                _get(m, "token_ids", "token list", where, optional=True),
                _get(m, "created", "number", where),
                stats,
            )
        )
        ids.add(mid)

    entries = _objects(manifest, "blocks")
    blocks: dict[bytes, tuple[str, StoredBlock]] = {}
    for i, b in enumerate(entries):
        where = f"blocks[{i}]"
        key = bytes.fromhex(_get(b, "key", "16-byte hex key", where))
        if key in blocks:
            raise _Invalid(f"{where} repeats block {key.hex()}")
        codec = _get(b, "codec", "text", where)
        if codec not in STORED_CODECS:
            raise _Invalid(f"{where} has unknown codec {codec[:20]!r}")
        n_tokens = _get(b, "n_tokens", "integer", where)
        if not 0 < n_tokens <= MAX_ELEMENTS:
            raise _Invalid(f"{where}.n_tokens is {n_tokens}")
        _get(b, "size", "integer", where)
        # (files written before blocks carried their tokens have none: such blocks are recomputed)
        tokens = _get(b, "tokens", "token list", where, optional=True) or []
        if tokens and len(tokens) != n_tokens:
            raise _Invalid(f"{where} lists {len(tokens)} tokens, n_tokens is {n_tokens}")
        block = StoredBlock(key, n_tokens, codec, b"", _get(b, "checksum", "checksum", where), tokens)
        blocks[key] = (_get(b, "fingerprint", "fingerprint", where), block)

    sessions: list[Session] = []
    block_lists: dict[str, list[bytes]] = {}
    tails: dict[str, StoredTail] = {}
    tail_entries: list[dict] = []
    listed: set[bytes] = set()
    for i, s in enumerate(_objects(manifest, "sessions")):
        where = f"sessions[{i}]"
        sid = _get(s, "id", "text", where)
        if not 0 < len(sid) <= 64 or sid in block_lists:
            raise _Invalid(f"{where}.id is empty, too long or repeated")
        head = _get(s, "head", "integer", where, optional=True)
        if head is not None and head not in ids:
            raise _Invalid(f"{where}.head {head} is not a message of the file")
        sampling = _get(s, "sampling", "object", where)
        if not all(v is None or type(v) is bool or _is_number(v) for v in sampling.values()):
            raise _Invalid(f"{where}.sampling holds something other than numbers")
        fingerprint = _get(s, "model_fingerprint", "fingerprint", where, optional=True)
        keys = _get(s, "blocks", "list", where)
        if not all(_KINDS["16-byte hex key"](k) for k in keys):
            raise _Invalid(f"{where}.blocks holds something other than 16-byte hex keys")
        keys = [bytes.fromhex(k) for k in keys]
        for key in keys:
            if key in blocks and blocks[key][0] != fingerprint:
                raise _Invalid(f"{where} lists block {key.hex()} of another model")
        listed.update(keys)
        tail = _get(s, "tail", "object", where, optional=True)
        if (keys or tail) and fingerprint is None:
            raise _Invalid(f"{where} has KV but no model fingerprint")
        n_tokens = _get(s, "n_tokens", "integer", where)
        if not 0 <= n_tokens <= MAX_TOKEN_ID:
            raise _Invalid(f"{where}.n_tokens is {n_tokens}")
        sessions.append(
            Session(
                id=sid,
                title=_get(s, "title", "text", where),
                head_id=head,
                model_fingerprint=fingerprint,
                model_name=_get(s, "model_name", "text", where, optional=True),
                system_prompt=_get(s, "system_prompt", "text", where, optional=True),
                sampling=sampling,
                forked_from=_get(s, "forked_from", "text", where, optional=True),
                n_tokens=n_tokens,
                created=_get(s, "created", "number", where),
                updated=_get(s, "updated", "number", where),
            )
        )
        block_lists[sid] = keys
        if tail is not None:
            tw = f"{where}.tail"
            parent_key = _get(tail, "parent_key", "16-byte hex key", tw, optional=True)
            tokens = _get(tail, "tokens", "token list", tw)
            codec = _get(tail, "codec", "text", tw)
            if not tokens or codec not in STORED_CODECS:
                raise _Invalid(f"{tw} has no tokens or an unknown codec")
            _get(tail, "size", "integer", tw)
            parent = bytes.fromhex(parent_key) if parent_key else None
            tails[sid] = StoredTail(parent, tokens, codec, b"", _get(tail, "checksum", "checksum", tw))
            tail_entries.append(tail)
    if not sessions:
        raise _Invalid("the file holds no session")
    for s in sessions:
        if s.forked_from is not None and s.forked_from not in block_lists:
            raise _Invalid(f"session {s.id[:64]!r} is forked from a session not in the file")
    unlisted = set(blocks) - listed
    if unlisted:
        raise _Invalid(f"block {min(unlisted).hex()} belongs to no session")

    # The data section: entries back to back, in manifest order, filling it exactly.
    sizes = [e["size"] for e in entries] + [t["size"] for t in tail_entries]
    if any(n <= 0 for n in sizes) or sum(sizes) != data.size:
        raise _Invalid(f"the manifest's entries add up to {sum(sizes):,} bytes, the file holds {data.size:,}")
    shapes: dict[str, tuple[int, int, int]] = {}
    fingerprints = {s.id: s.model_fingerprint for s in sessions}
    checked = [(f"block {k.hex()}", k, fp, b, b.n_tokens) for k, (fp, b) in blocks.items()]
    checked += [
        (f"the tail of session {sid!r}", sid, fingerprints[sid], t, len(t.tokens)) for sid, t in tails.items()
    ]
    spans: dict[bytes | str, tuple[int, int, str]] = {}
    offset = 0
    for i, ((what, where, fp, record, n_tokens), n) in enumerate(zip(checked, sizes, strict=True)):
        piece = data.read(offset, n)
        if len(piece) != n or entry_checksum(piece) != record.checksum:
            raise _Invalid(f"{what} fails its checksum")
        spans[where] = (data.start + offset, n, record.checksum)
        record.checksum = checksum(piece)  # as the database checks it
        dims = _check_block(what, piece, record.codec, n_tokens)
        if shapes.setdefault(fp, dims) != dims:
            raise _Invalid(f"{what} has a shape unlike the other blocks of its model")
        offset += n
        if progress:
            progress(f"checking {path.name}", i + 1, len(checked))
    return SessionFile(
        path=path,
        size=size,
        exported=exported,
        model_name=_get(model, "name", "text", "the manifest's model", optional=True),
        model_fingerprint=_get(model, "fingerprint", "fingerprint", "the manifest's model", optional=True),
        messages=messages,
        sessions=sessions,
        blocks=list(blocks.values()),
        block_lists=block_lists,
        tails=tails,
        spans=spans,
    )


def _check_block(what: str, data: bytes, codec: str, n_tokens: int) -> tuple[int, int, int]:
    """A block's (n_layer, n_kv_head, head_dim), once its header agrees with the manifest, its
    decoded size is within MAX_EXPANSION of its stored size, and it decodes."""
    info = block_info(data)
    if info is None or info[0] != codec:
        raise _Invalid(f"{what} is not a {codec} KV block")
    n_layer, n_head, tokens, head_dim = info[1]
    if tokens != n_tokens:
        raise _Invalid(f"{what} holds {tokens} tokens, the manifest says {n_tokens}")
    decoded = 8 * n_layer * n_head * tokens * head_dim  # float32 keys and values
    if decoded > MAX_EXPANSION * len(data):
        raise _Invalid(f"{what} would decode to {decoded:,} bytes from {len(data):,}")
    try:
        decode_kv(data)
    except CorruptBlockError as e:
        raise _Invalid(f"{what} does not decode ({e})") from None
    return n_layer, n_head, head_dim
