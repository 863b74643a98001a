"""The .llamachat file format: its layout, its limits, and the checks its writer and reader both compute.

File layout (integers little-endian):
  header    MAGIC, format version u16, manifest size u32, data size u64
  manifest  one zstd frame (with its content size and checksum) of UTF-8 JSON: format name and
            version, model, messages, sessions, and one entry per KV block and per tail
  data      the KV blocks, then the sessions' tails, back to back in the manifest's order, as the
            database stores them (already quantized and compressed, so not compressed again)
  digest    blake2b-256 of everything before it
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

from ..db import StoreError

Progress = Callable[[str, int, int], None]  # (label, done, total), as app/progress.py draws it

# PNG-style magic: a text-mode transfer that changes line ends or the high bit shows up at once.
MAGIC = b"\x89LLAMACHAT\r\n\x1a\n"
FORMAT = "llama-chat-session"
VERSION = 1
SUFFIX = ".llamachat"
HEADER = struct.Struct("<14sHIQ")
HEADER_SIZE = HEADER.size
DIGEST_SIZE = 32
MANIFEST_ZSTD_LEVEL = 9  # the manifest is small and written once: the better ratio is worth it

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


def file_digest() -> hashlib.blake2b:
    """The running digest of a file's header, manifest and data: the file's last DIGEST_SIZE bytes."""
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def entry_checksum(data: bytes) -> str:
    """The file's own checksum of each block (blake2b-128), independent of how the database checks them."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def pack_header(manifest_size: int, data_size: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, manifest_size, data_size)


def declared_size(name: str, head: bytes) -> int:
    """The size of the whole file whose first HEADER_SIZE bytes are `head`, once its magic, version and
    sizes are plausible (else ExchangeError naming `name`): an upload is checked by it as it arrives."""
    return file_size(*declared_sections(name, head))


def file_size(manifest_size: int, data_size: int) -> int:
    return HEADER.size + manifest_size + data_size + DIGEST_SIZE


def declared_sections(name: str, head: bytes) -> tuple[int, int]:
    """The manifest's and the data's sizes a header declares, within the caps."""
    if not head.startswith(MAGIC[: len(head)]):
        raise ExchangeError(f"{name}: not a llama-chat session file")
    if len(head) < HEADER.size:
        raise ExchangeError(f"{name}: truncated ({len(head):,} bytes, shorter than the header)")
    _, version, manifest_size, data_size = HEADER.unpack(head)
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
        raise ExchangeError(
            f"{name}: declares {data_size:,} bytes of KV, over the limit of {MAX_DATA_BYTES:,}"
        )
    return manifest_size, data_size
