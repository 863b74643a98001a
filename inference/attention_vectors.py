"""The attention kernel's building blocks in LLVM's own vector types (numba intrinsics): four dot
products of a query head with four keys, their lanes summed as a tree of shuffles; four values added
into a head's weighted sum; the largest of a run of scores. `width` (a literal: the profile's floats
per register) is the vectors' length; the rows' length is a multiple of it (attention.py pads them).
Each has its plain NumPy twin in vectors_reference.py, which tests/test_vectors.py holds it to, bit
for bit.

Why a tree: a dot product across the lanes of a vector ends in a horizontal sum, several shuffles for
one number. Summing four such vectors together halves them pairwise (the low halves of two vectors
beside each other, plus their high halves), so the shuffles are shared: about two a dot product
instead of four, and the four sums come out side by side, stored at once.
"""

from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vectors import _data, _fma, _splat, _vector_at


def lane_halves(width: int, segment: int, paired: bool) -> tuple[list[int], list[int]]:
    """One step of the tree: vectors of `width` lanes made of segments of `segment` lanes (each
    segment a part of one sum) → the lanes of each segment's first half and of its second half, which
    added give segments half as long; `paired`: across two vectors (the second's lanes numbered from
    `width`, the result as wide), else within one (the result half as wide)."""
    half = segment // 2
    first = [s * segment + i for s in range(width // segment) for i in range(half)]
    second = [s * segment + half + i for s in range(width // segment) for i in range(half)]
    if paired:
        return first + [width + i for i in first], second + [width + i for i in second]
    return first, second


def _sum_lanes(builder, vectors: list) -> ir.Value:
    """The lane sums of a power of two of vectors (no more than their lanes), side by side in one vector
    (see lane_halves)."""
    i32 = ir.IntType(32)
    segment = vectors[0].type.count
    while segment > 1:
        paired = len(vectors) > 1
        pairs = zip(vectors[::2], vectors[1::2]) if paired else [(vectors[0], vectors[0])]
        merged = []
        for a, b in pairs:
            first, second = lane_halves(a.type.count, segment, paired)
            low = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(first)), first))
            high = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(second)), second))
            merged.append(builder.fadd(low, high))
        vectors, segment = merged, segment // 2
    return vectors[0]


def _row_operands(context, builder, signature, args):
    """(a, a_at, rows, n, b, b_at) of the two intrinsics over several rows: the arrays as data pointers,
    the indices as int64."""
    def operand(t, a):
        if isinstance(t, types.Array):
            return _data(context, builder, t, a)
        return context.cast(builder, a, t, types.int64)

    return [operand(t, a) for t, a in zip(signature.args[:6], args[:6], strict=True)]


@contextmanager
def _each_vector(builder, size, w):
    """A loop over the vectors of `w` floats of a row of `size` floats: yields each one's column."""
    i64 = ir.IntType(64)
    with cgutils.for_range(builder, builder.udiv(size, ir.Constant(i64, w))) as loop:
        yield builder.mul(loop.index, ir.Constant(i64, w))


def _row_vector(builder, rows, size, j, at, w):
    """The vector of `w` floats at column `at` of row j of rows [count, size]."""
    row_at = builder.add(builder.mul(size, ir.Constant(ir.IntType(64), j)), at)
    return builder.load(_vector_at(builder, rows, row_at, ir.FloatType(), w), align=4)


@intrinsic
def _dots(typingctx, q, q_at, rows, n, scores, s_at, count, width):
    """scores.flat[s_at + j] = q.flat[q_at:q_at + n] · rows[j, :n] for j < count (rows [count, n], n a
    multiple of width; count a power of two, at most width): per lane a fused multiply-add for each
    vector of the row in order, then the lanes summed as a tree (lane_halves)."""
    if not isinstance(width, types.IntegerLiteral) or not isinstance(count, types.IntegerLiteral):
        return None
    w, m, f32 = width.literal_value, count.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(f32, w)
        q_ptr, q_first, rows_ptr, size, scores_ptr, s_first = _row_operands(context, builder, signature, args)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * w)) for _ in range(m)]
        fma = _fma(builder, w)
        with _each_vector(builder, size, w) as at:
            qv = builder.load(_vector_at(builder, q_ptr, builder.add(q_first, at), f32, w), align=4)
            for j, total in enumerate(sums):
                key = _row_vector(builder, rows_ptr, size, j, at, w)
                builder.store(builder.call(fma, [qv, key, builder.load(total)]), total)
        together = _sum_lanes(builder, [builder.load(total) for total in sums])
        builder.store(together, _vector_at(builder, scores_ptr, s_first, f32, m), align=4)
        return context.get_dummy_value()

    return types.void(q, q_at, rows, n, scores, s_at, count, width), codegen


@intrinsic
def _add_rows(typingctx, acc, a_at, rows, n, weights, w_at, count, width):
    """acc.flat[a_at:a_at + n] += weights.flat[w_at + j] · rows[j, :n] for j < count in order, each
    fused (rows [count, n], n a multiple of width): a position's value at a time, as one row alone
    adds."""
    if not isinstance(width, types.IntegerLiteral) or not isinstance(count, types.IntegerLiteral):
        return None
    w, m, f32 = width.literal_value, count.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        i64, vector = ir.IntType(64), ir.VectorType(f32, w)
        acc_ptr, a_first, rows_ptr, size, weights, w_first = _row_operands(context, builder, signature, args)
        at = [builder.gep(weights, [builder.add(w_first, ir.Constant(i64, j))]) for j in range(m)]
        weight = [_splat(builder, vector, builder.load(a)) for a in at]
        fma = _fma(builder, w)
        with _each_vector(builder, size, w) as at:
            acc_at = _vector_at(builder, acc_ptr, builder.add(a_first, at), f32, w)
            total = builder.load(acc_at, align=4)
            for j in range(m):
                total = builder.call(fma, [_row_vector(builder, rows_ptr, size, j, at, w), weight[j], total])
            builder.store(total, acc_at, align=4)
        return context.get_dummy_value()

    return types.void(acc, a_at, rows, n, weights, w_at, count, width), codegen


@intrinsic
def _largest(typingctx, values, at, n, width):
    """The largest of values.flat[at:at + n] (n a multiple of width; NaN ignored, as maxnum does):
    `width` running maxima, then the largest of them."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    w, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(f32, w)
        values_ptr = _data(context, builder, signature.args[0], args[0])
        first, size = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 2))
        top = cgutils.alloca_once_value(builder, ir.Constant(vector, [float("-inf")] * w))
        pairwise = ir.FunctionType(vector, [vector, vector])
        maxnum = cgutils.get_or_insert_function(builder.module, pairwise, f"llvm.maxnum.v{w}f32")
        with _each_vector(builder, size, w) as at:
            x = builder.load(_vector_at(builder, values_ptr, builder.add(first, at), f32, w), align=4)
            builder.store(builder.call(maxnum, [builder.load(top), x]), top)
        across = ir.FunctionType(f32, [vector])
        reduce = cgutils.get_or_insert_function(builder.module, across, f"llvm.vector.reduce.fmax.v{w}f32")
        return builder.call(reduce, [builder.load(top)])

    return types.float32(values, at, n, width), codegen
