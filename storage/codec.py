"""The KV block codec: one block's keys and values to compact, self-checking bytes and back."""

from __future__ import annotations

import math
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

CODECS: tuple[str, ...] = ("f32", "f16", "q8", "q6", "q4")  # one precision for every layer and head
AUTO = "auto"  # a precision per layer and KV head, as a KVPlan says (kv_plan.py measures one per model)
STORED_CODECS: tuple[str, ...] = (*CODECS, AUTO)  # what a stored block may say it is
PLAN_BITS = (4, 6, 8, 16)  # the precisions an auto block gives one head's keys or values

# Layout: a 22-byte header (magic, format version, codec id, n_layer, n_kv_head, n_tokens, head_dim),
# then one zstd frame (with content size and checksum) holding a copy of the header and the streams:
#   f32  byte-shuffled k, byte-shuffled v
#   f16  the same as float16
#   q8   k as int8 per channel [L, H, D, T], token-to-token differences; v as int8 [L, H, T, D];
#        the float16 scales of k then v, byte-shuffled together
#   q6   like q4 with 6-bit codes, four to three bytes (first code in the lowest bits)
#   q4   k nibbles [L, H, D, T], v nibbles [L, H, T, D] (two per byte, first in the low nibble);
#        float16 scales of k, of v, mins of k, of v, byte-shuffled together
#   auto the header is followed (outside the frame and again inside it) by the plan: one byte per
#        layer and head, [L, H] row-major, giving its keys' bits, then one per head for the values
#        (each of PLAN_BITS). Then, keys first, values next, for each bits of PLAN_BITS in order, the
#        heads given it (in row-major order) as one part [n, T, D]: at 16 bits byte-shuffled float16;
#        else asymmetric codes (as q4 and q6: keys per channel [n, D, T], values per token), 8-bit
#        keys as token-to-token differences as q8's, 6 and 4 bits packed as q6's and q4's; then
#        the part's float16 scales and mins, byte-shuffled together.
# Groups are 32 consecutive values along the last axis named (tokens for k, head_dim for v); a
# ragged last group is simply shorter. Multi-byte numbers are little-endian.
MAGIC = b"LCKV"
VERSION = 1
_HEADER = struct.Struct("<4sBB4I")
_CODEC_IDS = {"f32": 1, "f16": 2, "q8": 3, "q4": 4, "q6": 5, AUTO: 6}
_CODEC_NAMES = {i: name for name, i in _CODEC_IDS.items()}

# A real block is at most a few million values per array (80 layers x 8 heads x 64 tokens x 128);
# the bound keeps a lying header from making decode allocate gigabytes.
MAX_ELEMENTS = 2**26

GROUP = 32  # values sharing one quantization scale
_GROUP_BITS = GROUP.bit_length() - 1  # GROUP is a power of two: its log2, for the decoding loops
# How far (relative) a stored block may lie from its KV computed again and put through the same codec.
MATCH_TOLERANCE = 0.02
# On real KV, levels 3, 5 and 9 compress no better than level 1 (within 1%) and encode f32 2-5x
# slower. The frame checksum (4 bytes) makes a flipped payload byte fail loudly, not decode to noise.
_ZSTD_LEVEL = 1

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_F16_MAX = np.float32(65504.0)


class CorruptBlockError(ValueError):
    """Bytes that are not a block this codec wrote: truncated, altered, or inconsistent."""


@dataclass(frozen=True)
class KVPlan:
    """How an auto block stores each KV head: bits for its keys and for its values, [layer][head],
    each of PLAN_BITS. Each block carries its own, so a block reads the same under any plan."""

    k_bits: tuple[tuple[int, ...], ...]
    v_bits: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        shapes = {len(self.k_bits), len(self.v_bits)}, {len(row) for row in (*self.k_bits, *self.v_bits)}
        if len(shapes[0]) != 1 or len(shapes[1]) != 1 or not self.k_bits or not self.k_bits[0]:
            raise ValueError("a KV plan needs the same number (at least one) of layers and heads for k and v")
        if any(b not in PLAN_BITS for row in (*self.k_bits, *self.v_bits) for b in row):
            raise ValueError(f"a KV plan's bits must each be one of {PLAN_BITS}")

    @classmethod
    def uniform(cls, n_layer: int, n_head: int, bits: int) -> KVPlan:
        row = (bits,) * n_head
        return cls((row,) * n_layer, (row,) * n_layer)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.k_bits), len(self.k_bits[0])

    def table(self) -> bytes:
        """As an auto block's header carries it: keys' bits [L, H] row-major, then values'."""
        return bytes(b for rows in (self.k_bits, self.v_bits) for row in rows for b in row)

    def bits_per_value(self) -> float:
        """The mean bits of a stored value (scales and compression aside)."""
        flat = [b for rows in (self.k_bits, self.v_bits) for row in rows for b in row]
        return sum(flat) / len(flat)


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
    cached = all(in_cache(k) for k in _kernels().COMPILED)
    label = "loading the KV codec" if cached else "compiling the KV codec (first start only)"
    arena = np.zeros((2, 2, 40, GROUP), _F32)
    arena16 = np.zeros(arena.shape, _F16)  # the live cache's default type (inference/kv_cache.py)
    plan = KVPlan(((4, 6), (8, 16)), ((16, 8), (6, 4)))  # every precision, for keys and for values
    codecs = ("q8", "q6", "q4", AUTO)
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
    auto stores each head as `plan` says (required, of the block's layers and heads).
    """
    if codec not in _CODEC_IDS:
        raise ValueError(f"unknown KV codec {codec!r}; expected one of {', '.join(STORED_CODECS)}")
    k = np.asarray(k)
    v = np.asarray(v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must share one 4-d shape, got {k.shape} and {v.shape}")
    if min(k.shape) < 1 or k.size > MAX_ELEMENTS:
        raise ValueError(f"KV block shape {k.shape} is empty or larger than {MAX_ELEMENTS} values")
    k = k.astype(_F32, copy=False)
    v = v.astype(_F32, copy=False)
    if codec in ("q8", "q6", "q4", AUTO) and not (np.isfinite(k).all() and np.isfinite(v).all()):
        raise ValueError(f"KV block has non-finite values, which {codec} cannot quantize")

    if codec == AUTO:
        if plan is None or plan.shape != k.shape[:2]:
            raise ValueError(
                f"an auto KV block needs a plan of its {k.shape[0]} layers and {k.shape[1]} heads"
            )
        return _encode_auto(k, v, plan)
    if codec == "f32":
        streams = [_shuffle(k), _shuffle(v)]
    elif codec == "f16":
        streams = [_shuffle(_to_f16(k)), _shuffle(_to_f16(v))]
    elif codec == "q8":
        qk, sk = _quantize_q8(_channel_major(k))
        qv, sv = _quantize_q8(v)
        # Keys carry RoPE'd biases that drift slowly along tokens in many channels: storing each
        # channel's token-to-token difference (wrapping mod 256, so exact) makes that stream ~6%
        # smaller on real KV. Values (not rotated, grouped per token) gain nothing from it.
        dk = np.diff(qk.view(np.uint8), axis=-1, prepend=np.uint8(0))
        streams = [dk, qv, _shuffle(np.concatenate([sk.ravel(), sv.ravel()]))]
    else:
        bits = 6 if codec == "q6" else 4
        qk, sk, mk = _quantize_asymmetric(_channel_major(k), bits)
        qv, sv, mv = _quantize_asymmetric(v, bits)
        streams = [_pack(qk, codec), _pack(qv, codec), _shuffle(np.concatenate([sk, sv, mk, mv], axis=None))]

    return block_bytes(codec, k.shape, streams)


def _encode_auto(k: np.ndarray, v: np.ndarray, plan: KVPlan) -> bytes:
    """An auto block: each head's keys and values at the plan's bits (see the layout above)."""
    L, H, T, D = k.shape
    streams = []
    for x, bits_of, is_key in ((k, plan.k_bits, True), (v, plan.v_bits, False)):
        heads = x.reshape(L * H, T, D)
        flat = np.array(bits_of).ravel()
        for bits in PLAN_BITS:
            chosen = np.flatnonzero(flat == bits)
            if chosen.size:
                streams += _encode_part(heads[chosen][None], bits, is_key)
    return block_bytes(AUTO, k.shape, streams, plan.table())


def _encode_part(x: np.ndarray, bits: int, is_key: bool) -> list[np.ndarray]:
    """Heads [1, n, T, D] of an auto block given the same bits: their streams."""
    if bits == 16:
        return [_shuffle(_to_f16(x))]
    q, scales, mins = _quantize_asymmetric(_channel_major(x) if is_key else x, bits)
    if bits == 8:
        # as q8's keys: each channel's token-to-token difference (mod 256, so exact) compresses better
        codes = np.diff(q, axis=-1, prepend=np.uint8(0)) if is_key else q
    else:
        codes = _pack(q, "q6" if bits == 6 else "q4")
    return [codes, _shuffle(np.concatenate([scales, mins], axis=None))]


def block_bytes(
    codec: str, shape: tuple[int, ...], streams: list[np.ndarray], plan_table: bytes = b""
) -> bytes:
    """A block's bytes: its header (and an auto block's plan), then one zstd frame of them again and
    the streams."""
    header = _HEADER.pack(MAGIC, VERSION, _CODEC_IDS[codec], *shape) + plan_table
    # The header is repeated inside the frame (22 bytes, covered by zstd's checksum): a header
    # whose dims were permuted would otherwise still match the payload's size.
    payload = header + b"".join(s.tobytes() for s in streams)
    frame = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=True).compress(payload)
    return header + frame


def _channel_major(k: np.ndarray) -> np.ndarray:
    """[L, H, T, D] -> [L, H, D, T]: keys are grouped along tokens, one channel at a time (KIVI). A view:
    the compiled loops read it where it lies."""
    return k.transpose(0, 1, 3, 2)


def _kernels():
    """The compiled loops (codec_kernels.py), imported on first use: numba's import and set-up (~0.3 s)
    are not for commands that never encode or decode a block, such as listing sessions."""
    from . import codec_kernels

    return codec_kernels


def _ranges(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The min and max of each group of 32 along the last axis (a ragged last group is shorter)."""
    shape = (*x.shape[:-1], -(-x.shape[-1] // GROUP))
    lo, hi = np.empty(shape, np.float32), np.empty(shape, np.float32)
    _kernels().group_ranges(x, _GROUP_BITS, lo, hi)
    return lo, hi


def _codes(x: np.ndarray, scales: np.ndarray, mins: np.ndarray, low: int, high: int, dtype) -> np.ndarray:
    """rint((x - min) / scale) per group, clipped to low..high: [..., n] of dtype."""
    codes = np.empty(x.shape, dtype)
    s, m = scales.astype(np.float32), mins.astype(np.float32)
    _kernels().quantize(x, s, m, _GROUP_BITS, low, high, codes.reshape(-1))
    return codes


def _quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 along the last axis, groups of 32: (q [..., n] int8, scales [..., groups] f16)."""
    lo, hi = _ranges(x)
    # The scale is rounded *up* to float16, so |x| / scale <= 127 and every error is <= scale / 2.
    scale = _f16_ceil(np.minimum(np.maximum(np.abs(lo), np.abs(hi)) / np.float32(127), _F16_MAX))
    return _codes(x, scale, np.zeros_like(lo), -127, 127, np.int8), scale  # (no min: zeros)


def _quantize_asymmetric(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric along the last axis, groups of 32: x ~= min + q * scale, q in 0..2**bits - 1.

    Returns (q [..., n] uint8, scales, mins), scales and mins [..., groups] float16. A min per group
    matters because key channels carry large biases: 16 levels spread over [min, max] of a channel
    at 50 +- 2 are ~30x finer than 16 levels spread symmetrically over +-52.
    """
    top = 2**bits - 1
    lo, hi = _ranges(x)
    mn = _f16_floor(np.clip(lo, -_F16_MAX, _F16_MAX))  # rounded down and the scale up, so
    m = mn.astype(np.float32)  # [min, min + top * scale] covers the group
    scale = _f16_ceil(np.minimum((hi - m) / np.float32(top), _F16_MAX))
    return _codes(x, scale, m, 0, top, np.uint8), scale, mn


def _f16_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest float16 >= x (x in [0, 65504])."""
    h = x.astype(_F16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _f16_floor(x: np.ndarray) -> np.ndarray:
    """Largest float16 <= x (x in [-65504, 65504])."""
    h = x.astype(_F16)
    high = h.astype(np.float32) > x
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


def _to_f16(x: np.ndarray) -> np.ndarray:
    # Saturate rather than overflow to inf; NaN stays NaN.
    return np.clip(x, -_F16_MAX, _F16_MAX).astype(_F16)


def _shuffle(a: np.ndarray) -> np.ndarray:
    """Byte-shuffle: byte 0 of every value, then byte 1, ...; exponent bytes then compress well.

    Same result as a.view(np.uint8).reshape(-1, itemsize).T.copy(), but shifts run ~3x faster."""
    u = np.ascontiguousarray(a).ravel().view(f"<u{a.itemsize}")
    out = np.empty((a.itemsize, u.size), np.uint8)
    for i in range(a.itemsize):
        np.right_shift(u, 8 * i, out=out[i], casting="unsafe")
    return out


def _pack(q: np.ndarray, codec: str) -> np.ndarray:
    """q6's codes four to three bytes, q4's two to a byte (see _packed_size)."""
    packed = np.empty(_packed_size(codec, q.size), np.uint8)
    pack = _kernels().pack_sixes if codec == "q6" else _kernels().pack_nibbles
    pack(q.reshape(-1), packed)
    return packed


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
    """The plan an auto block was stored under, from its header; None for other blocks or bytes
    that do not hold a valid one."""
    info = block_info(data)
    if info is None or info[0] != AUTO:
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
    (a float16 one holds the decoded values rounded once to float16); a block of
    another shape is refused. Raises CorruptBlockError for anything that isn't intact output of
    encode_kv (out then holds anything); memory use is bounded by the shape the header declares,
    which is itself bounded by MAX_ELEMENTS.
    """
    if not isinstance(data, bytes):
        data = bytes(memoryview(data))  # bytearray, memoryview, sqlite3 blobs
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
    n_layer, n_head, n_tokens, head_dim = dims
    n = n_layer * n_head * n_tokens * head_dim
    if min(dims) < 1 or n > MAX_ELEMENTS:
        raise CorruptBlockError(f"implausible KV block shape {tuple(dims)}")

    plan = _plan_of(data, dims) if codec == AUTO else None
    size = _HEADER.size + (2 * n_layer * n_head if plan else 0)
    header, frame = data[:size], data[size:]
    raw = _decompress(frame, size + (_auto_payload_size(plan, dims) if plan else _payload_size(codec, dims)))
    if raw[:size] != header:
        raise CorruptBlockError("KV block header does not match the one inside its payload")
    raw = memoryview(raw)[size:]
    shape = (n_layer, n_head, n_tokens, head_dim)
    if out is not None and (out[0].shape != shape or out[1].shape != shape):
        raise CorruptBlockError(f"KV block of shape {shape} where {out[0].shape} was expected")
    if codec in ("f32", "f16"):
        dtype = _F32 if codec == "f32" else _F16
        k = _unshuffle(raw[: dtype.itemsize * n], dtype).reshape(shape)
        v = _unshuffle(raw[dtype.itemsize * n :], dtype).reshape(shape)
        if out is None:
            return _native_f32(k), _native_f32(v)
        np.copyto(out[0], k)
        np.copyto(out[1], v)
        return out
    k, v = out if out is not None else (np.empty(shape, np.float32), np.empty(shape, np.float32))
    if plan is not None:
        _decode_auto(plan, raw, k, v)
    else:
        _decode_quantized(codec, raw, k, v)
    return out or (k, v)


def _decode_quantized(codec: str, raw: memoryview, k: np.ndarray, v: np.ndarray) -> None:
    """k and v of a q8, q6 or q4 payload (after its header), decoded into k and v by the compiled loops."""
    compiled = _kernels()
    shape = k.shape
    n_layer, n_head, n_tokens, head_dim = shape
    n = math.prod(shape)
    gk, gv = _n_groups(shape)
    cshape = (n_layer, n_head, head_dim, n_tokens)
    if codec == "q8":
        qk = np.frombuffer(raw, np.uint8, n).reshape(cshape)  # token-to-token differences
        qv = np.frombuffer(raw, np.uint8, n, offset=n).reshape(shape)
        scales = _unshuffle(raw[2 * n :], _F16).astype(np.float32)
        sk, sv = scales[:gk], scales[gk:]
        mk, mv = np.zeros_like(sk), np.zeros_like(sv)  # symmetric: mins of zero, to share the loop
    else:
        size = _packed_size(codec, n)
        qk, qv = (np.empty(4 * -(-n // 4), np.uint8) for _ in range(2))  # whole groups of four codes
        unpack = compiled.unpack_sixes if codec == "q6" else compiled.unpack_nibbles
        unpack(np.frombuffer(raw, np.uint8, size), qk)
        unpack(np.frombuffer(raw, np.uint8, size, offset=size), qv)
        qk, qv = qk[:n].reshape(cshape), qv[:n].reshape(shape)
        scales = _unshuffle(raw[2 * size :], _F16).astype(np.float32)
        sk, sv, mk, mv = np.split(scales, [gk, gk + gv, 2 * gk + gv])
    k, v, q8 = compiled.bits_view(k), compiled.bits_view(v), codec == "q8"
    sk, mk = sk.reshape(*cshape[:3], -1), mk.reshape(*cshape[:3], -1)
    compiled.dequantize(qk, sk, mk, _GROUP_BITS, k, True, q8, q8)
    compiled.dequantize(qv, sv.reshape(*shape[:3], -1), mv.reshape(*shape[:3], -1), _GROUP_BITS, v, False, q8, False)


def _auto_parts(plan: KVPlan, shape):
    """The parts of an auto block in stream order: (is_key, bits, chosen heads (flat indices), bytes)."""
    _, _, T, D = shape
    for bits_of, is_key in ((plan.k_bits, True), (plan.v_bits, False)):
        flat = np.array(bits_of).ravel()
        for bits in PLAN_BITS:
            chosen = np.flatnonzero(flat == bits)
            if chosen.size:
                yield is_key, bits, chosen, _part_size(chosen.size, T, D, bits, is_key)


def _part_size(n: int, T: int, D: int, bits: int, is_key: bool) -> int:
    values = n * T * D
    groups = n * D * -(-T // GROUP) if is_key else n * T * -(-D // GROUP)
    if bits == 16:
        return 2 * values
    codes = values if bits == 8 else _packed_size("q6" if bits == 6 else "q4", values)
    return codes + 4 * groups


def _auto_payload_size(plan: KVPlan, shape) -> int:
    return sum(size for *_, size in _auto_parts(plan, shape))


def _decode_auto(plan: KVPlan, raw: memoryview, k: np.ndarray, v: np.ndarray) -> None:
    """k and v of an auto payload (after its header and plan), decoded into k and v."""
    shape = k.shape
    L, H, T, D = shape
    offset = 0
    for is_key, bits, chosen, size in _auto_parts(plan, shape):
        part = _decode_part(raw[offset : offset + size], chosen.size, T, D, bits, is_key, k.dtype)
        (k if is_key else v)[chosen // H, chosen % H] = part  # (written through: k may be the arena's view)
        offset += size


def _decode_part(raw: memoryview, n: int, T: int, D: int, bits: int, is_key: bool, dtype) -> np.ndarray:
    """n heads [n, T, D] of one part of an auto block, of dtype (float32 or float16: the arena's)."""
    values = n * T * D
    shape = (1, n, T, D)
    if bits == 16:
        return _unshuffle(raw, _F16).reshape(n, T, D).astype(dtype, copy=False)
    coded = (1, n, D, T) if is_key else shape
    if bits == 8:
        size = values
        q = np.frombuffer(raw, np.uint8, values).reshape(coded)  # keys: token-to-token differences
    else:
        codec = "q6" if bits == 6 else "q4"
        size = _packed_size(codec, values)
        q = np.empty(4 * -(-values // 4), np.uint8)  # whole groups of four codes
        unpack = _kernels().unpack_sixes if bits == 6 else _kernels().unpack_nibbles
        unpack(np.frombuffer(raw, np.uint8, size), q)
        q = q[:values].reshape(coded)
    scales, mins = np.split(_unshuffle(raw[size:], _F16).astype(np.float32), 2)
    out = np.empty(shape, dtype)
    groups = (*coded[:3], -1)
    compiled = _kernels()
    differences = is_key and bits == 8
    compiled.dequantize(
        q, scales.reshape(groups), mins.reshape(groups), _GROUP_BITS, compiled.bits_view(out), is_key, False, differences
    )
    return out[0]


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
        if np.linalg.norm(a - b) > tolerance * (np.linalg.norm(exact) + 1e-30):
            return False
    return True


def _n_groups(dims) -> tuple[int, int]:
    """Scale groups of the keys (along tokens, per channel) and of the values (along head_dim, per token)."""
    n_layer, n_head, n_tokens, head_dim = dims
    gk = n_layer * n_head * head_dim * -(-n_tokens // GROUP)
    gv = n_layer * n_head * n_tokens * -(-head_dim // GROUP)
    return gk, gv


def _payload_size(codec: str, dims) -> int:
    n = math.prod(dims)
    gk, gv = _n_groups(dims)
    if codec == "f32":
        return 8 * n
    if codec == "f16":
        return 4 * n
    if codec == "q8":
        return 2 * n + 2 * (gk + gv)
    return 2 * _packed_size(codec, n) + 4 * (gk + gv)


def _packed_size(codec: str, n: int) -> int:
    """Bytes of n packed codes: 6-bit codes four to three bytes, 4-bit codes two to a byte."""
    return 3 * -(-n // 4) if codec == "q6" else (n + 1) // 2


def _decompress(frame: bytes, expected: int) -> bytes:
    """The frame's content, which must be exactly `expected` bytes, with nothing after the frame."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise CorruptBlockError(f"KV block payload is not a zstd frame: {e}") from None
    # Checked before decompressing: zstd refuses to produce more than a frame declares, so a frame
    # must declare exactly what the header implies (encode_kv always writes the size and checksum).
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN or not params.has_checksum:
        raise CorruptBlockError("KV block payload is a zstd frame without a content size or checksum")
    if params.content_size != expected:
        raise CorruptBlockError(
            f"KV block payload declares {params.content_size} bytes, the header implies {expected}"
        )
    # decompressobj rather than decompress(): it also reports a truncated frame and trailing bytes.
    d = _decompressor().decompressobj()
    try:
        raw = d.decompress(frame)
    except zstandard.ZstdError as e:
        raise CorruptBlockError(f"KV block payload does not decompress: {e}") from None
    if not d.eof or d.unused_data or len(raw) != expected:
        raise CorruptBlockError(
            f"KV block payload is truncated or has extra bytes ({len(raw)} of {expected} bytes decoded)"
        )
    return raw


_per_thread = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one is not for two threads at once), made once: making one per block
    took half the time of decompressing 32 blocks of a resumed conversation."""
    if not hasattr(_per_thread, "decompressor"):
        _per_thread.decompressor = zstandard.ZstdDecompressor()
    return _per_thread.decompressor


def _unshuffle(buf, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(buf, np.uint8).reshape(dtype.itemsize, -1)
    utype = np.dtype(f"<u{dtype.itemsize}")
    u = planes[0].astype(utype)
    for i in range(1, dtype.itemsize):
        u |= planes[i].astype(utype) << utype.type(8 * i)
    return u.view(dtype)


def _native_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)
