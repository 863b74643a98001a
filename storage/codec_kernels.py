"""The KV codec's inner loops, compiled (storage/codec.py and codec_formats.py say the format;
tests/codec_reference.py holds the plain NumPy version these must agree with, byte for byte). Through NumPy,
unpacking 6-bit codes and applying the scales took ~20 of the ~27 ms that decoding a 2,000-token
conversation's 32 blocks cost (a pass over memory per step), and encoding a block 3.5 ms; here ~0.2 and ~1.3
ms a block. codec_formats.py imports this module on first use: numba's import and set-up (~0.3 s) are not for
commands that never encode or decode a block, such as listing sessions."""

from __future__ import annotations

import numpy as np

# bits_view: how codec_formats.py hands an array to these kernels (a float16 one as its bits)
from llama_chat.inference.half import bits_view, store  # noqa: F401
from llama_chat.inference.jit import njit


@njit(cache=True, nogil=True)
def unpack_sixes(packed, codes):
    """Four 6-bit codes from every three bytes, the first in the lowest bits (as pack_sixes lays them
    out); codes holds 4 * (packed.size // 3) of them."""
    for w in range(packed.size // 3):
        b0, b1, b2 = np.int32(packed[3 * w]), np.int32(packed[3 * w + 1]), np.int32(packed[3 * w + 2])
        codes[4 * w] = b0 & 63
        codes[4 * w + 1] = (b0 >> 6) | ((b1 & 15) << 2)
        codes[4 * w + 2] = (b1 >> 4) | ((b2 & 3) << 4)
        codes[4 * w + 3] = b2 >> 2


@njit(cache=True, nogil=True)
def unpack_nibbles(packed, codes):
    """Two 4-bit codes from every byte, the first in the low nibble; codes holds 2 * packed.size."""
    for i in range(packed.size):
        codes[2 * i] = packed[i] & 15
        codes[2 * i + 1] = packed[i] >> 4


@njit(cache=True, nogil=True)
def dequantize(codes, scales, mins, group_bits, out, channel_major, signed, differences):
    """out = mins + codes * scales, a scale and a min per 2**group_bits codes along codes' last axis.

    codes [A, B, R, n] uint8 with scales and mins [A, B, R, groups]; out is [A, B, R, n], or
    [A, B, n, R] where channel_major (keys are stored a channel at a time and used a token at a time):
    the transpose is written in the same pass. out is float32 or float16's bits (half.bits_view: a
    float16 KV arena is written as it is read, rounded once). `signed`: the codes are int8's bits (q8's
    symmetric codes). `differences`: each byte is its code minus the one before along the last axis,
    mod 256 (how 8-bit keys are stored), summed back here: NumPy's cumsum over those short rows took
    as long as all the rest of decoding. (A shift, not a division by the group: 1.8x the speed.)"""
    A, B, R, n = codes.shape
    for a in range(A):
        for b in range(B):
            for r in range(R):
                code = 0
                for j in range(n):
                    byte = np.int32(codes[a, b, r, j])
                    code = (code + byte) & 255 if differences else byte
                    value = code - ((code & 128) << 1) if signed else code
                    g = j >> group_bits
                    x = mins[a, b, r, g] + np.float32(value) * scales[a, b, r, g]
                    if channel_major:
                        out[a, b, j, r] = store(x, out)
                    else:
                        out[a, b, r, j] = store(x, out)


# -- encoding --------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def group_ranges(x, group_bits, lo, hi):
    """The min and max of each group of 2**group_bits values along x's last axis (the last group may be
    shorter): lo, hi [A, B, R, groups]. x may be a transposed view (keys, read a channel at a time)."""
    A, B, R, n = x.shape
    size = 1 << group_bits
    for a in range(A):
        for b in range(B):
            for r in range(R):
                for g in range(lo.shape[3]):
                    first = g * size
                    low = high = x[a, b, r, first]
                    for j in range(first + 1, min(first + size, n)):
                        value = x[a, b, r, j]
                        low = min(low, value)
                        high = max(high, value)
                    # + 0: a zero's sign is not kept (-0.0 becomes 0.0), so that the bytes do not
                    # depend on which of two zeros a comparison happened to keep
                    lo[a, b, r, g] = low + np.float32(0.0)
                    hi[a, b, r, g] = high + np.float32(0.0)


@njit(cache=True, nogil=True)
def quantize(x, scales, mins, group_bits, low, high, codes):
    """codes (flat, in the row-major order of x's shape) = rint((x - min) / scale), clipped to low..high,
    a scale and a min per 2**group_bits values along the last axis; a zero scale divides by 1. The same
    float32 operations as NumPy's, so the same codes."""
    A, B, R, n = x.shape
    i = 0
    for a in range(A):
        for b in range(B):
            for r in range(R):
                for j in range(n):
                    g = j >> group_bits
                    s = scales[a, b, r, g]
                    q = np.rint((x[a, b, r, j] - mins[a, b, r, g]) / (s if s > 0 else np.float32(1.0)))
                    codes[i] = min(max(q, low), high)
                    i += 1


@njit(cache=True, nogil=True)
def pack_sixes(codes, packed):
    """Four 6-bit codes in every three bytes, the first in the lowest bits (codes past the end: 0)."""
    n = codes.size
    for w in range(packed.size // 3):
        word = 0
        for i in range(4):
            if 4 * w + i < n:
                word |= np.int32(codes[4 * w + i]) << (6 * i)
        packed[3 * w] = word & 255
        packed[3 * w + 1] = (word >> 8) & 255
        packed[3 * w + 2] = word >> 16


@njit(cache=True, nogil=True)
def pack_nibbles(codes, packed):
    """Two 4-bit codes in every byte, the first in the low nibble (a code past the end: 0)."""
    n = codes.size
    for i in range(packed.size):
        high = codes[2 * i + 1] if 2 * i + 1 < n else 0
        packed[i] = codes[2 * i] | (high << 4)


@njit(cache=True, nogil=True)
def hadamard_rows(x, block):
    """Each row of x [N, D] (float32, in place) through the normalised Walsh-Hadamard transform, in
    pieces of `block` (a power of two dividing D): butterflies of stride 1, 2, 4, ..., then 1/sqrt(block).
    The transform is its own inverse. tests/codec_reference.py does the same float32 operations in the
    same order, so the same bits."""
    N, D = x.shape
    norm = np.float32(1.0 / np.sqrt(np.float64(block)))
    for r in range(N):
        for start in range(0, D, block):
            h = 1
            while h < block:
                for i in range(start, start + block, 2 * h):
                    for j in range(i, i + h):
                        a = x[r, j]
                        b = x[r, j + h]
                        x[r, j] = a + b
                        x[r, j + h] = a - b
                h *= 2
            for j in range(start, start + block):
                x[r, j] *= norm


# Every kernel of this module, for compile_kernels' "compiled or loaded from the cache?"
COMPILED = (
    unpack_sixes,
    unpack_nibbles,
    dequantize,
    group_ranges,
    quantize,
    pack_sixes,
    pack_nibbles,
    hadamard_rows,
)
