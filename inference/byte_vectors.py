"""The byte kernels' building blocks (numba intrinsics in LLVM's vector types): products of 8-bit inputs
(activations.quantize_rows) with 4-bit Q4_K weights or int8 weights, four products of bytes added into
each 32-bit lane of an instruction, as llama.cpp multiplies. How the bytes meet is the profile's
(cpu.byte_dot): AVX-512 VNNI's vpdpbusd, vpmaddubsw and vpmaddwd on AVX-512 BW or AVX2, else shifts and
multiplies. The integer sums are exact on every machine, so a row's result depends on neither its batch
nor the instructions. Each has its plain NumPy twin in vectors_reference.py (tests/test_vectors.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import PROFILE
from .vectors import _casts, _data, _fma, _splat, _vector_at, ask_for


def _chunk(n: int) -> int:
    """32-bit lanes to a register for the profile's byte instructions."""
    return min(n, 16 if PROFILE.byte_dot in ("vnni", "bw") else 8)


def _literal_values(*arguments) -> list[int] | None:
    """The values of literal integer arguments, or None where one is not a literal (numba then types the
    call with literals)."""
    if not all(isinstance(t, types.IntegerLiteral) for t in arguments):
        return None
    return [t.literal_value for t in arguments]


def _word_at(builder, pointer, first, stride, i, c):
    """pointer[first + i·stride + c]: row i's word c."""
    i64 = ir.IntType(64)
    where = builder.add(first, builder.add(builder.mul(stride, ir.Constant(i64, i)), ir.Constant(i64, c)))
    return builder.load(builder.gep(pointer, [where]), align=4)


@intrinsic
def _nibble_dots(
    typingctx, values, at, lanes, shift, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, runs, rows, width
):
    """A Q4_K run's Σ q·x̂ for `rows` rows of 8-bit activations: runs[i·width:…] = (Σ_c Σ_b q[c, b] ·
    xq[i, c, b]) · x_scale[i], q the 4-bit values at bit `shift` of the 8 words values.flat[at +
    4·lanes·c…] (k_quants.py's layout: 4 columns of a row to a word) and xq[i, c] the 32-bit word
    xq.flat[xq_at + i·xq_stride + c] of the row's 4 activation bytes for those columns, x_scale[i] =
    x_scales.flat[xs_at + i·xs_stride]. The sums are integers (at most 32·15·127)."""
    if (literals := _literal_values(shift, rows, width)) is None:
        return None
    bit, n_rows, n = literals

    def codegen(context, builder, signature, args):
        pointers = [_data(context, builder, signature.args[k], args[k]) for k in (0, 4, 7)]
        offsets = _casts(context, builder, signature, args, (1, 2, 5, 6, 8, 9))
        _nibble_runs(builder, pointers, offsets, [(bit, args[10])], n_rows, n)
        return context.get_dummy_value()

    sig_args = (values, at, lanes, shift, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, runs, rows, width)
    return types.void(*sig_args), codegen


@intrinsic
def _nibble_pair_dots(
    typingctx, values, at, lanes, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, low, high, rows, width
):
    """_nibble_dots of a pair of runs from one read of their bytes: the run in the low nibbles into
    `low`, the next run (its activations the next 8 words, its scale at xs_at + 2) in the high ones
    into `high`. Twice the sums in registers: for one row (k_quants.accumulate_q8)."""
    if (literals := _literal_values(rows, width)) is None:
        return None
    n_rows, n = literals

    def codegen(context, builder, signature, args):
        pointers = [_data(context, builder, signature.args[k], args[k]) for k in (0, 3, 6)]
        offsets = _casts(context, builder, signature, args, (1, 2, 4, 5, 7, 8))
        _nibble_runs(builder, pointers, offsets, [(0, args[9]), (4, args[10])], n_rows, n)
        return context.get_dummy_value()

    sig_args = (values, at, lanes, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, low, high, rows, width)
    return types.void(*sig_args), codegen


def _nibble_runs(builder, pointers, offsets, runs, n_rows, n):
    """The code of _nibble_dots for consecutive runs read from the same words: runs of (bit, out), the
    k-th with its activations 8·k words and its scale 2·k further on (quantize_rows' x_runs holds
    each run's Σ x beside its scale)."""
    how, chunk = PROFILE.byte_dot, _chunk(n)
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    words_t, floats_t = ir.VectorType(i32, chunk), ir.VectorType(f32, chunk)
    values_ptr, xq_ptr, xs_ptr = pointers
    at, lanes, xq_at, xq_stride, xs_at, xs_stride = offsets
    words_ptr = builder.bitcast(builder.gep(values_ptr, [at]), i32.as_pointer())
    low_nibbles = ir.Constant(words_t, [0x0F0F0F0F] * chunk)
    shifts = [_splat(builder, words_t, ir.Constant(i32, bit)) for bit, _ in runs]
    zeros = ir.Constant(words_t, [0] * chunk)
    sums = [[[zeros] * (n // chunk) for _ in range(n_rows)] for _ in runs]

    def activations(i, word):  # row i's activation bytes of a word of 4 columns, in every lane
        return _splat(builder, words_t, _word_at(builder, xq_ptr, xq_at, xq_stride, i, word))

    for c in range(8):
        xs = [[activations(i, 8 * k + c) for i in range(n_rows)] for k in range(len(runs))]
        first = builder.mul(lanes, ir.Constant(i64, c))
        for j in range(n // chunk):
            where = builder.add(first, ir.Constant(i64, j * chunk))
            word = builder.load(_vector_at(builder, words_ptr, where, i32, chunk), align=1)
            for k in range(len(runs)):
                q = builder.and_(builder.lshr(word, shifts[k]), low_nibbles)
                for i in range(n_rows):
                    if how in ("bw", "avx2"):  # 16-bit pairs added over the run: ≤ 8·2·15·127, no saturation
                        pairs = _byte_pairs(builder, how, q, xs[k][i])
                        sums[k][i][j] = builder.add(sums[k][i][j], pairs) if c else pairs
                    else:
                        sums[k][i][j] = _byte_dot(builder, how, sums[k][i][j], q, xs[k][i])
    for k, (_, out) in enumerate(runs):
        run_sums = sums[k]
        if how in ("bw", "avx2"):
            run_sums = [[_pairs_to_words(builder, how, pairs) for pairs in row] for row in run_sums]
        for i in range(n_rows):
            where = builder.add(xs_at, builder.mul(xs_stride, ir.Constant(i64, i)))
            scale_at = builder.gep(xs_ptr, [builder.add(where, ir.Constant(i64, 2 * k))])
            scale = _splat(builder, floats_t, builder.load(scale_at, align=4))
            for j in range(n // chunk):
                run = builder.fmul(builder.sitofp(run_sums[i][j], floats_t), scale)
                run_at = _vector_at(builder, out, ir.Constant(i64, i * n + j * chunk), f32, chunk)
                builder.store(run, run_at, align=4)


_PAIRS = {  # (bytes → 16-bit sums of pairs, 16-bit pairs → 32-bit sums) by cpu.byte_dot
    "bw": ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
    "avx2": ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
}


def _call(builder, name, result, *operands):
    kind = ir.FunctionType(result, [o.type for o in operands])
    return builder.call(cgutils.get_or_insert_function(builder.module, kind, name), list(operands))


def _byte_pairs(builder, how, unsigned, signed):
    """The 16-bit sums of the products of neighbouring bytes of `unsigned` and `signed` (32-bit words),
    vpmaddubsw (saturating: callers keep them small)."""
    n = unsigned.type.count
    bytes_t = ir.VectorType(ir.IntType(8), 4 * n)
    halves_t = ir.VectorType(ir.IntType(16), 2 * n)
    unsigned, signed = builder.bitcast(unsigned, bytes_t), builder.bitcast(signed, bytes_t)
    return _call(builder, _PAIRS[how][0], halves_t, unsigned, signed)


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
        shifted = builder.lshr(unsigned, _splat(builder, words_t, ir.Constant(i32, 8 * b)))
        u = builder.and_(shifted, ir.Constant(words_t, [255] * n))
        high = builder.shl(signed, _splat(builder, words_t, ir.Constant(i32, 24 - 8 * b)))
        s = builder.ashr(high, _splat(builder, words_t, ir.Constant(i32, 24)))
        total = builder.add(total, builder.mul(u, s))
    return total


def transposed_lanes(n: int) -> list[int]:
    """The lanes, in order, of the 32-bit words _byte_column_dots makes from four columns of n bytes: the
    processor's unpack instructions interleave within 16-byte blocks, so word 4·q + m of the k-th
    quarter holds lane 16·q + 4·k + m (in order where a column is not whole blocks)."""
    if n % 16:
        return list(range(n))
    return [16 * q + 4 * k + m for k in range(4) for q in range(n // 16) for m in range(4)]


def _shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


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
    return _shuffle(builder, a, b, mask)


def _side_by_side(builder, columns, n):
    """Four columns of n bytes (one a lane) → n 32-bit words, each the four bytes of a lane, the lanes in
    transposed_lanes(n)'s order."""
    i32 = ir.IntType(32)
    if n % 16:  # one shuffle, lanes in order
        order = [t * n + lane for lane in range(n) for t in range(4)]
        first, second = (_shuffle(builder, a, b, list(range(2 * n))) for a, b in (columns[:2], columns[2:]))
        return builder.bitcast(_shuffle(builder, first, second, order), ir.VectorType(i32, n))
    pairs = [_interleave(builder, columns[0], columns[1], 8, h) for h in (0, 1)]
    pairs += [_interleave(builder, columns[2], columns[3], 8, h) for h in (0, 1)]
    quarters = [_interleave(builder, pairs[j], pairs[j + 2], 16, h) for j in (0, 1) for h in (0, 1)]
    quarters = [builder.bitcast(q, ir.VectorType(i32, n // 4)) for q in quarters]
    halves = [_shuffle(builder, quarters[j], quarters[j + 1], list(range(n // 2))) for j in (0, 2)]
    return _shuffle(builder, halves[0], halves[1], list(range(n)))


def _slice(builder, vector, start, count):
    if start == 0 and count == vector.type.count:
        return vector
    undefined = ir.Constant(vector.type, ir.Undefined)
    return _shuffle(builder, vector, undefined, list(range(start, start + count)))


@intrinsic
def _byte_column_dots(
    typingctx, values, at, lanes, size, xq, xq_at, xq_stride, x_runs, xr_at, xr_stride,
    scales, offsets, scale_at, sums, rows, width, paired,
):
    """A block's share of a pass over int8 weights in columns (quants.py's layout: values.flat[at +
    j·lanes + lane] the weight of column j, lane `lane`) for inputs as bytes: for i < rows, with acc the
    integer Σ_j w[j]·xq[i, j] over the block's `size` (a literal, ≤ 32) columns from `at`,
    sums[i·width:…] += scale · (acc · x_scale[i]), then += offset · Σ x[i] (fused, as _scale_run),
    scale and offset the block's at scales.flat[scale_at…] and offsets.flat[…] (None: none). xq[i] the
    32-bit words of the row's bytes from xq.flat[xq_at + i·xq_stride], x_runs.flat[xr_at +
    i·xr_stride…] its run's Σ x and bytes' scale. Four columns of a lane are put side by side in a word
    in registers (the processor's unpacks), so the sums run over the lanes in transposed_lanes' order
    (in_lane_order puts them back). `paired` (a literal): the weights are within ±32, so that where
    bytes meet in 16-bit sums of pairs (vpmaddubsw) four words' sums add up before they are widened to
    32 bits (4 · 2 · 32 · 127 = 32,512: no saturation), one vpmaddwd for four."""
    literals = _literal_values(size, rows, width)
    if literals is None or not isinstance(paired, types.BooleanLiteral):
        return None
    n_cols, n_rows, n = literals
    how, chunk = PROFILE.byte_dot, _chunk(n)
    words_a_sum = 4 if paired.literal_value and how in ("bw", "avx2") else 1  # words whose pairs add up
    order = transposed_lanes(n)
    has_offsets = not isinstance(offsets, (types.NoneType, types.Omitted))

    def codegen(context, builder, signature, args):
        i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
        words_t, bytes_t = ir.VectorType(i32, chunk), ir.VectorType(i8, 4 * chunk)
        floats_t = ir.VectorType(f32, chunk)
        values_ptr, xq_ptr, xr_ptr, scales_ptr = (
            _data(context, builder, signature.args[k], args[k]) for k in (0, 4, 7, 10)
        )
        at, lanes, xq_at, xq_stride, xr_at, xr_stride, scale_at = _casts(
            context, builder, signature, args, (1, 2, 5, 6, 8, 9, 12)
        )
        acc = [[ir.Constant(words_t, [0] * chunk) for _ in range(n // chunk)] for _ in range(n_rows)]
        pairs = [[None] * (n // chunk) for _ in range(n_rows)]  # 16-bit sums not yet widened (paired)
        bias = [ir.Constant(words_t, [0] * chunk) for _ in range(n // chunk)]  # 128 · Σ w (vnni)
        flip = ir.Constant(i32, 0x80808080 - (1 << 32))
        for c in range(n_cols // 4):
            xs = []
            for i in range(n_rows):
                word = _word_at(builder, xq_ptr, xq_at, xq_stride, i, c)
                xs.append(_splat(builder, words_t, builder.xor(word, flip) if how == "vnni" else word))
            columns = []
            for t in range(4):
                where = builder.add(at, builder.mul(lanes, ir.Constant(i64, 4 * c + t)))
                columns.append(builder.load(_vector_at(builder, values_ptr, where, i8, n), align=1))
            words = _side_by_side(builder, columns, n)
            for k in range(n // chunk):
                w = _slice(builder, words, k * chunk, chunk)
                if how == "vnni":  # Σ (x + 128)·w, less 128·Σ w: x unsigned, as vpdpbusd wants one side
                    flips = ir.Constant(words_t, [0x80808080 - (1 << 32)] * chunk)
                    bias[k] = _byte_dot(builder, how, bias[k], flips, w)
                    for i in range(n_rows):
                        acc[i][k] = _byte_dot(builder, how, acc[i][k], xs[i], w)
                    continue
                # |w| unsigned times x with w's sign: no 16-bit step saturates (|x| ≤ 127)
                w_bytes = builder.bitcast(w, bytes_t)
                negative = builder.icmp_signed("<", w_bytes, ir.Constant(bytes_t, [0] * (4 * chunk)))
                size_w = builder.bitcast(builder.select(negative, builder.neg(w_bytes), w_bytes), words_t)
                for i in range(n_rows):
                    x = builder.bitcast(xs[i], bytes_t)
                    if how == "avx2" and chunk == 8:  # vpsignb: x negated where w < 0 (and 0 where w is)
                        signed = _call(builder, "llvm.x86.avx2.psign.b", bytes_t, x, w_bytes)
                    else:
                        signed = builder.select(negative, builder.neg(x), x)
                    signed = builder.bitcast(signed, words_t)
                    if words_a_sum == 1:
                        acc[i][k] = _byte_dot(builder, how, acc[i][k], size_w, signed)
                        continue
                    these = _byte_pairs(builder, how, size_w, signed)
                    pairs[i][k] = these if c % words_a_sum == 0 else builder.add(pairs[i][k], these)
                    if c % words_a_sum == words_a_sum - 1:
                        acc[i][k] = builder.add(acc[i][k], _pairs_to_words(builder, how, pairs[i][k]))
        fma = _fma(builder, chunk)

        def in_order(ptr):  # the block's n scales (offsets), in the sums' lane order, by chunk
            natural = builder.load(_vector_at(builder, ptr, scale_at, f32, n), align=4)
            permuted = _shuffle(builder, natural, ir.Constant(natural.type, ir.Undefined), order)
            return [_slice(builder, permuted, k * chunk, chunk) for k in range(n // chunk)]

        scale = in_order(scales_ptr)
        offset = in_order(_data(context, builder, signature.args[11], args[11])) if has_offsets else None
        for i in range(n_rows):
            run_at = builder.add(xr_at, builder.mul(xr_stride, ir.Constant(i64, i)))
            x_sum = builder.load(builder.gep(xr_ptr, [run_at]), align=4)
            x_scale_at = builder.gep(xr_ptr, [builder.add(run_at, ir.Constant(i64, 1))])
            x_scale = _splat(builder, floats_t, builder.load(x_scale_at, align=4))
            for k in range(n // chunk):
                total = builder.sub(acc[i][k], bias[k]) if how == "vnni" else acc[i][k]
                run = builder.fmul(builder.sitofp(total, floats_t), x_scale)
                at_sums = _vector_at(builder, args[13], ir.Constant(i64, i * n + k * chunk), f32, chunk)
                s = builder.call(fma, [scale[k], run, builder.load(at_sums, align=4)])
                if offset is not None:
                    s = builder.call(fma, [offset[k], _splat(builder, floats_t, x_sum), s])
                builder.store(s, at_sums, align=4)
        return context.get_dummy_value()

    sig_args = (
        values, at, lanes, size, xq, xq_at, xq_stride, x_runs, xr_at, xr_stride,
        scales, offsets, scale_at, sums, rows, width, paired,
    )
    return types.void(*sig_args), codegen


@intrinsic
def in_lane_order(typingctx, sums, rows, width):
    """sums [rows, width] from transposed_lanes(width)'s order back to the lanes' own."""
    if (literals := _literal_values(rows, width)) is None:
        return None
    n_rows, n = literals
    order = transposed_lanes(n)
    back = [order.index(lane) for lane in range(n)]

    def codegen(context, builder, signature, args):
        f32, i64 = ir.FloatType(), ir.IntType(64)
        for i in range(n_rows):
            at = _vector_at(builder, args[0], ir.Constant(i64, i * n), f32, n)
            row = builder.load(at, align=4)
            builder.store(_shuffle(builder, row, ir.Constant(row.type, ir.Undefined), back), at, align=4)
        return context.get_dummy_value()

    return types.void(sums, rows, width), codegen


# Q6_K in its bits (k_quants.py): a sub-block's 16 columns are 4 words of ql bytes (their 4 low bits, at
# bit 4·(k // 2) for run k of the half block) and 4 of qh bytes (2 high bits at bit 2·k). Put together in
# registers, the weights are 6-bit values q, unsigned, so vpdpbusd multiplies them with the input bytes
# as they are: the sub-block's Σ (q − 32)·x̂ is Σ q·x̂ less 32·Σ x̂, the integer _byte_column_dots finds
# for int8 values q − 32. The float steps after it are that kernel's, in the same order: the same bits.


@intrinsic
def _q6_k_half_dots(
    typingctx, values, ql_at, qh_at, xq, xq_at, x_scales, xs_at, d, sc, d_at, sc_at, sums, width, ahead
):
    """One row's share of half a Q6_K block (its 16 words of ql bytes from values.flat[ql_at…] and 8 of
    qh bytes from values.flat[qh_at…], LANES words apart): for each of its 8 sub-blocks s of 16 columns
    in turn, sums[:width] += d·sc · ((Σ (q − 32)·x̂) · x_scale), fused. d the float32 at d.flat[d_at…],
    sc the int8 at sc.flat[sc_at + s·LANES…]; the row's bytes the 32-bit words from xq.flat[xq_at], the
    scale of run k at x_scales.flat[xs_at + 2·k] (quantize_rows' x_runs). A sub-block's words are read
    for it, all lanes' side by side, and read again (from L1) by the next sub-block holding bits of
    them: with each word read once and the 8 sub-blocks' sums side by side, LLVM hoisted the reads and
    spilled registers (a quarter of the code on AVX2; the compute-bound rate 1.4-1.5x lower,
    docs/performance.md). The first read of a word asks for the line `ahead` bytes further (a literal;
    0: none), so that the asks go out spread among the reads."""
    if (literals := _literal_values(width, ahead)) is None:
        return None
    n, ahead_bytes = literals

    def codegen(context, builder, signature, args):
        pointers = [_data(context, builder, signature.args[k], args[k]) for k in (0, 3, 5, 7, 8)]
        ql_at, qh_at, xq_at, xs_at, d_at, sc_at = _casts(
            context, builder, signature, args, (1, 2, 4, 6, 9, 10)
        )
        lanes = ir.Constant(ir.IntType(64), PROFILE.lanes)  # a constant: addresses as displacements
        q6 = _Q6K(builder, pointers, args[11], lanes, xq_at, None, xs_at, None, d_at, n, ahead_bytes)
        ql_ptr, qh_ptr = q6.words_at(ql_at), q6.words_at(qh_at)
        paired = q6.how in ("bw", "avx2")  # two words' 16-bit pairs added before widening: ≤ 2·2·63·127
        b, chunks = builder, range(n // q6.chunk)
        # The 8 sub-blocks' 32·Σ x̂ first, and each sub-block's totals made before any is held in a register:
        # so placed, LLVM spilled least (benchmarks/kernel_code.py: 139 vector spills and reloads on AVX2
        # and 376 cycles a half block for llvm-mca's Zen 3, against 264-391 and 412-479 placed otherwise)
        biases = [q6.bias(0, 8 * (s // 2) + 4 * (s % 2)) for s in range(8)]
        totals = [b.load(q6.sums_at(0, j), align=4) for j in chunks]
        for s in range(8):  # columns 16·s… of the half: run k, its second 16 where s is odd
            k, second = s // 2, s % 2
            acc, pending = [q6.zeros] * len(chunks), [None] * len(chunks)
            for c in range(4 * second, 4 * second + 4):  # its words: of ql (8 further for odd k) and qh
                x = q6.x_word(0, 8 * k + c)
                for j in chunks:
                    ql = q6.word(ql_ptr, 8 * (k % 2) + c, j, asks=s < 4)  # each word's first read asks
                    qh = q6.word(qh_ptr, c, j, asks=s < 2)
                    q = q6.quants(ql, qh, k)
                    if not paired:
                        acc[j] = _byte_dot(b, q6.how, acc[j], q, x)
                    elif c % 2 == 0:
                        pending[j] = _byte_pairs(b, q6.how, q, x)
                    else:
                        pairs = b.add(pending[j], _byte_pairs(b, q6.how, q, x))
                        acc[j] = b.add(acc[j], _pairs_to_words(b, q6.how, pairs))
            bias = biases[s]
            sc_s = b.add(sc_at, ir.Constant(ir.IntType(64), s * PROFILE.lanes))
            totals = [q6.add_sub_block(sc_s, 2 * k, 0, j, acc[j], bias, totals[j]) for j in chunks]
            totals = [_in_register(b, total) for total in totals]
        for j in chunks:
            b.store(totals[j], q6.sums_at(0, j), align=4)
        return context.get_dummy_value()

    sig_args = (values, ql_at, qh_at, xq, xq_at, x_scales, xs_at, d, sc, d_at, sc_at, sums, width, ahead)
    return types.void(*sig_args), codegen


def _in_register(builder, value):
    """`value` as it is, through an empty piece of assembly that takes it in a register and may touch any
    memory: what makes it is computed before, and no read after it moves up past it. A sub-block's reads
    and sums stay together, in the registers they fit in."""
    register = "v" if value.type.count * 32 > 256 else "x"
    kind = ir.FunctionType(value.type, [value.type])
    code = ir.InlineAsm(kind, "", f"={register},0,~{{memory}}", side_effect=True)
    return builder.call(code, [value])


@intrinsic
def _q6_k_sub_block_dots(
    typingctx, values, ql_at, qh_at, lanes, k, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, d, sc, d_at,
    sc_at, sums, rows, width,
):
    """A Q6_K sub-block's share of a pass of `rows` rows: its 4 words of ql bytes from values.flat[ql_at…]
    and of qh bytes from values.flat[qh_at…] (run k of its half block, a variable), sums[i·width:…] +=
    d·sc · ((Σ (q − 32)·x̂) · x_scale[i]), fused; row i's bytes from xq.flat[xq_at + i·xq_stride], its
    run's scale at x_scales.flat[xs_at + i·xs_stride], d at d.flat[d_at…], sc at sc.flat[sc_at…]. A
    sub-block a call: the code of a half block for several rows would take seconds longer to compile."""
    if (literals := _literal_values(rows, width)) is None:
        return None
    n_rows, n = literals

    def codegen(context, builder, signature, args):
        pointers = [_data(context, builder, signature.args[k], args[k]) for k in (0, 5, 8, 11, 12)]
        ql_at, qh_at, lanes, k, xq_at, xq_stride, xs_at, xs_stride, d_at, sc_at = _casts(
            context, builder, signature, args, (1, 2, 3, 4, 6, 7, 9, 10, 13, 14)
        )
        q6 = _Q6K(builder, pointers, args[15], lanes, xq_at, xq_stride, xs_at, xs_stride, d_at, n)
        ql_ptr, qh_ptr = q6.words_at(ql_at), q6.words_at(qh_at)
        i32 = ir.IntType(32)
        k32 = builder.trunc(k, i32)
        # ql's nibbles from bit 4·(k // 2), qh's pair from bit 2·k
        low_bit = q6.splat(builder.mul(builder.lshr(k32, ir.Constant(i32, 1)), ir.Constant(i32, 4)))
        high_bit = q6.splat(builder.mul(k32, ir.Constant(i32, 2)))
        chunks = range(n // q6.chunk)
        acc = [[q6.zeros] * len(chunks) for _ in range(n_rows)]
        for c in range(4):
            xs = [q6.x_word(i, c) for i in range(n_rows)]
            for j in chunks:
                low = builder.and_(builder.lshr(q6.word(ql_ptr, c, j), low_bit), q6.constant(0x0F0F0F0F))
                high = builder.shl(builder.lshr(q6.word(qh_ptr, c, j), high_bit), q6.constant(4))
                q = builder.or_(low, builder.and_(high, q6.constant(0x30303030)))
                for i in range(n_rows):
                    acc[i][j] = _byte_dot(builder, q6.how, acc[i][j], q, xs[i])
        for i in range(n_rows):
            bias = q6.bias(i, 0)
            for j in chunks:
                at_sums = q6.sums_at(i, j)
                total = q6.add_sub_block(sc_at, 0, i, j, acc[i][j], bias, builder.load(at_sums, align=4))
                builder.store(total, at_sums, align=4)
        return context.get_dummy_value()

    sig_args = (
        values, ql_at, qh_at, lanes, k, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, d, sc, d_at, sc_at,
        sums, rows, width,
    )
    return types.void(*sig_args), codegen


class _Q6K:
    """What both Q6_K intrinsics' code shares: where things are, and the steps of a sub-block."""

    def __init__(
        self, builder, pointers, sums_ptr, lanes, xq_at, xq_stride, xs_at, xs_stride, d_at, n, ahead=0
    ):
        self.b, self.n, self.lanes, self.ahead = builder, n, lanes, ahead
        self.how, self.chunk = PROFILE.byte_dot, _chunk(n)
        i32, i64 = ir.IntType(32), ir.IntType(64)
        self.words_t = ir.VectorType(i32, self.chunk)
        self.floats_t = ir.VectorType(ir.FloatType(), self.chunk)
        self.values_ptr, self.xq_ptr, self.xs_ptr, d_ptr, self.sc_ptr = pointers
        self.sums_ptr = sums_ptr
        self.xq_at, self.xs_at = xq_at, xs_at
        self.xq_stride = xq_stride if xq_stride is not None else ir.Constant(i64, 0)
        self.xs_stride = xs_stride if xs_stride is not None else ir.Constant(i64, 0)
        self.zeros = self.constant(0)
        self.fma = _fma(builder, self.chunk)
        self.d = [
            self.load(d_ptr, self.at(d_at, j * self.chunk), ir.FloatType(), 4) for j in range(n // self.chunk)
        ]

    def constant(self, value):
        return ir.Constant(self.words_t, [value] * self.chunk)

    def splat(self, value):
        return _splat(self.b, self.words_t, value)

    def at(self, base, offset):
        return self.b.add(base, ir.Constant(ir.IntType(64), offset))

    def load(self, pointer, where, element, align):
        return self.b.load(_vector_at(self.b, pointer, where, element, self.chunk), align=align)

    def words_at(self, at):
        return self.b.bitcast(self.b.gep(self.values_ptr, [at]), ir.IntType(32).as_pointer())

    def word(self, pointer, w, j, asks=True):
        """Word w from pointer, lanes j·chunk… (where it `asks`, asking for the line `ahead` bytes on)."""
        where = self.at(self.b.mul(self.lanes, ir.Constant(ir.IntType(64), w)), j * self.chunk)
        if self.ahead and asks:
            ask_for(self.b, self.b.gep(pointer, [self.at(where, self.ahead // 4)]))
        return self.load(pointer, where, ir.IntType(32), 1)

    def x_word(self, i, w):
        """Row i's input bytes of column word w (4 columns), in every lane."""
        return self.splat(_word_at(self.b, self.xq_ptr, self.xq_at, self.xq_stride, i, w))

    def quants(self, ql, qh, k):
        """Run k's 6-bit values: ql's nibbles from bit 4·(k // 2), qh's pair from bit 2·k moved to bit 4."""
        b = self.b
        low = b.and_(b.lshr(ql, self.constant(4)) if k >= 2 else ql, self.constant(0x0F0F0F0F))
        shift = 4 - 2 * k
        if shift > 0:
            qh = b.shl(qh, self.constant(shift))
        elif shift < 0:
            qh = b.lshr(qh, self.constant(-shift))
        return b.or_(low, b.and_(qh, self.constant(0x30303030)))

    def bias(self, i, first):
        """32·Σ x̂ over the 16 columns of row i from column word `first`, in every lane (summed as one
        number: as a product of bytes in every lane it took 4 of them)."""
        b, i64, i32 = self.b, ir.IntType(64), ir.IntType(32)
        where = b.add(self.xq_at, b.add(b.mul(self.xq_stride, ir.Constant(i64, i)), ir.Constant(i64, first)))
        column_bytes = ir.VectorType(ir.IntType(8), 16)
        x = b.load(b.bitcast(b.gep(self.xq_ptr, [where]), column_bytes.as_pointer()), align=1)
        total = _call(b, "llvm.vector.reduce.add.v16i32", i32, b.sext(x, ir.VectorType(i32, 16)))
        return self.splat(b.mul(total, ir.Constant(i32, 32)))

    def sums_at(self, i, j):
        """Where row i's sums for lanes j·chunk… are."""
        where = ir.Constant(ir.IntType(64), i * self.n + j * self.chunk)
        return _vector_at(self.b, self.sums_ptr, where, ir.FloatType(), self.chunk)

    def add_sub_block(self, sc_at, run, i, j, acc, bias, total):
        """total + d·sc · ((acc − bias) · x_scale), fused: how _byte_column_dots adds a block to row i's
        sums (lanes j·chunk…), sc at sc_at, the row's input scale `run` numbers past its first."""
        b, i64 = self.b, ir.IntType(64)
        small = self.load(self.sc_ptr, self.at(sc_at, j * self.chunk), ir.IntType(8), 1)
        scale = b.fmul(self.d[j], b.sitofp(small, self.floats_t))
        run_at = b.add(self.xs_at, b.mul(self.xs_stride, ir.Constant(i64, i)))
        x_scale = _splat(b, self.floats_t, b.load(b.gep(self.xs_ptr, [self.at(run_at, run)]), align=4))
        run_sum = b.fmul(b.sitofp(b.sub(acc, bias), self.floats_t), x_scale)
        return b.call(self.fma, [scale, run_sum, total])
