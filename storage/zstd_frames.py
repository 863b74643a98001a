"""zstd frames that bound themselves: a frame is read only when it declares its content size and carries
a checksum, and that size is within what the caller allows, so a lying frame (a decompression bomb, a
truncated or padded one) is refused before any memory is spent on it."""

from __future__ import annotations

import threading

import zstandard


class FrameError(ValueError):
    """A frame that is not one complete, checksummed zstd frame of an allowed size: one line."""


def compress_frame(data: bytes, level: int) -> bytes:
    """One frame of `data`, declaring its size and carrying its checksum (as decompress_frame requires)."""
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(data)


_per_thread = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one is not for two threads at once), made once: making one per frame
    took half the time of decompressing a resumed conversation's 32 KV blocks."""
    if not hasattr(_per_thread, "decompressor"):
        _per_thread.decompressor = zstandard.ZstdDecompressor()
    return _per_thread.decompressor


def decompress_frame(frame: bytes, what: str, *, size: int | None = None, limit: int | None = None) -> bytes:
    """The content of `frame`, which must be exactly `size` bytes (or at most `limit`), with nothing after
    the frame; else FrameError naming `what`."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise FrameError(f"{what} is not a zstd frame ({e})") from None
    # Checked before decompressing: zstd refuses to produce more than a frame declares, so bounding
    # the declaration bounds the memory.
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN or not params.has_checksum:
        raise FrameError(f"{what} is a zstd frame without a content size or checksum")
    if size is not None and declared != size:
        raise FrameError(f"{what} declares {declared:,} bytes where {size:,} were expected")
    if limit is not None and declared > limit:
        raise FrameError(f"{what} declares {declared:,} bytes (limit {limit:,})")
    # decompressobj rather than decompress(): it also reports a truncated frame and trailing bytes.
    d = _decompressor().decompressobj()
    try:
        content = d.decompress(frame)
    except zstandard.ZstdError as e:
        raise FrameError(f"{what} does not decompress ({e})") from None
    if not d.eof or d.unused_data or len(content) != declared:
        raise FrameError(
            f"{what} is truncated or followed by stray bytes ({len(content):,} of {declared:,} bytes decoded)"
        )
    return content
