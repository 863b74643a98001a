"""The building blocks of a block format's product of one row (block_formats.one_row_group), in LLVM's own
vector types as vectors.py's: MXFP4's block scales, Q1_0's weights from their sign bits, a weight scaled
and multiplied in, a column of a run's small tile multiplied in. Each has its plain NumPy twin in
vectors_reference.py, which tests/test_vectors.py holds it to.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .vectors import _data, _fused_into, _splat, _vector_at


@intrinsic
def _e8m0_halves(typingctx, values, at, w, width):
    """w[:width] = half of 2^(e − 127) for the bytes e at values.flat[at:at + width] (MXFP4's block
    scales, as ggml_e8m0_to_fp32_half), exact: the float32 whose bits are (e − 1) << 23, or for e < 2
    the subnormal 0x00200000 << e."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        at = context.cast(builder, args[1], signature.args[1], types.int64)
        words, f32 = ir.VectorType(ir.IntType(32), n), ir.FloatType()
        values_ptr = _data(context, builder, signature.args[0], args[0])
        exponents = _vector_at(builder, values_ptr, at, ir.IntType(8), n)
        e = builder.zext(builder.load(exponents, align=1), words)
        normal = builder.shl(builder.sub(e, ir.Constant(words, [1] * n)), ir.Constant(words, [23] * n))
        subnormal = builder.shl(ir.Constant(words, [0x00200000] * n), e)
        below = builder.icmp_unsigned("<", e, ir.Constant(words, [2] * n))
        bits = builder.select(below, subnormal, normal)
        floats = builder.bitcast(bits, ir.VectorType(f32, n))
        builder.store(floats, _vector_at(builder, args[2], ir.Constant(ir.IntType(64), 0), f32, n), align=4)
        return context.get_dummy_value()

    return types.void(values, at, w, width), codegen


@intrinsic
def _sign_bit_scales(typingctx, values, at, bit, scale, w, width):
    """w[:width] = scale[:width] where bit `bit` of the bytes at values.flat[at:at + width] is set, else
    −scale[:width] (Q1_0's weights, exact): a test of the bit in the bytes themselves and a select,
    without widening them to numbers first."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32, i8 = width.literal_value, ir.FloatType(), ir.IntType(8)

    def codegen(context, builder, signature, args):
        at, bit = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:3], signature.args[1:3]))
        bytes_t, zero = ir.VectorType(i8, n), ir.Constant(ir.IntType(64), 0)
        values_ptr = _data(context, builder, signature.args[0], args[0])
        column = builder.load(_vector_at(builder, values_ptr, at, i8, n), align=1)
        mask = builder.shl(ir.Constant(i8, 1), builder.trunc(bit, i8))
        tested = builder.and_(column, _splat(builder, bytes_t, mask))
        is_set = builder.icmp_unsigned("!=", tested, ir.Constant(bytes_t, [0] * n))
        scale = builder.load(_vector_at(builder, args[3], zero, f32, n), align=4)
        signed = builder.select(is_set, scale, builder.fneg(scale))
        builder.store(signed, _vector_at(builder, args[4], zero, f32, n), align=4)
        return context.get_dummy_value()

    return types.void(values, at, bit, scale, w, width), codegen


@intrinsic
def _scaled_multiply_add(typingctx, sums, w, scale, xj, width):
    """sums[:width] += (w[:width] · scale[:width]) · xj: the weight rounded to float32 as a tile of it
    would hold it, then multiplied and added in one rounding (_multiply_add's bits for that tile)."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        sums_ptr, w_ptr, scale_ptr, x, _ = args
        zero = ir.Constant(ir.IntType(64), 0)
        weights = builder.load(_vector_at(builder, w_ptr, zero, f32, n), align=4)
        weights = builder.fmul(weights, builder.load(_vector_at(builder, scale_ptr, zero, f32, n), align=4))
        _fused_into(builder, _vector_at(builder, sums_ptr, zero, f32, n), weights, x)
        return context.get_dummy_value()

    return types.void(sums, w, scale, xj, width), codegen


@intrinsic
def _column_multiply_add(typingctx, sums, tile, at, xj, width):
    """sums[:width] += tile[at:at + width] · xj, fused: a column of a small tile of decoded weights (a
    run of a block format's, block_formats.one_row_group) into one row's sums."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        sums_ptr, tile_ptr, at_arg, x, _ = args
        start = context.cast(builder, at_arg, signature.args[2], types.int64)
        weights = builder.load(_vector_at(builder, tile_ptr, start, f32, n), align=4)
        at = _vector_at(builder, sums_ptr, ir.Constant(ir.IntType(64), 0), f32, n)
        _fused_into(builder, at, weights, x)
        return context.get_dummy_value()

    return types.void(sums, tile, at, xj, width), codegen
