"""The .llamachat file format: its layout and limits, and reading a file back with every check
(sizes before reading, the digest before parsing, each block before decoding). Writing is exchange.py's."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zstandard

from . import codec as block_codec  # for the layout of a block's header
from .codec import MAX_ELEMENTS, STORED_CODECS, CorruptBlockError, checksum, decode_kv
from .db import StoreError
from .records import Message, Session, StoredBlock, StoredTail

Progress = Callable[[str, int, int], None]  # (label, done, total), as app/progress.py draws it

# File layout (integers little-endian):
#   header    MAGIC, format version u16, manifest size u32, data size u64
#   manifest  one zstd frame (with its content size and checksum) of UTF-8 JSON: format name and
#             version, model, messages, sessions, and one entry per KV block and per tail
#   data      the KV blocks, then the sessions' tails, back to back in the manifest's order, as the
#             database stores them (already quantized and compressed, so not compressed again)
#   digest    blake2b-256 of everything before it
# PNG-style magic: a text-mode transfer that changes line ends or the high bit shows up at once.
MAGIC = b"\x89LLAMACHAT\r\n\x1a\n"
FORMAT = "llama-chat-session"
VERSION = 1
SUFFIX = ".llamachat"
_HEADER = struct.Struct("<14sHIQ")
_DIGEST_SIZE = 32

# Hard caps, checked against the sizes the header declares before anything is read or decompressed.
MAX_MANIFEST_BYTES = 64 << 20  # JSON of messages and block entries; a very long tree is a few MB
MAX_DATA_BYTES = 2 << 30  # KV bytes; a full 4,096-token context in f32 is about 80 MB per session
# Decoded float32 bytes per stored byte of a block. Real blocks stay near 20 (q4); a block of zeros
# declaring a huge shape (a decompression bomb) is refused before it is decoded.
MAX_EXPANSION = 256
MAX_TOKEN_ID = 2**31 - 1
ROLES = ("system", "user", "assistant", "tool")  # what a chat template is written to render


class ExchangeError(StoreError):
    """A session file that cannot be written or read: one line naming the file and the problem."""


class _Invalid(Exception):
    """Something in a file's manifest or data that is missing, of the wrong kind or inconsistent."""


def _digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=_DIGEST_SIZE)


def _entry_checksum(data: bytes) -> str:
    """The file's own checksum of each block (blake2b-128), independent of how the database checks them."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
    blocks: list[tuple[str, StoredBlock]]  # (model fingerprint, block)
    block_lists: dict[str, list[bytes]]
    tails: dict[str, StoredTail]

    @property
    def has_kv(self) -> bool:
        return bool(self.blocks or self.tails)


# -- import --------------------------------------------------------------------------------------------


def read_session_file(path: str | Path, progress: Progress | None = None) -> SessionFile:
    """Read and check a whole .llamachat file: sizes against hard caps before reading, the digest
    before parsing, every block's checksum and layout before decoding it. Raises ExchangeError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEADER.size)
            data_size = _check_header(path, head, size)
            content = bytearray(head)
            while len(content) < size:
                chunk = f.read(min(8 << 20, size - len(content)))
                if not chunk:
                    raise ExchangeError(
                        f"{path}: truncated while reading ({len(content):,} of {size:,} bytes)"
                    )
                content += chunk
                if progress:
                    progress(f"reading {path.name}", len(content), size)
    except IsADirectoryError:
        raise ExchangeError(f"{path}: is a directory, not a session file") from None
    except FileNotFoundError:
        raise ExchangeError(f"{path}: no such file") from None
    except OSError as e:
        raise ExchangeError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(content) != size:
        raise ExchangeError(f"{path}: changed while it was read")
    content = bytes(content)
    body = memoryview(content)[: size - _DIGEST_SIZE]
    digest = _digest()
    digest.update(body)
    if digest.digest() != content[size - _DIGEST_SIZE :]:
        raise ExchangeError(f"{path}: checksum mismatch: the file is damaged or incomplete")
    manifest_end = size - _DIGEST_SIZE - data_size
    try:
        manifest = _decompress_manifest(body[_HEADER.size : manifest_end])
        return _parse(path, size, manifest, body[manifest_end:], progress)
    except _Invalid as e:
        raise ExchangeError(f"{path}: invalid session file: {e}") from None


def _check_header(path: Path, head: bytes, size: int) -> int:
    """The data size the header declares, once magic, version and sizes are plausible."""
    if not head:
        raise ExchangeError(f"{path}: an empty file, not a llama-chat session file")
    manifest_size, data_size = _declared(str(path), head)
    expected = _HEADER.size + manifest_size + data_size + _DIGEST_SIZE
    if size < expected:
        raise ExchangeError(f"{path}: truncated ({size:,} of {expected:,} bytes)")
    if size > expected:
        raise ExchangeError(
            f"{path}: damaged ({size:,} bytes, {size - expected:,} more than its header declares)"
        )
    return data_size


HEADER_SIZE = _HEADER.size


def declared_size(name: str, head: bytes) -> int:
    """The size of the whole file whose first HEADER_SIZE bytes are `head`, once its magic, version and
    sizes are plausible (else ExchangeError naming `name`): an upload is checked by it as it arrives."""
    manifest_size, data_size = _declared(name, head)
    return _HEADER.size + manifest_size + data_size + _DIGEST_SIZE


def _declared(name: str, head: bytes) -> tuple[int, int]:
    """The manifest's and the data's sizes a header declares, within the caps."""
    if not head.startswith(MAGIC[: len(head)]):
        raise ExchangeError(f"{name}: not a llama-chat session file")
    if len(head) < _HEADER.size:
        raise ExchangeError(f"{name}: truncated ({len(head):,} bytes, shorter than the header)")
    _, version, manifest_size, data_size = _HEADER.unpack(head)
    if version != VERSION:
        newer = " (written by a newer llama-chat)" if version > VERSION else ""
        raise ExchangeError(
            f"{name}: format version {version} is not supported{newer}; this llama-chat reads {VERSION}"
        )
    if manifest_size > MAX_MANIFEST_BYTES:
        raise ExchangeError(
            f"{name}: declares a {manifest_size:,}-byte manifest, over the limit of {MAX_MANIFEST_BYTES:,}"
        )
    if data_size > MAX_DATA_BYTES:
        raise ExchangeError(f"{name}: declares {data_size:,} bytes of KV, over the limit of {MAX_DATA_BYTES:,}")
    return manifest_size, data_size


def _decompress_manifest(packed) -> dict:
    packed = bytes(packed)
    try:
        params = zstandard.get_frame_parameters(packed)
    except zstandard.ZstdError as e:
        raise _Invalid(f"the manifest is not a zstd frame ({e})") from None
    # zstd never writes more than the frame declares, so bounding the declaration bounds memory
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN or params.content_size > MAX_MANIFEST_BYTES:
        raise _Invalid(f"the manifest declares {params.content_size:,} bytes (limit {MAX_MANIFEST_BYTES:,})")
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = d.decompress(packed)
    except zstandard.ZstdError as e:
        raise _Invalid(f"the manifest does not decompress ({e})") from None
    if not d.eof or d.unused_data or len(raw) != params.content_size:
        raise _Invalid("the manifest is truncated or followed by stray bytes")
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


def _parse(path: Path, size: int, manifest: dict, data: memoryview, progress: Progress | None) -> SessionFile:
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
    if any(n <= 0 for n in sizes) or sum(sizes) != len(data):
        raise _Invalid(f"the manifest's entries add up to {sum(sizes):,} bytes, the file holds {len(data):,}")
    pieces = []
    offset = 0
    for n in sizes:
        pieces.append(bytes(data[offset : offset + n]))
        offset += n
    shapes: dict[str, tuple[int, int, int]] = {}
    fingerprints = {s.id: s.model_fingerprint for s in sessions}
    checked = [(f"block {k.hex()}", fp, b, b.n_tokens) for k, (fp, b) in blocks.items()]
    checked += [
        (f"the tail of session {sid!r}", fingerprints[sid], t, len(t.tokens)) for sid, t in tails.items()
    ]
    for i, ((what, fp, record, n_tokens), piece) in enumerate(zip(checked, pieces, strict=True)):
        if _entry_checksum(piece) != record.checksum:
            raise _Invalid(f"{what} fails its checksum")
        record.checksum = checksum(piece)  # as the database checks it
        dims = _check_block(what, piece, record.codec, n_tokens)
        if shapes.setdefault(fp, dims) != dims:
            raise _Invalid(f"{what} has a shape unlike the other blocks of its model")
        record.data = piece
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
    )


def _check_block(what: str, data: bytes, codec: str, n_tokens: int) -> tuple[int, int, int]:
    """A block's (n_layer, n_kv_head, head_dim), once its header agrees with the manifest, its
    decoded size is within MAX_EXPANSION of its stored size, and it decodes."""
    info = block_codec.block_info(data)
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
