"""The kernels' building blocks in LLVM's own vector types (numba intrinsics): a register scratch array,
a column of weights dequantized, a fused multiply-add. LLVM splits a vector of `width` floats into the
target's registers, so no vectorizer has to find the loops (LLVM's did not, once they were short
enough to unroll first); `width` is a literal wherever these are called (kernels.py, k_quants.py)."""

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
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=size.literal_value)

    return types.CPointer(types.float32)(size), codegen


def _vector_at(builder, pointer, index, element, width):
    """A pointer to the vector of `width` elements that starts at pointer[index]."""
    return builder.bitcast(builder.gep(pointer, [index]), ir.VectorType(element, width).as_pointer())


@intrinsic
def _dequantize_column(typingctx, values, scales, offsets, at, scale_at, w, width):
    """w[:width] = values.flat[at:at + width] as float32, times scales.flat[scale_at:…] and plus
    offsets.flat[scale_at:…] where the matrix has them (None: numba types the call without them). Plain
    multiply and add, as gguf.quants dequantizes: the weights are exactly the GGUF's. A vector of
    `width` (a literal) floats in LLVM's own vector type, which the target splits into its registers:
    no vectorizer has to find it (LLVM's did not, once the loops were short enough to unroll first)."""
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
        if isinstance(values.dtype, types.Integer):
            column = builder.sitofp(column, ir.VectorType(f32, n))
        if arrays[1] is not None:
            scales_at = _vector_at(builder, arrays[1], args[4], f32, n)
            column = builder.fmul(column, builder.load(scales_at, align=4))
        if arrays[2] is not None:
            offsets_at = _vector_at(builder, arrays[2], args[4], f32, n)
            column = builder.fadd(column, builder.load(offsets_at, align=4))
        builder.store(column, _vector_at(builder, args[5], ir.Constant(ir.IntType(64), 0), f32, n), align=4)
        return context.get_dummy_value()

    return types.void(values, scales, offsets, at, scale_at, w, width), codegen


@intrinsic
def _multiply_add(typingctx, sums, i, w, xj, width):
    """sums[i·width:(i + 1)·width] += w[:width] · xj, fused (one rounding), on a vector of `width` (a
    literal) floats."""
    if not isinstance(width, types.IntegerLiteral):
        return None
    n, f32 = width.literal_value, ir.FloatType()

    def codegen(context, builder, signature, args):
        sums_ptr, i_arg, w_ptr, x, _ = args
        i64, vector = ir.IntType(64), ir.VectorType(f32, n)
        start = builder.mul(context.cast(builder, i_arg, signature.args[1], types.int64), ir.Constant(i64, n))
        at = _vector_at(builder, sums_ptr, start, f32, n)
        weights = builder.load(_vector_at(builder, w_ptr, ir.Constant(i64, 0), f32, n), align=4)
        broadcast = _splat(builder, vector, x)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{n}f32"
        )
        builder.store(builder.call(fma, [weights, broadcast, builder.load(at, align=4)]), at, align=4)
        return context.get_dummy_value()

    return types.void(sums, i, w, xj, width), codegen


def _splat(builder, vector_type, value):
    """`value` in every element of a vector of `vector_type`."""
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(i32, 0))
    everywhere = ir.Constant(ir.VectorType(i32, vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(one, ir.Constant(vector_type, ir.Undefined), everywhere)


def _data(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array).data


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
        d_at, sc_at, lanes = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:5], signature.args[2:5]))
        floats, words = ir.VectorType(f32, n), ir.VectorType(ir.IntType(32), n)

        def half(at):  # float16 bits → float32, exactly (vcvtph2ps)
            bits = builder.load(_vector_at(builder, halves_ptr, at, i16, n), align=2)
            return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)), floats)

        def six(at):  # (sitofp: AVX2 has no unsigned conversion)
            return builder.sitofp(builder.zext(builder.load(_vector_at(builder, bits_ptr, at, i8, n), align=1), words), floats)

        d, dmin = half(d_at), half(builder.add(d_at, lanes))
        sc, m = six(sc_at), six(builder.add(sc_at, builder.mul(lanes, ir.Constant(i64, 8))))
        zero = ir.Constant(i64, 0)
        builder.store(builder.fmul(d, sc), _vector_at(builder, args[5], zero, f32, n), align=4)
        builder.store(builder.fneg(builder.fmul(dmin, m)), _vector_at(builder, args[6], zero, f32, n), align=4)
        return context.get_dummy_value()

    return types.void(halves, six_bits, d_at, sc_at, lanes, scale, offset, width), codegen


@intrinsic
def _nibbles(typingctx, values, at, shift, byte, w, width):
    """w[:width] = the 4-bit values at bit `shift` (0: low nibbles, 4: high ones, a literal) of byte
    `byte` (0-3) of the `width` 32-bit words at values.flat[at…] (k_quants.py's layout), as float32,
    exact. The byte is a variable of a 4-step loop that LLVM unrolls into constant shifts: four call
    sites with literal bytes had numba type the kernel's inlined code four times (12 s of a first
    start where one takes 6)."""
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
    byte = builder.trunc(context.cast(builder, args[3], signature.args[3], types.int64), ir.IntType(32))
    return builder.add(builder.mul(byte, ir.Constant(ir.IntType(32), 8)), ir.Constant(ir.IntType(32), shift.literal_value))


# AVX-512's vpermps picks each lane's float from a register of 16 by the low 4 bits of its index and
# ignores the rest: a nibble shifted down becomes its float in one instruction, where masking and
# converting took two (and AVX2's 8-float vpermps cannot hold 16 values).
_PERMUTE_16 = "llvm.x86.avx512.permvar.sf.512"


def _unpack_nibbles(builder, values_ptr, at, bit, n, w_ptr, scale_ptr=None, offset_ptr=None):
    """w[:n] = ((word >> bit) & 15) as float32 (· scale + offset where given) for the n 32-bit words at
    the bytes values[at:at + 4·n], bit an i32 value. Four bytes of a row in one lane: a load and a shift take a column
    out of them, where a byte a lane first had to be widened (vpmovzxbd, on the shuffle unit that the
    other steps needed too)."""
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
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats, words]), permute)
            column = builder.call(fn, [table, shifted])
        else:
            nibbles = builder.and_(shifted, ir.Constant(words, [15] * m))
            column = builder.sitofp(nibbles, ir.VectorType(f32, m))  # (AVX2 has no unsigned conversion)
        if scale_ptr is not None:
            column = builder.fmul(column, builder.load(_vector_at(builder, scale_ptr, where, f32, m), align=4))
            column = builder.fadd(column, builder.load(_vector_at(builder, offset_ptr, where, f32, m), align=4))
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
        start = builder.mul(context.cast(builder, i_arg, signature.args[2], types.int64), ir.Constant(i64, n))
        zero = ir.Constant(i64, 0)
        at = _vector_at(builder, sums_ptr, start, f32, n)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{n}f32"
        )
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


# How far ahead of a kernel's reading its weights are asked for (_prefetch). The processor's own
# prefetcher follows a stream within a 4 KB page and starts over at the next one: a 7B's decode, its
# weights from memory, waited there (Q4_K ffn_gate_up 5.9 ms a call, 13 GB/s; asked ahead, 3.8 ms).
AHEAD = 2048


@intrinsic
def _prefetch(typingctx, values, at, offset):
    """Asks for the cache line AHEAD + `offset` bytes past values.flat[at] (llvm.prefetch: a hint,
    never a fault, wherever it points)."""

    def codegen(context, builder, signature, args):
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        at, offset = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], signature.args[1:]))
        element = builder.gep(_data(context, builder, signature.args[0], args[0]), [at])
        line = builder.gep(builder.bitcast(element, i8p), [builder.add(offset, ir.Constant(i64, AHEAD))])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
        builder.call(fn, [line, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data
        return context.get_dummy_value()

    return types.void(values, at, offset), codegen


@intrinsic
def _nibble_dots(typingctx, values, at, lanes, shift, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, runs, rows, width):
    """A Q4_K run's Σ q·x̂ for `rows` rows of 8-bit activations (kernels.quantize_rows): runs[i·width:…]
    = (Σ_c Σ_b q[c, b] · xq[i, c, b]) · x_scale[i], q the 4-bit values at bit `shift` of the 8 words
    values.flat[at + 4·lanes·c…] (k_quants.py's layout: 4 columns of a row to a word) and xq[i, c] the
    32-bit word xq.flat[xq_at + i·xq_stride + c] of the row's 4 activation bytes for those columns,
    x_scale[i] = x_scales.flat[xs_at + i·xs_stride]. The sums are integers (at most 32·15·127), exact on
    every machine, so a row's result depends on neither its batch nor the instructions (cpu.byte_dot)."""
    literals = (shift, rows, width)
    if not all(isinstance(t, types.IntegerLiteral) for t in literals):
        return None
    bit, n_rows, n = (t.literal_value for t in literals)
    how = PROFILE.byte_dot
    chunk = min(n, 16 if how in ("vnni", "bw") else 8)  # 32-bit lanes to a register

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        words_t = ir.VectorType(i32, chunk)
        values_ptr = _data(context, builder, signature.args[0], args[0])
        xq_ptr = _data(context, builder, signature.args[4], args[4])
        xs_ptr = _data(context, builder, signature.args[7], args[7])
        at, lanes, xq_at, xq_stride, xs_at, xs_stride = (
            context.cast(builder, args[k], signature.args[k], types.int64) for k in (1, 2, 5, 6, 8, 9)
        )
        words_ptr = builder.bitcast(builder.gep(values_ptr, [at]), i32.as_pointer())
        low_nibbles = ir.Constant(words_t, [0x0F0F0F0F] * chunk)
        sums = [[ir.Constant(words_t, [0] * chunk) for _ in range(n // chunk)] for _ in range(n_rows)]
        for c in range(8):
            xs = []
            for i in range(n_rows):
                where = builder.add(xq_at, builder.add(builder.mul(xq_stride, ir.Constant(i64, i)), ir.Constant(i64, c)))
                xs.append(_splat(builder, words_t, builder.load(builder.gep(xq_ptr, [where]), align=4)))
            first = builder.mul(lanes, ir.Constant(i64, c))
            for k in range(n // chunk):
                word = builder.load(_vector_at(builder, words_ptr, builder.add(first, ir.Constant(i64, k * chunk)), i32, chunk), align=1)
                q = builder.and_(builder.lshr(word, _splat(builder, words_t, ir.Constant(i32, bit))), low_nibbles)
                for i in range(n_rows):
                    if how in ("bw", "avx2"):  # 16-bit pairs added up over the run: ≤ 8·2·15·127, no saturation
                        sums[i][k] = builder.add(sums[i][k], _byte_pairs(builder, how, q, xs[i])) if c else _byte_pairs(builder, how, q, xs[i])
                    else:
                        sums[i][k] = _byte_dot(builder, how, sums[i][k], q, xs[i])
        if how in ("bw", "avx2"):
            sums = [[_pairs_to_words(builder, how, pairs) for pairs in row] for row in sums]
        for i in range(n_rows):
            where = builder.add(xs_at, builder.mul(xs_stride, ir.Constant(i64, i)))
            scale = _splat(builder, ir.VectorType(f32, chunk), builder.load(builder.gep(xs_ptr, [where]), align=4))
            for k in range(n // chunk):
                run = builder.fmul(builder.sitofp(sums[i][k], ir.VectorType(f32, chunk)), scale)
                builder.store(run, _vector_at(builder, args[10], ir.Constant(i64, i * n + k * chunk), f32, chunk), align=4)
        return context.get_dummy_value()

    return types.void(values, at, lanes, shift, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, runs, rows, width), codegen


_PAIRS = {  # (bytes → 16-bit sums of pairs, 16-bit pairs → 32-bit sums) by cpu.byte_dot
    "bw": ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
    "avx2": ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
}


def _call(builder, name, result, *operands):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [o.type for o in operands]), name)
    return builder.call(fn, list(operands))


def _byte_pairs(builder, how, unsigned, signed):
    """The 16-bit sums of the products of neighbouring bytes of `unsigned` and `signed` (32-bit words),
    vpmaddubsw (saturating: callers keep them small)."""
    n = unsigned.type.count
    bytes_t = ir.VectorType(ir.IntType(8), 4 * n)
    halves_t = ir.VectorType(ir.IntType(16), 2 * n)
    return _call(builder, _PAIRS[how][0], halves_t, builder.bitcast(unsigned, bytes_t), builder.bitcast(signed, bytes_t))


def _pairs_to_words(builder, how, pairs):
    """16-bit sums → 32-bit sums of their neighbours (vpmaddwd by ones)."""
    words_t = ir.VectorType(ir.IntType(32), pairs.type.count // 2)
    return _call(builder, _PAIRS[how][1], words_t, pairs, ir.Constant(pairs.type, [1] * pairs.type.count))


def _byte_dot(builder, how, total, unsigned, signed):
    """total + the sums of the four products of bytes in each 32-bit lane of `unsigned` (0-255) and
    `signed` (-128-127), exactly (nibbles and activations of at most 127 in size: no 16-bit step
    saturates)."""
    words_t = total.type
    n = words_t.count
    i32 = ir.IntType(32)
    if how == "vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", words_t, total, unsigned, signed)
    if how in ("bw", "avx2"):
        return builder.add(total, _pairs_to_words(builder, how, _byte_pairs(builder, how, unsigned, signed)))
    for b in range(4):  # generic: byte b of each lane, zero- and sign-extended, multiplied and added
        u = builder.and_(builder.lshr(unsigned, _splat(builder, words_t, ir.Constant(i32, 8 * b))), ir.Constant(words_t, [255] * n))
        s = builder.ashr(builder.shl(signed, _splat(builder, words_t, ir.Constant(i32, 24 - 8 * b))), _splat(builder, words_t, ir.Constant(i32, 24)))
        total = builder.add(total, builder.mul(u, s))
    return total


def transposed_lanes(n: int) -> list[int]:
    """The lanes, in order, of the 32-bit words _byte_column_dots makes from four columns of n bytes: the
    processor's unpack instructions interleave within 16-byte blocks, so word 4·q + m of the k-th
    quarter holds lane 16·q + 4·k + m (in order where a column is not whole blocks)."""
    if n % 16:
        return list(range(n))
    return [16 * q + 4 * k + m for k in range(4) for q in range(n // 16) for m in range(4)]


def _interleave(builder, a, b, unit, high):
    """The processor's unpack: the low (high) halves of each 16-byte block of a and b, interleaved in
    units of `unit` bits."""
    t = ir.VectorType(ir.IntType(unit), a.type.count * 8 // unit)
    a, b = builder.bitcast(a, t), builder.bitcast(b, t)
    per_block = 128 // unit
    half = per_block // 2
    mask = [
        index
        for block in range(t.count // per_block)
        for i in range(half * high, half * (high + 1))
        for index in (block * per_block + i, t.count + block * per_block + i)
    ]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


def _side_by_side(builder, columns, n):
    """Four columns of n bytes (one a lane) → n 32-bit words, each the four bytes of a lane, the lanes in
    transposed_lanes(n)'s order."""
    i32 = ir.IntType(32)
    if n % 16:  # one shuffle, lanes in order
        def joined(a, b):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 2 * n), list(range(2 * n))))
        order = [t * n + lane for lane in range(n) for t in range(4)]
        both = builder.shuffle_vector(joined(*columns[:2]), joined(*columns[2:]), ir.Constant(ir.VectorType(i32, 4 * n), order))
        return builder.bitcast(both, ir.VectorType(i32, n))
    pairs = [_interleave(builder, columns[0], columns[1], 8, h) for h in (0, 1)]
    pairs += [_interleave(builder, columns[2], columns[3], 8, h) for h in (0, 1)]
    quarters = [_interleave(builder, pairs[j], pairs[j + 2], 16, h) for j in (0, 1) for h in (0, 1)]
    quarters = [builder.bitcast(q, ir.VectorType(i32, n // 4)) for q in quarters]
    halves = [builder.shuffle_vector(quarters[j], quarters[j + 1], ir.Constant(ir.VectorType(i32, n // 2), list(range(n // 2)))) for j in (0, 2)]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(i32, n), list(range(n))))


def _slice(builder, vector, start, count):
    i32 = ir.IntType(32)
    if start == 0 and count == vector.type.count:
        return vector
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), ir.Constant(ir.VectorType(i32, count), list(range(start, start + count))))


@intrinsic
def _byte_column_dots(typingctx, values, at, lanes, size, xq, xq_at, xq_stride, x_runs, xr_at, xr_stride, scales, offsets, scale_at, sums, rows, width):
    """A block's share of a pass over int8 weights in columns (quants.py's layout: values.flat[at + j·lanes
    + lane] the weight of column j, lane `lane`) for inputs as bytes: for i < rows, with acc the integer
    Σ_j w[j]·xq[i, j] over the block's `size` (a literal, ≤ 32) columns from `at`, sums[i·width:…] +=
    scale · (acc · x_scale[i]), then += offset · Σ x[i] (fused, as _scale_run), scale and offset the
    block's at scales.flat[scale_at…] and offsets.flat[…] (None: none). xq[i] the 32-bit words of the
    row's bytes from xq.flat[xq_at + i·xq_stride], x_runs.flat[xr_at + i·xr_stride…] its run's Σ x and
    bytes' scale. Four columns of a lane are put side by side in a word in registers (the processor's
    unpacks), so the sums run over the lanes in transposed_lanes' order (in_lane_order puts them back).
    The integer sums are exact on every machine."""
    literals = (size, rows, width)
    if not all(isinstance(t, types.IntegerLiteral) for t in literals):
        return None
    n_cols, n_rows, n = (t.literal_value for t in literals)
    how = PROFILE.byte_dot
    chunk = min(n, 16 if how in ("vnni", "bw") else 8)
    order = transposed_lanes(n)
    has_offsets = not isinstance(offsets, (types.NoneType, types.Omitted))

    def codegen(context, builder, signature, args):
        i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
        words_t, bytes_t, floats_t = ir.VectorType(i32, chunk), ir.VectorType(i8, 4 * chunk), ir.VectorType(f32, chunk)
        values_ptr, xq_ptr, xr_ptr, scales_ptr = (_data(context, builder, signature.args[k], args[k]) for k in (0, 4, 7, 10))
        at, lanes, xq_at, xq_stride, xr_at, xr_stride, scale_at = (
            context.cast(builder, args[k], signature.args[k], types.int64) for k in (1, 2, 5, 6, 8, 9, 12)
        )
        acc = [[ir.Constant(words_t, [0] * chunk) for _ in range(n // chunk)] for _ in range(n_rows)]
        bias = [ir.Constant(words_t, [0] * chunk) for _ in range(n // chunk)]  # 128 · Σ w (vnni)
        flip = ir.Constant(i32, 0x80808080 - (1 << 32))
        for c in range(n_cols // 4):
            xs = []
            for i in range(n_rows):
                where = builder.add(xq_at, builder.add(builder.mul(xq_stride, ir.Constant(i64, i)), ir.Constant(i64, c)))
                word = builder.load(builder.gep(xq_ptr, [where]), align=4)
                xs.append(_splat(builder, words_t, builder.xor(word, flip) if how == "vnni" else word))
            columns = []
            for t in range(4):
                where = builder.add(at, builder.mul(lanes, ir.Constant(i64, 4 * c + t)))
                columns.append(builder.load(_vector_at(builder, values_ptr, where, i8, n), align=1))
            words = _side_by_side(builder, columns, n)
            for k in range(n // chunk):
                w = _slice(builder, words, k * chunk, chunk)
                if how == "vnni":  # Σ (x + 128)·w, less 128·Σ w: x unsigned, as vpdpbusd wants one side
                    bias[k] = _byte_dot(builder, how, bias[k], ir.Constant(words_t, [0x80808080 - (1 << 32)] * chunk), w)
                    for i in range(n_rows):
                        acc[i][k] = _byte_dot(builder, how, acc[i][k], xs[i], w)
                    continue
                # |w| unsigned times x with w's sign: no 16-bit step saturates (|x| ≤ 127)
                w_bytes = builder.bitcast(w, bytes_t)
                negative = builder.icmp_signed("<", w_bytes, ir.Constant(bytes_t, [0] * (4 * chunk)))
                size_w = builder.bitcast(builder.select(negative, builder.neg(w_bytes), w_bytes), words_t)
                for i in range(n_rows):
                    x = builder.bitcast(xs[i], bytes_t)
                    if how == "avx2" and chunk == 8:  # vpsignb: x negated where w < 0 (and 0 where w is: |w| is too)
                        signed = builder.bitcast(_call(builder, "llvm.x86.avx2.psign.b", bytes_t, x, w_bytes), words_t)
                    else:
                        signed = builder.bitcast(builder.select(negative, builder.neg(x), x), words_t)
                    acc[i][k] = _byte_dot(builder, how, acc[i][k], size_w, signed)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats_t, [floats_t] * 3), f"llvm.fma.v{chunk}f32")
        mask = ir.Constant(ir.VectorType(i32, n), order)

        def in_order(ptr):  # the block's n scales (offsets), in the sums' lane order, by chunk
            natural = builder.load(_vector_at(builder, ptr, scale_at, f32, n), align=4)
            permuted = builder.shuffle_vector(natural, ir.Constant(natural.type, ir.Undefined), mask)
            return [_slice(builder, permuted, k * chunk, chunk) for k in range(n // chunk)]

        scale = in_order(scales_ptr)
        offset = in_order(_data(context, builder, signature.args[11], args[11])) if has_offsets else None
        for i in range(n_rows):
            run_at = builder.add(xr_at, builder.mul(xr_stride, ir.Constant(i64, i)))
            x_sum = builder.load(builder.gep(xr_ptr, [run_at]), align=4)
            x_scale = _splat(builder, floats_t, builder.load(builder.gep(xr_ptr, [builder.add(run_at, ir.Constant(i64, 1))]), align=4))
            for k in range(n // chunk):
                total = builder.sub(acc[i][k], bias[k]) if how == "vnni" else acc[i][k]
                run = builder.fmul(builder.sitofp(total, floats_t), x_scale)
                at_sums = _vector_at(builder, args[13], ir.Constant(i64, i * n + k * chunk), f32, chunk)
                s = builder.call(fma, [scale[k], run, builder.load(at_sums, align=4)])
                if offset is not None:
                    s = builder.call(fma, [offset[k], _splat(builder, floats_t, x_sum), s])
                builder.store(s, at_sums, align=4)
        return context.get_dummy_value()

    sig_args = (values, at, lanes, size, xq, xq_at, xq_stride, x_runs, xr_at, xr_stride, scales, offsets, scale_at, sums, rows, width)
    return types.void(*sig_args), codegen


@intrinsic
def in_lane_order(typingctx, sums, rows, width):
    """sums [rows, width] from transposed_lanes(width)'s order back to the lanes' own."""
    literals = (rows, width)
    if not all(isinstance(t, types.IntegerLiteral) for t in literals):
        return None
    n_rows, n = (t.literal_value for t in literals)
    order = transposed_lanes(n)
    back = [order.index(lane) for lane in range(n)]

    def codegen(context, builder, signature, args):
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        for i in range(n_rows):
            at = _vector_at(builder, args[0], ir.Constant(i64, i * n), f32, n)
            row = builder.load(at, align=4)
            builder.store(builder.shuffle_vector(row, ir.Constant(row.type, ir.Undefined), ir.Constant(ir.VectorType(i32, n), back)), at, align=4)
        return context.get_dummy_value()

    return types.void(sums, rows, width), codegen
