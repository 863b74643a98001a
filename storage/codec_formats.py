"""The KV codecs as one table: each codec's id in a block's header, the bits of a stored value, and how
its streams are written, read back and sized (codec.py frames them, and describes the layout). Adding a
codec is adding a row. The steps they share come first: groups of GROUP values with a float16 scale
(and a min) each, byte shuffling, and 6- and 4-bit codes packed into bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

AUTO = "auto"  # a precision per layer and KV head, as a KVPlan says (kv_plan.py measures one per model)
AUTO_ROTATED = "auto-h"  # auto with Hadamard-rotated values
PLAN_BITS = (4, 6, 8, 16)  # the precisions an auto block gives one head's keys or values

GROUP = 32  # values sharing one quantization scale
GROUP_BITS = GROUP.bit_length() - 1  # GROUP is a power of two: its log2, for the compiled loops

F32 = np.dtype("<f4")
F16 = np.dtype("<f2")
F16_MAX = np.float32(65504.0)

Shape = tuple[int, int, int, int]  # n_layer, n_kv_head, n_tokens, head_dim


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


# -- the steps codecs share ------------------------------------------------------------------------


def kernels():
    """The compiled loops (codec_kernels.py), imported on first use: numba's import and set-up (~0.3 s)
    are not for commands that never encode or decode a block, such as listing sessions."""
    from . import codec_kernels

    return codec_kernels


def channel_major(k: np.ndarray) -> np.ndarray:
    """[L, H, T, D] -> [L, H, D, T]: keys are grouped along tokens, one channel at a time (KIVI). A view:
    the compiled loops read it where it lies."""
    return k.transpose(0, 1, 3, 2)


def n_groups(shape: Shape) -> tuple[int, int]:
    """Scale groups of the keys (along tokens, per channel) and of the values (along head_dim, per token)."""
    n_layer, n_head, n_tokens, head_dim = shape
    gk = n_layer * n_head * head_dim * -(-n_tokens // GROUP)
    gv = n_layer * n_head * n_tokens * -(-head_dim // GROUP)
    return gk, gv


def ranges(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The min and max of each group of 32 along the last axis (a ragged last group is shorter)."""
    shape = (*x.shape[:-1], -(-x.shape[-1] // GROUP))
    lo, hi = np.empty(shape, np.float32), np.empty(shape, np.float32)
    kernels().group_ranges(x, GROUP_BITS, lo, hi)
    return lo, hi


def quantized_codes(
    x: np.ndarray, scales: np.ndarray, mins: np.ndarray, low: int, high: int, dtype
) -> np.ndarray:
    """rint((x - min) / scale) per group, clipped to low..high: [..., n] of dtype."""
    codes = np.empty(x.shape, dtype)
    s, m = scales.astype(np.float32), mins.astype(np.float32)
    kernels().quantize(x, s, m, GROUP_BITS, low, high, codes.reshape(-1))
    return codes


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 along the last axis, groups of 32: (q [..., n] int8, scales [..., groups] f16)."""
    lo, hi = ranges(x)
    # The scale is rounded *up* to float16, so |x| / scale <= 127 and every error is <= scale / 2.
    scale = f16_ceil(np.minimum(np.maximum(np.abs(lo), np.abs(hi)) / np.float32(127), F16_MAX))
    return quantized_codes(x, scale, np.zeros_like(lo), -127, 127, np.int8), scale  # (no min: zeros)


def quantize_asymmetric(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric along the last axis, groups of 32: x ~= min + q * scale, q in 0..2**bits - 1.

    Returns (q [..., n] uint8, scales, mins), scales and mins [..., groups] float16. A min per group
    matters because key channels carry large biases: 16 levels spread over [min, max] of a channel
    at 50 +- 2 are ~30x finer than 16 levels spread symmetrically over +-52.
    """
    top = 2**bits - 1
    lo, hi = ranges(x)
    mn = f16_floor(np.clip(lo, -F16_MAX, F16_MAX))  # rounded down and the scale up, so
    m = mn.astype(np.float32)  # [min, min + top * scale] covers the group
    scale = f16_ceil(np.minimum((hi - m) / np.float32(top), F16_MAX))
    return quantized_codes(x, scale, m, 0, top, np.uint8), scale, mn


def dequantize(
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
    out: np.ndarray,
    keys: bool,
    signed: bool = False,
    differences: bool = False,
) -> None:
    """out = min + code * scale per group, by the compiled loop; codes [A, B, R, n] uint8 with a scale
    and a min per group along n; keys (codes channel-major) are written back token-major. out is
    float32 or float16 (the KV arena's type), written as it is read. signed: the codes are int8's
    bits; differences: each is its code minus the one before along n, mod 256 (codec_kernels.py)."""
    groups = (*codes.shape[:3], -1)
    compiled = kernels()
    scales, mins = scales.reshape(groups), mins.reshape(groups)
    compiled.dequantize(codes, scales, mins, GROUP_BITS, compiled.bits_view(out), keys, signed, differences)


def hadamard_block(head_dim: int) -> int:
    """The pieces a head's values are rotated in: the largest power of two dividing head_dim (all of
    it on the models here: 64, 128, 256)."""
    return head_dim & -head_dim


def rotated(x: np.ndarray) -> np.ndarray:
    """x [..., head_dim] as a new float32 array, each head's vector through the normalised Walsh-Hadamard
    transform (its own inverse): a channel far larger than the rest is spread over all of them, so a
    group's range, and 4-bit rounding, is set by the vector's size, not by its outlier (QuaRot)."""
    return rotate_in_place(np.array(x, np.float32, order="C"))


def rotate_in_place(x: np.ndarray) -> np.ndarray:
    """rotated() of a C-contiguous float32 array, written over it (a decoded part: no second copy)."""
    kernels().hadamard_rows(x.reshape(-1, x.shape[-1]), hadamard_block(x.shape[-1]))
    return x


def f16_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest float16 >= x (x in [0, 65504])."""
    h = x.astype(F16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def f16_floor(x: np.ndarray) -> np.ndarray:
    """Largest float16 <= x (x in [-65504, 65504])."""
    h = x.astype(F16)
    high = h.astype(np.float32) > x
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


def to_f16(x: np.ndarray) -> np.ndarray:
    # Saturate rather than overflow to inf; NaN stays NaN.
    return np.clip(x, -F16_MAX, F16_MAX).astype(F16)


def shuffle(a: np.ndarray) -> np.ndarray:
    """Byte-shuffle: byte 0 of every value, then byte 1, ...; exponent bytes then compress well.

    Same result as a.view(np.uint8).reshape(-1, itemsize).T.copy(), but shifts run ~3x faster."""
    u = np.ascontiguousarray(a).ravel().view(f"<u{a.itemsize}")
    out = np.empty((a.itemsize, u.size), np.uint8)
    for i in range(a.itemsize):
        np.right_shift(u, 8 * i, out=out[i], casting="unsafe")
    return out


def unshuffle(buf, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(buf, np.uint8).reshape(dtype.itemsize, -1)
    utype = np.dtype(f"<u{dtype.itemsize}")
    u = planes[0].astype(utype)
    for i in range(1, dtype.itemsize):
        u |= planes[i].astype(utype) << utype.type(8 * i)
    return u.view(dtype)


def packed_size(bits: int, n: int) -> int:
    """Bytes of n codes of `bits`: 8-bit codes a byte each, 6-bit four to three bytes, 4-bit two to a byte."""
    return {8: n, 6: 3 * -(-n // 4), 4: (n + 1) // 2}[bits]


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """6-bit codes four to three bytes (the first in the lowest bits), 4-bit codes two to a byte (the first
    in the low nibble)."""
    packed = np.empty(packed_size(bits, q.size), np.uint8)
    (kernels().pack_sixes if bits == 6 else kernels().pack_nibbles)(q.reshape(-1), packed)
    return packed


def unpack(raw: memoryview, bits: int, n: int) -> np.ndarray:
    """n codes of 6 or 4 bits from the packed bytes at the start of raw."""
    codes = np.empty(4 * -(-n // 4), np.uint8)  # whole groups of four codes
    unpack_codes = kernels().unpack_sixes if bits == 6 else kernels().unpack_nibbles
    unpack_codes(np.frombuffer(raw, np.uint8, packed_size(bits, n)), codes)
    return codes[:n]


# -- the codecs ------------------------------------------------------------------------------------


class Codec:
    """One way to store a block: its id in a block's header, the bits of each stored value (None: per head,
    as the block's plan says), and its streams. k and v are [n_layer, n_kv_head, n_tokens, head_dim]."""

    # zstd's level for the block's frame. Float streams (byte-shuffled: their exponent bytes) gain from
    # its entropy coding; integer codes hardly do, and decoding that coding was most of a resume's
    # zstd time: negative levels leave it out (see the codecs below).
    zstd_level = 1

    def __init__(self, codec_id: int, bits: int | None):
        self.id = codec_id
        self.bits = bits

    @property
    def quantized(self) -> bool:
        """Whether values go to integer codes, which only finite values have."""
        return self.bits is None or self.bits <= 8

    def encode(self, k: np.ndarray, v: np.ndarray, plan: KVPlan | None) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, raw: memoryview, k: np.ndarray, v: np.ndarray, plan: KVPlan | None) -> None:
        """The streams in raw decoded into k and v (float32 or float16, maybe views of the KV arena)."""
        raise NotImplementedError

    def payload_size(self, shape: Shape, plan: KVPlan | None) -> int:
        """Bytes of the streams of a block of this shape."""
        raise NotImplementedError


class FloatCodec(Codec):
    """k, then v, each byte-shuffled, as float32 (lossless) or float16 (saturating at +-65504)."""

    def __init__(self, codec_id: int, dtype: np.dtype):
        super().__init__(codec_id, 8 * dtype.itemsize)
        self.dtype = dtype

    def encode(self, k, v, plan):
        if self.dtype == F32:
            return [shuffle(k), shuffle(v)]
        return [shuffle(to_f16(k)), shuffle(to_f16(v))]

    def decode(self, raw, k, v, plan):
        half = self.dtype.itemsize * k.size
        np.copyto(k, unshuffle(raw[:half], self.dtype).reshape(k.shape))
        np.copyto(v, unshuffle(raw[half:], self.dtype).reshape(v.shape))

    def payload_size(self, shape, plan):
        return 2 * self.dtype.itemsize * math.prod(shape)


class SymmetricCodec(Codec):
    """q8: k as int8 per channel [L, H, D, T], token-to-token differences; v as int8 [L, H, T, D]; the
    float16 scales of k then v, byte-shuffled together."""

    # Level -1 stores literals as they are: on the default model's KV (a 2,048-token conversation),
    # 6,525 bytes a token instead of 6,110 (+6.8 %), and its 32 frames decompress in 1.8 ms, not 15.
    zstd_level = -1

    def encode(self, k, v, plan):
        qk, sk = quantize_q8(channel_major(k))
        qv, sv = quantize_q8(v)
        # Keys carry RoPE'd biases that drift slowly along tokens in many channels: storing each
        # channel's token-to-token difference (wrapping mod 256, so exact) makes that stream ~6%
        # smaller on real KV. Values (not rotated, grouped per token) gain nothing from it.
        dk = np.diff(qk.view(np.uint8), axis=-1, prepend=np.uint8(0))
        return [dk, qv, shuffle(np.concatenate([sk.ravel(), sv.ravel()]))]

    def decode(self, raw, k, v, plan):
        n = k.size
        gk, _ = n_groups(k.shape)
        qk = np.frombuffer(raw, np.uint8, n).reshape(channel_major(k).shape)  # token-to-token differences
        qv = np.frombuffer(raw, np.uint8, n, offset=n).reshape(v.shape)
        scales = unshuffle(raw[2 * n :], F16).astype(np.float32)
        sk, sv = scales[:gk], scales[gk:]
        # symmetric: mins of zero, to share the loop
        dequantize(qk, sk, np.zeros_like(sk), k, True, signed=True, differences=True)
        dequantize(qv, sv, np.zeros_like(sv), v, False, signed=True)

    def payload_size(self, shape, plan):
        return 2 * math.prod(shape) + 2 * sum(n_groups(shape))


class AsymmetricCodec(Codec):
    """q6 and q4: k codes [L, H, D, T], v codes [L, H, T, D], packed; float16 scales of k, of v, mins of
    k, of v, byte-shuffled together."""

    # As q8's (SymmetricCodec): q6 +0.8 % bytes, q4 +3.2 %, each frame ~5x faster to decompress.
    zstd_level = -1

    def encode(self, k, v, plan):
        qk, sk, mk = quantize_asymmetric(channel_major(k), self.bits)
        qv, sv, mv = quantize_asymmetric(v, self.bits)
        scales = shuffle(np.concatenate([sk, sv, mk, mv], axis=None))
        return [pack(qk, self.bits), pack(qv, self.bits), scales]

    def decode(self, raw, k, v, plan):
        n = k.size
        size = packed_size(self.bits, n)
        gk, gv = n_groups(k.shape)
        qk = unpack(raw, self.bits, n).reshape(channel_major(k).shape)
        qv = unpack(raw[size:], self.bits, n).reshape(v.shape)
        scales = unshuffle(raw[2 * size :], F16).astype(np.float32)
        sk, sv, mk, mv = np.split(scales, [gk, gk + gv, 2 * gk + gv])
        dequantize(qk, sk, mk, k, True)
        dequantize(qv, sv, mv, v, False)

    def payload_size(self, shape, plan):
        return 2 * packed_size(self.bits, math.prod(shape)) + 4 * sum(n_groups(shape))


class PlannedCodec(Codec):
    """auto: keys first, values next, for each bits of PLAN_BITS in order, the heads the plan gives it (in
    row-major order) as one part [n, T, D]: at 16 bits byte-shuffled float16; else asymmetric codes
    (keys per channel [n, D, T], values per token), 8-bit keys as token-to-token differences, 6 and 4
    bits packed; then the part's float16 scales and mins, byte-shuffled together. With rotate_values
    (auto-h), quantized values are stored as rotated(values) (the rotation is undone on decode)."""

    def __init__(self, codec_id: int, rotate_values: bool = False):
        super().__init__(codec_id, None)
        self.rotate_values = rotate_values

    def encode(self, k, v, plan):
        L, H, T, D = k.shape
        streams = []
        for x, bits, is_key, chosen, _ in self._parts(plan, k.shape, k, v):
            part = x.reshape(L * H, T, D)[chosen][None]
            streams += self._encode_part(rotated(part) if self._rotates(bits, is_key) else part, bits, is_key)
        return streams

    def decode(self, raw, k, v, plan):
        _, H, T, D = k.shape
        offset = 0
        for x, bits, is_key, chosen, size in self._parts(plan, k.shape, k, v):
            data = raw[offset : offset + size]
            if self._rotates(bits, is_key):  # rotated back in float32, then rounded once to the arena's type
                part = rotate_in_place(self._decode_part(data, chosen.size, T, D, bits, is_key, F32))
            else:
                part = self._decode_part(data, chosen.size, T, D, bits, is_key, x.dtype)
            x[chosen // H, chosen % H] = part  # (written through: x may be the arena's view)
            offset += size

    def payload_size(self, shape, plan):
        return sum(size for *_, size in self._parts(plan, shape))

    def _rotates(self, bits: int, is_key: bool) -> bool:
        # Keys are not rotated: they are grouped per channel, where a bias channel's range is already its
        # own; rotating spread Qwen's biases over every channel and made 4-bit keys worse
        # (docs/kv-cache.md, Codecs). Float16 values keep their exact path.
        return self.rotate_values and not is_key and bits < 16

    def _parts(self, plan: KVPlan, shape: Shape, k=None, v=None):
        """The parts of a block in stream order: (k or v, bits, chosen heads (flat indices), bytes)."""
        _, _, T, D = shape
        for x, bits_of, is_key in ((k, plan.k_bits, True), (v, plan.v_bits, False)):
            flat = np.array(bits_of).ravel()
            for bits in PLAN_BITS:
                chosen = np.flatnonzero(flat == bits)
                if chosen.size:
                    yield x, bits, is_key, chosen, self._part_size(chosen.size, T, D, bits, is_key)

    @staticmethod
    def _part_size(n: int, T: int, D: int, bits: int, is_key: bool) -> int:
        values = n * T * D
        if bits == 16:
            return 2 * values
        groups = n * D * -(-T // GROUP) if is_key else n * T * -(-D // GROUP)
        return packed_size(bits, values) + 4 * groups

    @staticmethod
    def _encode_part(x: np.ndarray, bits: int, is_key: bool) -> list[np.ndarray]:
        """Heads [1, n, T, D] given the same bits: their streams."""
        if bits == 16:
            return [shuffle(to_f16(x))]
        q, scales, mins = quantize_asymmetric(channel_major(x) if is_key else x, bits)
        if bits == 8:
            # as q8's keys: each channel's token-to-token difference (mod 256, so exact) compresses better
            codes = np.diff(q, axis=-1, prepend=np.uint8(0)) if is_key else q
        else:
            codes = pack(q, bits)
        return [codes, shuffle(np.concatenate([scales, mins], axis=None))]

    @staticmethod
    def _decode_part(raw: memoryview, n: int, T: int, D: int, bits: int, is_key: bool, dtype) -> np.ndarray:
        """n heads [n, T, D] of one part, of dtype (float32 or float16: the KV arena's)."""
        values = n * T * D
        if bits == 16:
            return unshuffle(raw, F16).reshape(n, T, D).astype(dtype, copy=False)
        coded = (1, n, D, T) if is_key else (1, n, T, D)
        if bits == 8:
            q = np.frombuffer(raw, np.uint8, values).reshape(coded)  # keys: token-to-token differences
        else:
            q = unpack(raw, bits, values).reshape(coded)
        scales, mins = np.split(unshuffle(raw[packed_size(bits, values) :], F16).astype(np.float32), 2)
        out = np.empty((1, n, T, D), dtype)
        dequantize(q, scales, mins, out, is_key, differences=is_key and bits == 8)
        return out[0]


# Every codec a block may say it is, by name; the first five store every layer and head alike, the
# planned ones (bits None) each layer and head as the block's plan says.
TABLE: dict[str, Codec] = {
    "f32": FloatCodec(1, F32),
    "f16": FloatCodec(2, F16),
    "q8": SymmetricCodec(3, 8),
    "q6": AsymmetricCodec(5, 6),
    "q4": AsymmetricCodec(4, 4),
    AUTO: PlannedCodec(6),
    AUTO_ROTATED: PlannedCodec(7, rotate_values=True),
}
