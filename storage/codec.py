"""The KV block codec: one block's keys and values to compact, self-checking bytes and back. The codecs
themselves (each one's streams) are a table in codec_formats.py; this module frames and checks them."""

from __future__ import annotations

import math
import struct
import time
import zlib

import numpy as np

from .codec_formats import AUTO as AUTO  # (the codecs' public names, defined beside the table)
from .codec_formats import AUTO_ROTATED as AUTO_ROTATED
from .codec_formats import GROUP, TABLE, KVPlan, kernels
from .codec_formats import PLAN_BITS as PLAN_BITS  # (the codec's public name, defined beside the table)
from .zstd_frames import FrameError, compress_frame, decompress_frame

# CODECS give every layer and head one precision; STORED_CODECS are what a stored block may say it is
CODECS: tuple[str, ...] = tuple(n for n, c in TABLE.items() if c.bits is not None)
STORED_CODECS: tuple[str, ...] = tuple(TABLE)
# PLANNED_CODECS store each layer and head as a plan (kv_plan.py) says
PLANNED_CODECS: tuple[str, ...] = tuple(n for n, c in TABLE.items() if c.bits is None)

# Layout: a 22-byte header (magic, format version, codec id, n_layer, n_kv_head, n_tokens, head_dim),
# then one zstd frame (with content size and checksum) holding a copy of the header and the codec's
# streams (codec_formats.py describes each codec's). A planned (auto, auto-h) block's header is
# followed (outside the frame and again inside it) by its plan: one byte per layer and head, [L, H] row-major,
# giving its keys' bits, then one per head for the values (each of PLAN_BITS).
# Groups are 32 consecutive values along the last axis named (tokens for k, head_dim for v); a
# ragged last group is simply shorter. Multi-byte numbers are little-endian.
MAGIC = b"LCKV"
VERSION = 1
_HEADER = struct.Struct("<4sBB4I")
_CODEC_NAMES = {c.id: name for name, c in TABLE.items()}

# A real block is at most a few million values per array (80 layers x 8 heads x 64 tokens x 128);
# the bound keeps a lying header from making decode allocate gigabytes.
MAX_ELEMENTS = 2**26

# How far (relative) a stored block may lie from its KV computed again and put through the same codec.
MATCH_TOLERANCE = 0.02
# zstd's level is each codec's (codec_formats.py): on real KV, levels 3, 5 and 9 compress no better than
# level 1 (within 1%) and encode f32 2-5x slower. The frame checksum (4 bytes) makes a flipped payload
# byte fail loudly, not decode to noise.

_F32 = np.dtype("<f4")


class CorruptBlockError(ValueError):
    """Bytes that are not a block this codec wrote: truncated, altered, or inconsistent."""


def checksum(data: bytes) -> str:
    """CRC-32 of encoded bytes, stored beside each block: it catches damage (not tampering) at a
    quarter of a cryptographic hash's cost, which counts when a resume checks 32 blocks; the zstd
    frame's own checksum guards the payload a second time."""
    return f"{zlib.crc32(data):08x}"


def compile_kernels(progress=None) -> float:
    """Compile (first start, ~2 s) or load from numba's cache (later starts) the codec's loops, on a tiny
    block of each quantized codec, contiguous and as a view of the KV arena, so that no snapshot or
    resume waits on the compiler. progress(label, done, total) is told. Returns the seconds it took."""
    from llama_chat.inference.jit import in_cache

    t0 = time.perf_counter()
    cached = all(in_cache(k) for k in kernels().COMPILED)
    label = "loading the KV codec" if cached else "compiling the KV codec (first start only)"
    arena = np.zeros((2, 2, 40, GROUP), np.float32)
    arena16 = np.zeros(arena.shape, np.float16)  # the live cache's default type (inference/kv_cache.py)
    plan = KVPlan(((4, 6), (8, 16)), ((16, 8), (6, 4)))  # every precision, for keys and for values
    codecs = [name for name, form in TABLE.items() if form.quantized]
    for i, codec in enumerate(codecs):
        if progress:
            progress(label, i, len(codecs))
        # a view with gaps, as the arena's, and contiguous, as a tail's copy; decoded into new arrays
        # and into the arena, float32 and float16
        data = encode_kv(arena[:, :, :33], arena[:, :, :33], codec, plan)
        decode_kv(data, (arena[:, :, 1:34], arena[:, :, 2:35]))
        decode_kv(data, (arena16[:, :, 1:34], arena16[:, :, 2:35]))
        decode_kv(data)
        encode_kv(arena, arena, codec, plan)
    if progress:
        progress(label, len(codecs), len(codecs))
    return time.perf_counter() - t0


# -- encoding ------------------------------------------------------------------------------------


def encode_kv(k: np.ndarray, v: np.ndarray, codec: str, plan: KVPlan | None = None) -> bytes:
    """One block's keys and values, each [n_layer, n_kv_head, n_tokens, head_dim], as bytes.

    f32 is lossless; f16 saturates at +-65504; q8 and q4 need finite values (ValueError otherwise)
    and saturate where a group's scale would overflow float16 (|x| beyond ~8e6 for q8, ~6e4 for q4).
    auto and auto-h store each head as `plan` says (required, of the block's layers and heads).
    """
    form = TABLE.get(codec)
    if form is None:
        raise ValueError(f"unknown KV codec {codec!r}; expected one of {', '.join(STORED_CODECS)}")
    k = np.asarray(k)
    v = np.asarray(v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must share one 4-d shape, got {k.shape} and {v.shape}")
    if min(k.shape) < 1 or k.size > MAX_ELEMENTS:
        raise ValueError(f"KV block shape {k.shape} is empty or larger than {MAX_ELEMENTS} values")
    k = k.astype(_F32, copy=False)
    v = v.astype(_F32, copy=False)
    if form.quantized and not (np.isfinite(k).all() and np.isfinite(v).all()):
        raise ValueError(f"KV block has non-finite values, which {codec} cannot quantize")
    if form.bits is not None:
        return block_bytes(codec, k.shape, form.encode(k, v, None))
    if plan is None or plan.shape != k.shape[:2]:
        raise ValueError(
            f"an {codec} KV block needs a plan of its {k.shape[0]} layers and {k.shape[1]} heads"
        )
    return block_bytes(codec, k.shape, form.encode(k, v, plan), plan.table())


def block_bytes(
    codec: str, shape: tuple[int, ...], streams: list[np.ndarray], plan_table: bytes = b""
) -> bytes:
    """A block's bytes: its header (and an auto block's plan), then one zstd frame of them again and
    the streams."""
    header = _HEADER.pack(MAGIC, VERSION, TABLE[codec].id, *shape) + plan_table
    # The header is repeated inside the frame (22 bytes, covered by zstd's checksum): a header
    # whose dims were permuted would otherwise still match the payload's size.
    payload = header + b"".join(s.tobytes() for s in streams)
    return header + compress_frame(payload, TABLE[codec].zstd_level)


def block_info(data: bytes) -> tuple[str, tuple[int, int, int, int]] | None:
    """The codec and the (n_layer, n_kv_head, n_tokens, head_dim) a block's header declares, without
    decoding it; None when the bytes do not start like a block of this format version."""
    if len(data) < _HEADER.size:
        return None
    magic, version, codec_id, *dims = _HEADER.unpack_from(data)
    codec = _CODEC_NAMES.get(codec_id)
    if magic != MAGIC or version != VERSION or codec is None:
        return None
    return codec, tuple(dims)


def block_plan(data: bytes) -> KVPlan | None:
    """The plan a planned block was stored under, from its header; None for other blocks or bytes
    that do not hold a valid one."""
    info = block_info(data)
    if info is None or info[0] not in PLANNED_CODECS:
        return None
    try:
        return _plan_of(data, info[1])
    except CorruptBlockError:
        return None


def _plan_of(data: bytes, dims) -> KVPlan:
    """An auto block's plan, read after its header."""
    n_layer, n_head = dims[0], dims[1]
    if n_layer * n_head > MAX_ELEMENTS:
        raise CorruptBlockError(f"implausible KV block shape {tuple(dims)}")
    size = n_layer * n_head
    table = data[_HEADER.size : _HEADER.size + 2 * size]
    if len(table) < 2 * size:
        raise CorruptBlockError("auto KV block is shorter than its plan")
    rows = [tuple(table[i : i + n_head]) for i in range(0, 2 * size, n_head)]
    try:
        return KVPlan(tuple(rows[:n_layer]), tuple(rows[n_layer:]))
    except ValueError as e:
        raise CorruptBlockError(f"auto KV block has an invalid plan: {e}") from None


# -- decoding ------------------------------------------------------------------------------------


def decode_kv(data: bytes, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The (k, v) float32 arrays encode_kv was given (or their quantized approximation).

    `out`: float32 or float16 arrays (views of the KV arena, say) to decode into, which are returned
    (a float16 one holds the decoded values rounded once to float16); a block of another shape is
    refused. Raises CorruptBlockError for anything that isn't intact output of
    encode_kv (out then holds anything); memory use is bounded by the shape the header declares,
    which is itself bounded by MAX_ELEMENTS.
    """
    data = memoryview(data)  # bytes, or a view of them (a block read from the remote tier): not copied
    if len(data) < _HEADER.size:
        raise CorruptBlockError(f"KV block is {len(data)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, codec_id, *dims = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"not a KV block (magic {magic!r})")
    if version != VERSION:
        raise CorruptBlockError(f"unsupported KV block format version {version}")
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None:
        raise CorruptBlockError(f"unknown KV codec id {codec_id}")
    shape = tuple(dims)
    if min(shape) < 1 or math.prod(shape) > MAX_ELEMENTS:
        raise CorruptBlockError(f"implausible KV block shape {shape}")

    form = TABLE[codec]
    plan = _plan_of(data, shape) if form.bits is None else None
    size = _HEADER.size + (2 * shape[0] * shape[1] if plan else 0)
    header, frame = data[:size], data[size:]
    try:
        raw = decompress_frame(frame, "KV block payload", size=size + form.payload_size(shape, plan))
    except FrameError as e:
        raise CorruptBlockError(str(e)) from None
    if raw[:size] != header:
        raise CorruptBlockError("KV block header does not match the one inside its payload")
    if out is not None and (out[0].shape != shape or out[1].shape != shape):
        raise CorruptBlockError(f"KV block of shape {shape} where {out[0].shape} was expected")
    if out is None:
        out = np.empty(shape, np.float32), np.empty(shape, np.float32)
    form.decode(memoryview(raw)[size:], *out, plan)
    return out


def decoded(
    data: bytes, expected_checksum: str | None = None, out: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The KV of stored bytes (into `out`, as decode_kv), or None when they are not what was written:
    their checksum, where one is given, or any check of decoding fails."""
    if expected_checksum is not None and checksum(data) != expected_checksum:
        return None
    try:
        return decode_kv(data, out)
    except CorruptBlockError:
        return None


def kv_matches(data: bytes, k: np.ndarray, v: np.ndarray, tolerance: float = MATCH_TOLERANCE) -> bool:
    """Whether a stored block holds this KV, up to its codec's rounding: the KV is put through the
    block's own codec, and each half must then lie within `tolerance` of the block's (relative to the
    KV's size). The same tokens computed again differ by float rounding, which moves a quantized value
    one step at most; a block made from other tokens, or forged, is off by the KV's whole size."""
    codec = block_info(data)
    if codec is None:
        return False
    try:
        stored = decode_kv(data)
    except CorruptBlockError:
        return False
    if stored[0].shape != k.shape or stored[1].shape != v.shape:
        return False
    again = decode_kv(encode_kv(k, v, codec[0], block_plan(data)))
    for a, b, exact in zip(stored, again, (k, v), strict=True):
        # in float32: a float16 KV (the live cache's) overflows its own sum of squares, and an infinite
        # norm would let any block match
        if np.linalg.norm(a - b) > tolerance * (np.linalg.norm(exact.astype(np.float32)) + 1e-30):
            return False
    return True
