"""The attention kernel's building blocks in LLVM's own vector types (numba intrinsics): several query
heads' scores for a vector of positions, from keys laid out with positions across the lanes (the KV
arena's blocks, kv_arena.py); values read from the cache where they lie and added into several heads'
weighted sums; the largest of a run of scores; a row of the cache as float32. `width` (a literal: the
profile's floats per register) is the vectors' length. Several query rows at once take two more
(_tile_scores, _tile_add): a query in each lane. No lanes are summed across anywhere: each lane is a
position's or a query's own chain of fused multiply-adds. Each has its plain NumPy twin in
vectors_reference.py, which tests/test_vectors.py holds it to, bit for bit.

Why several heads a call: the query heads that share a kv head read the same keys and values. Their
multiply-adds side by side read and widen each vector once for all of them, and give the processor
chains of multiply-adds that do not wait on one another (one head's alone is a chain as long as the
row, each step waiting on the last).
"""

from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vectors import _data, _fma, _splat, _vector_at


@contextmanager
def _each_vector(builder, size, w):
    """A loop over the vectors of `w` floats of a row of `size` floats: yields each one's column."""
    i64 = ir.IntType(64)
    with cgutils.for_range(builder, builder.udiv(size, ir.Constant(i64, w))) as loop:
        yield builder.mul(loop.index, ir.Constant(i64, w))


def _literals(*values) -> bool:
    return all(isinstance(v, types.IntegerLiteral) for v in values)


def _operands(context, builder, signature, args):
    """The intrinsics' arguments as LLVM values: arrays as their data pointers, indices as int64."""
    def operand(t, a):
        if isinstance(t, types.Array):
            return _data(context, builder, t, a)
        return context.cast(builder, a, t, types.int64)

    return [operand(t, a) for t, a in zip(signature.args, args, strict=True)]


def _at(builder, first, stride, g):
    """first + g·stride (int64 values, g a Python int)."""
    return builder.add(first, builder.mul(stride, ir.Constant(ir.IntType(64), g)))


def _cache_row_vector(builder, kv_ptr, start, col, w, half, mask=None):
    """The `w` elements of a row of the cache from kv_ptr[start + col] as float32 (float16 bits widened);
    `mask`: the lanes to read, the others 0 (a row's last, partial vector, which must not read past it)."""
    f32 = ir.FloatType()
    element = ir.IntType(16) if half else f32
    vector = ir.VectorType(element, w)
    where = _vector_at(builder, kv_ptr, builder.add(start, col), element, w)
    if mask is None:
        x = builder.load(where, align=2 if half else 4)
    else:
        suffix = f"v{w}{'i16' if half else 'f32'}"
        kind = ir.FunctionType(vector, [vector.as_pointer(), ir.IntType(32), mask.type, vector])
        name = f"llvm.masked.load.{suffix}.p0{suffix}"
        masked_load = cgutils.get_or_insert_function(builder.module, kind, name)
        alignment = ir.Constant(ir.IntType(32), 2 if half else 4)
        x = builder.call(masked_load, [where, alignment, mask, ir.Constant(vector, None)])
    if half:
        x = builder.fpext(builder.bitcast(x, ir.VectorType(ir.HalfType(), w)), ir.VectorType(f32, w))
    return x


def _add_block(builder, kv_ptr, starts_ptr, count, cols, w, half, masks, sums_at, w_ptr, w_step):
    """One pass of _add_rows over all the rows for the vectors of each head's sums at columns `cols` (their
    `masks`: None, or the lanes of a partial vector): the sums in registers, each row's vectors widened
    once for all the heads."""
    vector = ir.VectorType(ir.FloatType(), w)
    fma = _fma(builder, w)
    hold = cgutils.alloca_once_value
    totals = [[hold(builder, builder.load(at, align=4)) for at in head] for head in sums_at]
    with cgutils.for_range(builder, count) as loop:
        j = loop.index
        start = builder.load(builder.gep(starts_ptr, [j]))
        rows = [
            _cache_row_vector(builder, kv_ptr, start, col, w, half, mask)
            for col, mask in zip(cols, masks, strict=True)
        ]
        for g, head in enumerate(totals):
            weight = _splat(builder, vector, builder.load(builder.gep(w_ptr, [_at(builder, j, w_step, g)])))
            for row, total in zip(rows, head, strict=True):
                builder.store(builder.call(fma, [row, weight, builder.load(total)]), total)
    for head, head_at in zip(totals, sums_at, strict=True):
        for total, at in zip(head, head_at, strict=True):
            builder.store(builder.load(total), at, align=4)


@intrinsic
def _add_rows(typingctx, acc, a_stride, kv, starts, count, n, weights, w_stride, heads, columns, width):
    """acc.flat[g·a_stride + d] += weights.flat[g·w_stride + j] · row_j[d] for d < n and the rows j <
    count in order, each fused, for each of `heads` heads g: row_j the n elements of the cache from
    kv.flat[starts[j]] (float16 bits widened, or float32). `columns` vectors of each head's sums a pass
    over the rows, held in registers over all of them (acc's rows padded to a multiple of
    columns·width; the lanes past n add zeros); each row's vector widened once for all the heads."""
    if not _literals(width, heads, columns):
        return None
    w, nh, nc = width.literal_value, heads.literal_value, columns.literal_value
    half = kv.dtype == types.uint16

    def codegen(context, builder, signature, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        acc_ptr, a_step, kv_ptr, starts_ptr, n_rows, size, w_ptr, w_step, *_ = _operands(
            context, builder, signature, args
        )
        block = ir.Constant(i64, nc * w)

        def block_pass(col0, masks):
            cols = [builder.add(col0, ir.Constant(i64, c * w)) for c in range(nc)]
            sums_at = [[_vector_at(builder, acc_ptr, _at(builder, col, a_step, g), f32, w) for col in cols]
                       for g in range(nh)]
            _add_block(builder, kv_ptr, starts_ptr, n_rows, cols, w, half, masks, sums_at, w_ptr, w_step)

        whole = builder.udiv(size, block)
        with cgutils.for_range(builder, whole) as loop:
            block_pass(builder.mul(loop.index, block), [None] * nc)
        col0 = builder.mul(whole, block)
        left = builder.sub(size, col0)  # the row's last elements, fewer than a block's
        with builder.if_then(builder.icmp_signed(">", left, ir.Constant(i64, 0)), likely=False):
            lanes_t = ir.VectorType(i64, w)
            lanes = ir.Constant(lanes_t, list(range(w)))
            in_row = [builder.sub(left, ir.Constant(i64, c * w)) for c in range(nc)]  # ≤ 0: none of its lanes
            block_pass(col0, [builder.icmp_signed("<", lanes, _splat(builder, lanes_t, k)) for k in in_row])
        return context.get_dummy_value()

    signature = types.void(acc, a_stride, kv, starts, count, n, weights, w_stride, heads, columns, width)
    return signature, codegen


@intrinsic
def _widen(typingctx, values, at, out, out_at, n, width):
    """out.flat[out_at : out_at + n] = values.flat[at : at + n] as float32 (float16 bits widened, or
    float32 copied), a vector at a time (n a multiple of width)."""
    if not _literals(width):
        return None
    w, f32 = width.literal_value, ir.FloatType()
    half = values.dtype == types.uint16

    def codegen(context, builder, signature, args):
        values_ptr, first, out_ptr, out_first, size, _ = _operands(context, builder, signature, args)
        with _each_vector(builder, size, w) as col:
            element = ir.IntType(16) if half else f32
            source = _vector_at(builder, values_ptr, builder.add(first, col), element, w)
            x = builder.load(source, align=2 if half else 4)
            if half:
                x = builder.fpext(builder.bitcast(x, ir.VectorType(ir.HalfType(), w)), ir.VectorType(f32, w))
            builder.store(x, _vector_at(builder, out_ptr, builder.add(out_first, col), f32, w), align=4)
        return context.get_dummy_value()

    return types.void(values, at, out, out_at, n, width), codegen


@intrinsic
def _block_scores(typingctx, q, q_at, q_stride, keys, k_at, n, block, scores, s_at, s_stride, heads, width):
    """scores.flat[s_at + g·s_stride + p] = Σ_d q.flat[q_at + g·q_stride + d] · keys.flat[k_at + d·block + p]
    for the `width` positions p and each of `heads` query heads g, over d < n in order, each fused: keys
    laid out with positions across the lanes (a block of the cache as [head_dim, block], float16 bits
    widened or float32), so that each head's sums are one vector of positions and no lanes are summed
    across; each d's vector of keys widened once for all the heads."""
    if not _literals(width, heads):
        return None
    w, nh, f32 = width.literal_value, heads.literal_value, ir.FloatType()
    half = keys.dtype == types.uint16

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(f32, w)
        q_ptr, q_first, q_step, k_ptr, k_first, size, row, s_ptr, s_first, s_step, *_ = _operands(
            context, builder, signature, args
        )
        sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * w)) for _ in range(nh)]
        fma = _fma(builder, w)
        with cgutils.for_range(builder, size) as loop:
            d = loop.index
            key = _cache_row_vector(builder, k_ptr, k_first, builder.mul(d, row), w, half)
            for g, total in enumerate(sums):
                element = builder.load(builder.gep(q_ptr, [builder.add(_at(builder, q_first, q_step, g), d)]))
                query = _splat(builder, vector, element)
                builder.store(builder.call(fma, [query, key, builder.load(total)]), total)
        for g, total in enumerate(sums):
            where = _vector_at(builder, s_ptr, _at(builder, s_first, s_step, g), f32, w)
            builder.store(builder.load(total), where, align=4)
        return context.get_dummy_value()

    signature = types.void(q, q_at, q_stride, keys, k_at, n, block, scores, s_at, s_stride, heads, width)
    return signature, codegen


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


@intrinsic
def _tile_scores(typingctx, queries, rows, rows_at, n, scores, s_at, keys, width):
    """scores.flat[s_at + j·width : … + width] = Σ_d queries[d, :width] · rows.flat[rows_at + j·n + d] for
    the `keys` rows j (queries [n, width]: a query in each lane, transposed): for each d in order, a fused
    multiply-add of the queries' vector by the row's element in every lane. Each lane is a dot product
    of its own, summed in d's order: no lanes summed across, and a query's score is the same in any
    lane beside any others."""
    if not _literals(keys, width):
        return None
    m, w, f32 = keys.literal_value, width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        vector, i64 = ir.VectorType(f32, w), ir.IntType(64)
        q_ptr, rows_ptr, first, size, scores_ptr, s_first, *_ = _operands(context, builder, signature, args)
        sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * w)) for _ in range(m)]
        fma = _fma(builder, w)
        with cgutils.for_range(builder, size) as loop:
            d = loop.index
            at_queries = _vector_at(builder, q_ptr, builder.mul(d, ir.Constant(i64, w)), f32, w)
            qv = builder.load(at_queries, align=4)
            for j in range(m):
                at = builder.add(_at(builder, first, size, j), d)
                x = _splat(builder, vector, builder.load(builder.gep(rows_ptr, [at])))
                builder.store(builder.call(fma, [qv, x, builder.load(sums[j])]), sums[j])
        for j in range(m):
            where = _vector_at(builder, scores_ptr, builder.add(s_first, ir.Constant(i64, j * w)), f32, w)
            builder.store(builder.load(sums[j]), where, align=4)
        return context.get_dummy_value()

    return types.void(queries, rows, rows_at, n, scores, s_at, keys, width), codegen


@intrinsic
def _tile_add(typingctx, acc, d_at, weights, rows, rows_at, count, n, dims, width):
    """acc[d_at + i, :width] += weights[j, :width] · rows.flat[rows_at + j·n + d_at + i] for the `dims`
    columns i, the rows j < count in order, each fused (acc [n, width] and weights [count…, width]: a
    query's in each lane). The columns' sums stay in registers over all the rows."""
    if not _literals(dims, width):
        return None
    m, w, f32 = dims.literal_value, width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        vector, i64 = ir.VectorType(f32, w), ir.IntType(64)
        acc_ptr, first, w_ptr, rows_ptr, rows_first, count_v, size, *_ = _operands(
            context, builder, signature, args
        )
        columns = [builder.add(first, ir.Constant(i64, i)) for i in range(m)]
        where = [_vector_at(builder, acc_ptr, builder.mul(c, ir.Constant(i64, w)), f32, w) for c in columns]
        sums = [cgutils.alloca_once_value(builder, builder.load(at, align=4)) for at in where]
        fma = _fma(builder, w)
        with cgutils.for_range(builder, count_v) as loop:
            j = loop.index
            at_weights = _vector_at(builder, w_ptr, builder.mul(j, ir.Constant(i64, w)), f32, w)
            weight = builder.load(at_weights, align=4)
            row_at = builder.add(rows_first, builder.mul(j, size))
            for c, total in zip(columns, sums, strict=True):
                x = _splat(builder, vector, builder.load(builder.gep(rows_ptr, [builder.add(row_at, c)])))
                builder.store(builder.call(fma, [weight, x, builder.load(total)]), total)
        for total, at in zip(sums, where, strict=True):
            builder.store(builder.load(total), at, align=4)
        return context.get_dummy_value()

    return types.void(acc, d_at, weights, rows, rows_at, count, n, dims, width), codegen
