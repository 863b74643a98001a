"""The float kernels' building blocks in LLVM's own vector types (numba intrinsics): a register scratch
array, a column of weights dequantized, a fused multiply-add, Q4_K's nibbles and run scales, the block
formats' bit fields, Q3_K's quants and nibbles through a table, Q6_K's bits made int8, a request for
memory ahead. LLVM splits a vector of `width` floats into the target's registers, so no vectorizer has to
find the loops (LLVM's did not, once they were short enough to unroll first); `width` is a literal
wherever these are called (products.py, k_quants.py, block_formats.py). Each has its plain NumPy twin in
vectors_reference.py, which tests/test_vectors.py holds it to.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import PROFILE


@intrinsic
def _registers(typingctx, size):
    """A float32 scratch array of `size` (a literal) on the stack. numba's arrays live on the heap,
    where LLVM keeps partial sums in memory, loaded and stored for every weight; a stack array whose
    every index is known after unrolling becomes registers."""
    if not isinstance(size, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        f32 = context.get_value_type(types.float32)
        return cgutils.alloca_once(builder, f32, size=size.literal_value)

    return types.CPointer(types.float32)(size), codegen


def _vector_at(builder, pointer, index, element, width):
    """A pointer to the vector of `width` elements that starts at pointer[index]."""
    return builder.bitcast(builder.gep(pointer, [index]), ir.VectorType(element, width).as_pointer())


def _data(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array).data


def _casts(context, builder, signature, args, which):
    """The arguments numbered `which` as 64-bit integers (offsets, strides)."""
    return [context.cast(builder, args[k], signature.args[k], types.int64) for k in which]


def _splat(builder, vector_type, value):
    """`value` in every element of a vector of `vector_type`."""
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(i32, 0))
    everywhere = ir.Constant(ir.VectorType(i32, vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined), everywhere)


def _fma(builder, n):
    """llvm.fma on vectors of n floats: a · b + c in one rounding."""
    vector = ir.VectorType(ir.FloatType(), n)
    kind = ir.FunctionType(vector, [vector] * 3)
    return cgutils.get_or_insert_function(builder.module, kind, f"llvm.fma.v{n}f32")


@intrinsic
def _dequantize_column(typingctx, values, scales, offsets, at, scale_at, w, width):
    """w[:width] = values.flat[at:at + width] as float32 (float16 or bfloat16 bits widened, integers
    converted), times scales.flat[scale_at:…] and plus
    offsets.flat[scale_at:…] where the matrix has them (None: numba types the call without them). Plain
    multiply and add, as gguf.quants dequantizes: the weights are exactly the GGUF's."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        arrays = [
            context.make_array(t)(context, builder, a).data if isinstance(t, types.Array) else None
            for t, a in zip(signature.args[:3], args[:3], strict=True)
        ]
        element = context.get_data_type(values.dtype)
        column = builder.load(_vector_at(builder, arrays[0], args[3], element, n), align=1)
        floats = ir.VectorType(f32, n)
        if values.dtype == types.uint16:  # float16 bits (formats.HALF_TYPES): vcvtph2ps
            column = builder.fpext(builder.bitcast(column, ir.VectorType(ir.HalfType(), n)), floats)
        elif values.dtype == types.int16:  # bfloat16 bits: the high half of a float32's
            words = ir.VectorType(ir.IntType(32), n)
            column = builder.shl(builder.zext(column, words), ir.Constant(words, [16] * n))
            column = builder.bitcast(column, floats)
        elif isinstance(values.dtype, types.Integer):
            column = builder.sitofp(column, floats)
        if arrays[1] is not None:
            scales_at = _vector_at(builder, arrays[1], args[4], f32, n)
            column = builder.fmul(column, builder.load(scales_at, align=4))
        if arrays[2] is not None:
            offsets_at = _vector_at(builder, arrays[2], args[4], f32, n)
            column = builder.fadd(column, builder.load(offsets_at, align=4))
        w_at = _vector_at(builder, args[5], ir.Constant(ir.IntType(64), 0), f32, n)
        builder.store(column, w_at, align=4)
        return context.get_dummy_value()

    return types.void(values, scales, offsets, at, scale_at, w, width), codegen


@intrinsic
def _bit_fields(typingctx, values, at, shift, mask, w, width):
    """w[:width] = (values.flat[at:at + width] >> shift) & mask as float32, exact: a field of the bytes
    of `width` lanes (block_formats.py's layout), in 32-bit lanes (numba's own integers are 64-bit,
    half as many a vector)."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        values_ptr = _data(context, builder, signature.args[0], args[0])
        at, shift, mask = (
            context.cast(builder, a, t, types.int64) for a, t in zip(args[1:4], signature.args[1:4])
        )
        words = ir.VectorType(i32, n)
        column = builder.load(_vector_at(builder, values_ptr, at, ir.IntType(8), n), align=1)
        column = builder.zext(column, words)
        column = builder.lshr(column, _splat(builder, words, builder.trunc(shift, i32)))
        column = builder.and_(column, _splat(builder, words, builder.trunc(mask, i32)))
        floats = builder.sitofp(column, ir.VectorType(ir.FloatType(), n))  # (AVX2 has no unsigned conversion)
        builder.store(floats, _vector_at(builder, args[4], ir.Constant(i64, 0), ir.FloatType(), n), align=4)
        return context.get_dummy_value()

    return types.void(values, at, shift, mask, w, width), codegen


@intrinsic
def _q3_k_quants(typingctx, values, low_at, shift, high_at, bit, w, width):
    """w[:width] = Q3_K's signed 3-bit quants of `width` lanes (block_formats.py's layout) as float32,
    exact: the 2 bits at `shift` of the bytes at low_at, less 4 where bit `bit` of the bytes at high_at
    is clear (ggml's hmask), in 32-bit lanes."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        values_ptr = _data(context, builder, signature.args[0], args[0])
        low_at, shift, high_at, bit = (
            context.cast(builder, a, t, types.int64) for a, t in zip(args[1:5], signature.args[1:5])
        )
        words = ir.VectorType(i32, n)

        def field(at, by, mask):
            column = builder.zext(builder.load(_vector_at(builder, values_ptr, at, i8, n), align=1), words)
            column = builder.lshr(column, _splat(builder, words, builder.trunc(by, i32)))
            return builder.and_(column, ir.Constant(words, [mask] * n))

        high = builder.shl(field(high_at, bit, 1), ir.Constant(words, [2] * n))
        q = builder.sub(builder.add(field(low_at, shift, 3), high), ir.Constant(words, [4] * n))
        floats = builder.sitofp(q, ir.VectorType(ir.FloatType(), n))
        builder.store(floats, _vector_at(builder, args[5], ir.Constant(i64, 0), ir.FloatType(), n), align=4)
        return context.get_dummy_value()

    return types.void(values, low_at, shift, high_at, bit, w, width), codegen


@intrinsic
def _table_fields(typingctx, values, at, shift, table, w, width):
    """w[:width] = table[(values.flat[at:at + width] >> shift) & 15]: a nibble of the bytes of `width`
    lanes through a table of 16 floats (the IQ formats' values, MXFP4's e2m1), exact. AVX-512 picks
    16 lanes' floats from a register of the table in one vpermps; AVX2 16 lanes' bytes from the table
    as bytes in one vpshufb (the tables' values are integers of 8 bits), then widens them; elsewhere
    each lane is looked up."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        values_ptr = _data(context, builder, signature.args[0], args[0])
        table_ptr = _data(context, builder, signature.args[3], args[3])
        at, shift = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:3], signature.args[1:3]))
        table = builder.load(_vector_at(builder, table_ptr, ir.Constant(i64, 0), f32, 16), align=4)
        step = 32 if PROFILE.isa == "AVX2" and n % 32 == 0 else min(n, 16)  # (vpshufb: 32 bytes)
        for k in range(0, n, step):
            m = min(n - k, step)
            words, where = ir.VectorType(i32, m), ir.Constant(i64, k)
            start = builder.add(at, where)
            column = builder.load(_vector_at(builder, values_ptr, start, ir.IntType(8), m), align=1)
            if PROFILE.isa == "AVX2" and m in (16, 32):
                picked = _bytes_looked_up(builder, table, column, builder.trunc(shift, ir.IntType(8)))
                builder.store(picked, _vector_at(builder, args[4], where, f32, m), align=4)
                continue
            column = builder.zext(column, words)
            column = builder.lshr(column, _splat(builder, words, builder.trunc(shift, i32)))
            if PROFILE.isa == "AVX-512" and m == 16:  # (the permute reads only the low 4 bits)
                floats = ir.VectorType(f32, 16)
                kind = ir.FunctionType(floats, [floats, words])
                permute = cgutils.get_or_insert_function(builder.module, kind, _PERMUTE_16)
                picked = builder.call(permute, [table, column])
            else:
                column = builder.and_(column, ir.Constant(words, [15] * m))
                picked = ir.Constant(ir.VectorType(f32, m), ir.Undefined)
                for lane in range(m):
                    index = builder.extract_element(column, ir.Constant(i32, lane))
                    picked = builder.insert_element(
                        picked, builder.extract_element(table, index), ir.Constant(i32, lane)
                    )
            builder.store(picked, _vector_at(builder, args[4], where, f32, m), align=4)
        return context.get_dummy_value()

    return types.void(values, at, shift, table, w, width), codegen


def _bytes_looked_up(builder, table, column, shift):
    """table[(column >> shift) & 15] of 16 or 32 bytes as floats: vpshufb looks the bytes up in the
    table as bytes (its values converted, exact: integers of 8 bits; 32 bytes look up in each 16-byte
    half of a copy of it twice over), then they are widened to floats."""
    i8, i32, m = ir.IntType(8), ir.IntType(32), column.type.count
    index_t = ir.VectorType(i8, m)
    small = builder.trunc(builder.fptosi(table, ir.VectorType(i32, 16)), ir.VectorType(i8, 16))
    twice = ir.Constant(ir.VectorType(i32, m), [c % 16 for c in range(m)])
    small = builder.shuffle_vector(small, small, twice)
    shifted = builder.lshr(column, _splat(builder, index_t, shift))
    index = builder.and_(shifted, ir.Constant(index_t, [15] * m))
    kind = ir.FunctionType(index_t, [index_t, index_t])
    name = "llvm.x86.avx2.pshuf.b" if m == 32 else "llvm.x86.ssse3.pshuf.b.128"
    lookup = cgutils.get_or_insert_function(builder.module, kind, name)
    return builder.sitofp(builder.call(lookup, [small, index]), ir.VectorType(ir.FloatType(), m))


@intrinsic
def _multiply_add(typingctx, sums, i, w, xj, width):
    """sums[i·width:(i + 1)·width] += w[:width] · xj, fused (one rounding), on a vector of `width` (a
    literal) floats."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        sums_ptr, i_arg, w_ptr, x, _ = args
        i64 = ir.IntType(64)
        row = context.cast(builder, i_arg, signature.args[1], types.int64)
        at = _vector_at(builder, sums_ptr, builder.mul(row, ir.Constant(i64, n)), f32, n)
        weights = builder.load(_vector_at(builder, w_ptr, ir.Constant(i64, 0), f32, n), align=4)
        _fused_into(builder, at, weights, x)
        return context.get_dummy_value()

    return types.void(sums, i, w, xj, width), codegen


def _fused_into(builder, at, weights, x):
    """*at += weights · x (a vector, a float broadcast), fused: one rounding."""
    n = weights.type.count
    broadcast = _splat(builder, ir.VectorType(ir.FloatType(), n), x)
    total = builder.call(_fma(builder, n), [weights, broadcast, builder.load(at, align=4)])
    builder.store(total, at, align=4)


@intrinsic
def _q4_k_scales(typingctx, halves, six_bits, d_at, sc_at, lanes, scale, offset, width):
    """A Q4_K run's scale and offset for `width` lanes (k_quants.py's layout): scale[:width] = d · sc
    and offset[:width] = -(dmin · m), with d (dmin) the float16 at halves.flat[d_at…] ([d_at + lanes…])
    and sc (m) the 6-bit integer at six_bits.flat[sc_at…] ([sc_at + 8·lanes…]): the products
    gguf.quants forms, in float32, so that every weight is its value bit for bit."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        halves_ptr = _data(context, builder, signature.args[0], args[0])
        bits_ptr = _data(context, builder, signature.args[1], args[1])
        i16, i8, i64 = ir.IntType(16), ir.IntType(8), ir.IntType(64)
        d_at, sc_at, lanes = (
            context.cast(builder, a, t, types.int64) for a, t in zip(args[2:5], signature.args[2:5])
        )
        floats, words = ir.VectorType(f32, n), ir.VectorType(ir.IntType(32), n)

        def half(at):  # float16 bits → float32, exactly (vcvtph2ps)
            bits = builder.load(_vector_at(builder, halves_ptr, at, i16, n), align=2)
            return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)), floats)

        def six(at):  # (sitofp: AVX2 has no unsigned conversion)
            small = builder.load(_vector_at(builder, bits_ptr, at, i8, n), align=1)
            return builder.sitofp(builder.zext(small, words), floats)

        d, dmin = half(d_at), half(builder.add(d_at, lanes))
        sc, m = six(sc_at), six(builder.add(sc_at, builder.mul(lanes, ir.Constant(i64, 8))))
        zero = ir.Constant(i64, 0)
        builder.store(builder.fmul(d, sc), _vector_at(builder, args[5], zero, f32, n), align=4)
        minimum = builder.fneg(builder.fmul(dmin, m))
        builder.store(minimum, _vector_at(builder, args[6], zero, f32, n), align=4)
        return context.get_dummy_value()

    return types.void(halves, six_bits, d_at, sc_at, lanes, scale, offset, width), codegen


@intrinsic
def _nibbles(typingctx, values, at, shift, byte, w, width):
    """w[:width] = the 4-bit values at bit `shift` (0: low nibbles, 4: high ones, a literal) of byte
    `byte` (0-3) of the `width` 32-bit words at values.flat[at…] (k_quants.py's layout), as float32,
    exact. The byte is a variable of a 4-step loop that LLVM unrolls into constant shifts: four call
    sites with literal bytes had numba type the kernel's inlined code four times."""
    if not isinstance(width, types.IntegerLiteral) or not isinstance(shift, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        values_ptr = _data(context, builder, signature.args[0], args[0])
        at = context.cast(builder, args[1], signature.args[1], types.int64)
        _unpack_nibbles(builder, values_ptr, at, _bit(context, builder, signature, args, shift), n, args[4])
        return context.get_dummy_value()

    return types.void(values, at, shift, byte, w, width), codegen


def _bit(context, builder, signature, args, shift):
    """8·byte + shift as a 32-bit value: where a column's nibble starts in its word."""
    i32 = ir.IntType(32)
    byte = builder.trunc(context.cast(builder, args[3], signature.args[3], types.int64), i32)
    return builder.add(builder.mul(byte, ir.Constant(i32, 8)), ir.Constant(i32, shift.literal_value))


# AVX-512's vpermps picks each lane's float from a register of 16 by the low 4 bits of its index and
# ignores the rest: a nibble shifted down becomes its float in one instruction, where masking and
# converting take two (and AVX2's 8-float vpermps cannot hold 16 values).
_PERMUTE_16 = "llvm.x86.avx512.permvar.sf.512"


def _unpack_nibbles(builder, values_ptr, at, bit, n, w_ptr, scale_ptr=None, offset_ptr=None):
    """w[:n] = ((word >> bit) & 15) as float32 (· scale + offset where given) for the n 32-bit words at
    the bytes values[at:at + 4·n], bit an i32 value. Four bytes of a row in one lane: a load and a
    shift take a column out of them, where a byte a lane would first have to be widened (vpmovzxbd, on
    the shuffle unit that the other steps need too)."""
    f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
    words_ptr = builder.bitcast(builder.gep(values_ptr, [at]), i32.as_pointer())
    permute = _PERMUTE_16 if PROFILE.isa == "AVX-512" else None
    for k in range(0, n, min(n, 16)):
        m = min(n - k, 16)
        words = ir.VectorType(i32, m)
        where = ir.Constant(i64, k)
        packed = builder.load(_vector_at(builder, words_ptr, where, i32, m), align=1)
        shifted = builder.lshr(packed, _splat(builder, words, bit))
        if permute and m == 16:
            floats = ir.VectorType(f32, 16)
            table = ir.Constant(floats, [float(v) for v in range(16)])
            kind = ir.FunctionType(floats, [floats, words])
            fn = cgutils.get_or_insert_function(builder.module, kind, permute)
            column = builder.call(fn, [table, shifted])
        else:
            nibbles = builder.and_(shifted, ir.Constant(words, [15] * m))
            column = builder.sitofp(nibbles, ir.VectorType(f32, m))  # (AVX2 has no unsigned conversion)
        if scale_ptr is not None:
            scale = builder.load(_vector_at(builder, scale_ptr, where, f32, m), align=4)
            offset = builder.load(_vector_at(builder, offset_ptr, where, f32, m), align=4)
            column = builder.fadd(builder.fmul(column, scale), offset)
        builder.store(column, _vector_at(builder, w_ptr, where, f32, m), align=4)


@intrinsic
def _scale_run(typingctx, sums, runs, i, scale, offset, x_sum, width):
    """sums[i·width:…] += scale[:width] · runs[i·width:…], then += offset[:width] · x_sum, each fused:
    a Q4_K run's Σ q·x and Σ x into the row's sums, d·sc·Σ q·x − dmin·m·Σ x."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        sums_ptr, runs_ptr, i_arg, scale_ptr, offset_ptr, x_sum, _ = args
        i64, vector = ir.IntType(64), ir.VectorType(f32, n)
        row = context.cast(builder, i_arg, signature.args[2], types.int64)
        start = builder.mul(row, ir.Constant(i64, n))
        zero = ir.Constant(i64, 0)
        at = _vector_at(builder, sums_ptr, start, f32, n)
        fma = _fma(builder, n)
        scale = builder.load(_vector_at(builder, scale_ptr, zero, f32, n), align=4)
        offset = builder.load(_vector_at(builder, offset_ptr, zero, f32, n), align=4)
        run = builder.load(_vector_at(builder, runs_ptr, start, f32, n), align=4)
        total = builder.call(fma, [scale, run, builder.load(at, align=4)])
        total = builder.call(fma, [offset, _splat(builder, vector, x_sum), total])
        builder.store(total, at, align=4)
        return context.get_dummy_value()

    return types.void(sums, runs, i, scale, offset, x_sum, width), codegen


@intrinsic
def _dequantize_nibbles(typingctx, values, at, shift, byte, scale, offset, w, width):
    """w[:width] = _nibbles(…) · scale[:width] + offset[:width]: a column of 4-bit weights, plain
    multiply and add as gguf.quants."""
    if not isinstance(width, types.IntegerLiteral) or not isinstance(shift, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        values_ptr = _data(context, builder, signature.args[0], args[0])
        at = context.cast(builder, args[1], signature.args[1], types.int64)
        bit = _bit(context, builder, signature, args, shift)
        _unpack_nibbles(builder, values_ptr, at, bit, n, args[6], args[4], args[5])
        return context.get_dummy_value()

    return types.void(values, at, shift, byte, scale, offset, w, width), codegen


@intrinsic
def _prefetch(typingctx, values, at, offset):
    """Asks for the cache line the profile's prefetch distance plus `offset` bytes past values.flat[at]
    (llvm.prefetch: a hint, never a fault, wherever it points). The processor's own prefetcher follows
    a stream within a 4 KB page and starts over at the next: a kernel reading weights from memory
    waits there unless it asks ahead (cpu.py, Profile.prefetch_bytes)."""

    def codegen(context, builder, signature, args):
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        at, offset = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], signature.args[1:]))
        element = builder.gep(_data(context, builder, signature.args[0], args[0]), [at])
        ahead = builder.add(offset, ir.Constant(i64, PROFILE.prefetch_bytes))
        ask_for(builder, builder.gep(builder.bitcast(element, i8p), [ahead]))
        return context.get_dummy_value()

    return types.void(values, at, offset), codegen


def ask_for(builder, address):
    """Code that asks for the cache line at `address` into the caches the profile asks into
    (llvm.prefetch, a read of data: a hint, never a fault)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    kind = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch.p0i8")
    read, data = ir.Constant(i32, 0), ir.Constant(i32, 1)
    builder.call(fn, [builder.bitcast(address, i8p), read, ir.Constant(i32, PROFILE.ask_into), data])


@intrinsic
def _q6_k_scales(typingctx, d, sc, d_at, sc_at, scale, width):
    """A Q6_K sub-block's scale for `width` lanes (k_quants.py's layout): scale[:width] = d · sc, d the
    float32 at d.flat[d_at…], sc the int8 at sc.flat[sc_at…]: the product gguf.quants forms, exact."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        d_ptr, sc_ptr = (_data(context, builder, signature.args[k], args[k]) for k in (0, 1))
        d_at, sc_at = (
            context.cast(builder, a, t, types.int64) for a, t in zip(args[2:4], signature.args[2:4])
        )
        floats = ir.VectorType(f32, n)
        d_n = builder.load(_vector_at(builder, d_ptr, d_at, f32, n), align=4)
        small = builder.load(_vector_at(builder, sc_ptr, sc_at, ir.IntType(8), n), align=1)
        product = builder.fmul(d_n, builder.sitofp(small, floats))
        builder.store(product, _vector_at(builder, args[4], ir.Constant(ir.IntType(64), 0), f32, n), align=4)
        return context.get_dummy_value()

    return types.void(d, sc, d_at, sc_at, scale, width), codegen


@intrinsic
def _q6_k_int8_scales(typingctx, d, sc, d_at, sc_at, scales, scales_at, width):
    """A Q6_K block's 16 sub-block scales for `width` lanes as the int8 layout holds them:
    scales.flat[scales_at + s·width…] = d · sc, d the float32 at d.flat[d_at…], sc the int8 at
    sc.flat[sc_at + s·width…] (k_quants.py's layout; _q6_k_scales' product, 16 at a time)."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32, i64 = width.literal_value, ir.FloatType(), ir.IntType(64)

    def codegen(context, builder, signature, args):
        d_ptr, sc_ptr, out = (_data(context, builder, signature.args[k], args[k]) for k in (0, 1, 4))
        d_at, sc_at, out_at = _casts(context, builder, signature, args, (2, 3, 5))
        d_n = builder.load(_vector_at(builder, d_ptr, d_at, f32, n), align=4)
        for s in range(16):
            step = ir.Constant(i64, s * n)
            sc_n = _vector_at(builder, sc_ptr, builder.add(sc_at, step), ir.IntType(8), n)
            small = builder.load(sc_n, align=1)
            product = builder.fmul(d_n, builder.sitofp(small, ir.VectorType(f32, n)))
            builder.store(product, _vector_at(builder, out, builder.add(out_at, step), f32, n), align=4)
        return context.get_dummy_value()

    return types.void(d, sc, d_at, sc_at, scales, scales_at, width), codegen


@intrinsic
def _q6_k_int8_columns(typingctx, values, ql_at, qh_at, out, out_at, width):
    """16 columns of Q6_K weights (k_quants.py's layout) as int8 q − 32 in the int8 layout, from one read
    of the words that hold their bits: columns 32·k + c (k the run of 32 of a half block, c < 4) into
    out.flat[out_at + (32·k + c)·width…], for `width` lanes. q is the 4 bits at bit 4·(k // 2) of byte c
    of the words at values.flat[ql_at…] (k even) or 8·width words on (k odd), and above them the 2 bits
    at bit 2·k of byte c of those at values.flat[qh_at…]. Each word holds 4 columns of its lane: the
    bits are taken apart as bytes, and one shuffle puts each column's lanes side by side."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        src, dst = (_data(context, builder, signature.args[k], args[k]) for k in (0, 3))
        ql_at, qh_at, out_at = _casts(context, builder, signature, args, (1, 2, 4))
        row = ir.VectorType(i8, 4 * n)  # the words of all lanes: lane-major, 4 columns each

        def every(value):
            return ir.Constant(row, [value] * (4 * n))

        def words(at):
            return builder.load(_vector_at(builder, src, at, i8, 4 * n), align=1)

        low = (words(ql_at), words(builder.add(ql_at, ir.Constant(i64, 32 * n))))
        high = words(qh_at)
        lane_major = [4 * lane + c for c in range(4) for lane in range(n)]  # column c's lanes from each word
        by_column = ir.Constant(ir.VectorType(i32, 4 * n), lane_major)
        for k in range(4):
            q = builder.and_(builder.lshr(low[k % 2], every(4 * (k // 2))), every(15))
            above = builder.and_(builder.lshr(high, every(2 * k)), every(3))
            q = builder.sub(builder.or_(q, builder.shl(above, every(4))), every(32))
            q = builder.shuffle_vector(q, ir.Constant(row, ir.Undefined), by_column)
            at = builder.add(out_at, ir.Constant(i64, 32 * k * n))
            builder.store(q, _vector_at(builder, dst, at, i8, 4 * n), align=1)
        return context.get_dummy_value()

    return types.void(values, ql_at, qh_at, out, out_at, width), codegen


@intrinsic
def _q6_k_column(typingctx, values, ql_at, qh_at, byte, k, scale, w, width):
    """w[:width] = (q − 32) · scale[:width] for a column of Q6_K weights (k_quants.py's layout): q the
    4 bits at bit 8·byte + 4·(k // 2) of the `width` 32-bit words at values.flat[ql_at…], and above them
    the 2 bits at bit 8·byte + 2·k of those at values.flat[qh_at…] (k: the run of 32 of a half block);
    one multiply as gguf.quants, so each weight is the GGUF's. byte and k are variables of loops LLVM
    unrolls (as _nibbles' byte)."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n = width.literal_value

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        values_ptr = _data(context, builder, signature.args[0], args[0])
        ql_at, qh_at, byte, k = (
            context.cast(builder, a, t, types.int64) for a, t in zip(args[1:5], signature.args[1:5])
        )
        words, floats = ir.VectorType(i32, n), ir.VectorType(f32, n)
        byte, k = builder.trunc(byte, i32), builder.trunc(k, i32)
        at_byte = builder.mul(byte, ir.Constant(i32, 8))
        low_bit = builder.add(at_byte, builder.mul(builder.lshr(k, ir.Constant(i32, 1)), ir.Constant(i32, 4)))
        high_bit = builder.add(at_byte, builder.mul(k, ir.Constant(i32, 2)))

        def field(at, bit, mask):
            pointer = builder.bitcast(builder.gep(values_ptr, [at]), i32.as_pointer())
            packed = builder.load(_vector_at(builder, pointer, ir.Constant(i64, 0), i32, n), align=1)
            shifted = builder.lshr(packed, _splat(builder, words, bit))
            return builder.and_(shifted, ir.Constant(words, [mask] * n))

        high = builder.shl(field(qh_at, high_bit, 3), ir.Constant(words, [4] * n))
        q = builder.sub(builder.or_(field(ql_at, low_bit, 15), high), ir.Constant(words, [32] * n))
        zero = ir.Constant(i64, 0)
        scale_n = builder.load(_vector_at(builder, args[5], zero, f32, n), align=4)
        column = builder.fmul(builder.sitofp(q, floats), scale_n)
        builder.store(column, _vector_at(builder, args[6], zero, f32, n), align=4)
        return context.get_dummy_value()

    return types.void(values, ql_at, qh_at, byte, k, scale, w, width), codegen
