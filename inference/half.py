"""float16 in compiled kernels: the live KV cache's element type (kv_cache.py), read and written by numba.

numba has no float16 arrays, so a float16 array reaches a kernel as its bits (`bits_view`: the same
memory as uint16), and a kernel converts one element at a time: `to_f32(x)` reads an element of a
uint16 (float16) or float32 array as float32, `store(x, out)` gives what `out` holds for the float32 x
(float16 bits, rounded to nearest even as NumPy rounds; or x itself). The same kernel source thus
compiles for a float32 and a float16 cache.

Where the processor converts halves itself (F16C on every AVX2 and AVX-512 x86, and every aarch64),
the conversion is one instruction (LLVM's fpext / fptrunc, vectorized). Elsewhere LLVM would call a
runtime function numba does not link, a crash; there the same conversion is done in integer
arithmetic (Maratyszcza's FP16 library), slower but with the same results (tests/test_half.py).
numba's cache keys a kernel by its own file: a change here reaches cached kernels that use it only
once their files change too (or the cache is cleared).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .cpu import PROFILE
from .jit import njit

NATIVE = PROFILE.isa != "SSE"


def to_floats(a: np.ndarray) -> np.ndarray:
    """float32 of an array of numbers, or of float16 bits (uint16) or bfloat16 bits (int16), as the
    kernels read matrices of these formats (formats.HALF_TYPES)."""
    if a.dtype == np.uint16:
        return a.view(np.float16).astype(np.float32)
    if a.dtype == np.int16:
        return (a.astype(np.int32) << 16).view(np.float32)
    return a.astype(np.float32)


def bits_view(a: np.ndarray) -> np.ndarray:
    """What a kernel is handed for an array: a float16 one as its uint16 bits (a view), others as they are."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


@intrinsic
def _half_to_float(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float_to_half(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _float_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@intrinsic
def _bits_from_float(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


# Not inlined into the kernels: their scaling tricks must not be reassociated by a caller's fastmath.
@njit(cache=True)
def half_to_float_portable(h):
    """float16 bits → float32, exactly (normal, subnormal, inf and NaN), in integer arithmetic."""
    w = np.int64(h) << 16
    sign = w & 0x80000000
    two_w = (w + w) & 0xFFFFFFFF
    if two_w < (1 << 27):  # zero or subnormal: its mantissa put into 0.5's and 0.5 taken off, exact
        magnitude = _float_from_bits((two_w >> 17) | (126 << 23)) - np.float32(0.5)
    else:  # rebias the exponent (2^-112 undoes the offset; inf and NaN stay so)
        magnitude = _float_from_bits((two_w >> 4) + (0xE0 << 23)) * np.float32(2.0**-112)
    return _float_from_bits(sign | _bits_from_float(magnitude))


@njit(cache=True)
def float_to_half_portable(x):
    """float32 → float16 bits, rounded to nearest even (overflow to inf, NaN to a quiet NaN)."""
    x = np.float32(x)
    # scaled to where float32's rounding of the addition below is float16's rounding
    base = (abs(x) * np.float32(2.0**112)) * np.float32(2.0**-110)
    w = _bits_from_float(x)
    shl1_w = (w + w) & 0xFFFFFFFF
    sign = w & 0x80000000
    bias = max(shl1_w & 0xFF000000, 0x71000000)
    base = _float_from_bits((bias >> 1) + 0x07800000) + base
    b = _bits_from_float(base)
    nonsign = ((b >> 13) & 0x7C00) + (b & 0x0FFF)
    return np.uint16((sign >> 16) | (0x7E00 if shl1_w > 0xFF000000 else nonsign))


_to_float = _half_to_float if NATIVE else half_to_float_portable
_to_half = _float_to_half if NATIVE else float_to_half_portable


def to_f32(x):
    """(compiled code only) an element of a float32 array, or of a float16 one's bits, as float32."""
    raise NotImplementedError


def store(x, out):
    """(compiled code only) the float32 x as an element of the array `out` (float16 bits or float32)."""
    raise NotImplementedError


@overload(to_f32, inline="always")
def _to_f32(x):
    if x == types.uint16:
        return lambda x: _to_float(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


@overload(store, inline="always")
def _store(x, out):
    if out.dtype == types.uint16:
        return lambda x, out: _to_half(np.float32(x))
    if out.dtype == types.float32:
        return lambda x, out: np.float32(x)
    return None
