"""The kernels' building blocks (vectors.py, byte_vectors.py, block_vectors.py, attention_vectors.py) in
plain NumPy: what each intrinsic computes, over the same flat indices, float32 rounding for float32
rounding (a fused multiply-add as float64 maths rounded once to float32). tests/test_vectors.py holds
each intrinsic to its twin here.
"""

from __future__ import annotations

import numpy as np

from .byte_vectors import transposed_lanes
from .half import to_floats

F32 = np.float32


def _fused(a, b, c) -> np.ndarray:
    """a · b + c rounded once to float32 (float32 · float32 is exact in float64)."""
    return (np.float64(1) * a * b + c).astype(F32)


def dequantize_column(values, scales, offsets, at, scale_at, width) -> np.ndarray:
    """vectors._dequantize_column: w = value · scale + offset, two roundings (16-bit floats widened)."""
    w = to_floats(values.reshape(-1)[at : at + width])
    if scales is not None:
        w = w * scales.reshape(-1)[scale_at : scale_at + width]
    if offsets is not None:
        w = w + offsets.reshape(-1)[scale_at : scale_at + width]
    return w


def bit_fields(values, at, shift, mask, width) -> np.ndarray:
    """vectors._bit_fields: (byte >> shift) & mask of `width` bytes, as float32."""
    return ((values.reshape(-1)[at : at + width].astype(np.int64) >> shift) & mask).astype(F32)


def q3_k_quants(values, low_at, shift, high_at, bit, width) -> np.ndarray:
    """vectors._q3_k_quants: 2 low bits, less 4 where the high bit is clear, as float32."""
    low = bit_fields(values, low_at, shift, 3, width)
    return low - 4 + 4 * bit_fields(values, high_at, bit, 1, width)


def table_fields(values, at, shift, table, width) -> np.ndarray:
    """vectors._table_fields: table[(byte >> shift) & 15] of `width` bytes."""
    return table[(values.reshape(-1)[at : at + width].astype(np.int64) >> shift) & 15]


def e8m0_halves(values, at, width) -> np.ndarray:
    """block_vectors._e8m0_halves: half of 2^(e − 127) for `width` bytes e, as float32 (exact: from 2^-128,
    a subnormal, to 2^127)."""
    e = values.reshape(-1)[at : at + width].astype(np.int64)
    return np.ldexp(np.float64(1), e - 128).astype(F32)


def sign_bit_scales(values, at, bit, scale, width) -> np.ndarray:
    """block_vectors._sign_bit_scales: scale where bit `bit` of `width` bytes is set, else −scale."""
    is_set = (values.reshape(-1)[at : at + width] >> bit) & 1 == 1
    return np.where(is_set, scale[:width], -scale[:width]).astype(F32)


def scaled_multiply_add(sums, w, scale, xj, width) -> None:
    """block_vectors._scaled_multiply_add: sums[:width] += (w · scale) · xj, the weight rounded, then
    fused."""
    sums[:width] = _fused((w[:width] * scale[:width]).astype(F32), F32(xj), sums[:width])


def column_multiply_add(sums, tile, at, xj, width) -> None:
    """block_vectors._column_multiply_add: sums[:width] += tile[at:at + width] · xj, fused."""
    sums[:width] = _fused(tile[at : at + width], F32(xj), sums[:width])


def multiply_add(sums, i, w, xj, width) -> None:
    """vectors._multiply_add: sums[i·width:…] += w · xj, fused."""
    part = slice(i * width, (i + 1) * width)
    sums[part] = _fused(w[:width], F32(xj), sums[part])


def q4_k_scales(halves, six_bits, d_at, sc_at, lanes, width) -> tuple[np.ndarray, np.ndarray]:
    """vectors._q4_k_scales: (d · sc, −(dmin · m)) of `width` lanes."""
    flat_halves, flat_bits = halves.reshape(-1), six_bits.reshape(-1)
    d, dmin = (flat_halves[a : a + width].view(np.float16).astype(F32) for a in (d_at, d_at + lanes))
    sc, m = (flat_bits[a : a + width].astype(F32) for a in (sc_at, sc_at + 8 * lanes))
    return d * sc, -(dmin * m)


def _words(values, at, count) -> np.ndarray:
    """The `count` little-endian 32-bit words at byte `at` of values."""
    return values.reshape(-1).view(np.uint8)[at : at + 4 * count].view("<u4")


def nibbles(values, at, shift, byte, width) -> np.ndarray:
    """vectors._nibbles: the 4-bit values at bit 8·byte + shift of `width` words, as float32."""
    return ((_words(values, at, width) >> (8 * byte + shift)) & 15).astype(F32)


def dequantize_nibbles(values, at, shift, byte, scale, offset, width) -> np.ndarray:
    """vectors._dequantize_nibbles: nibbles · scale + offset, two roundings."""
    return nibbles(values, at, shift, byte, width) * scale[:width] + offset[:width]


def scale_run(sums, runs, i, scale, offset, x_sum, width) -> None:
    """vectors._scale_run: sums += scale · run, then += offset · x_sum, each fused."""
    part = slice(i * width, (i + 1) * width)
    sums[part] = _fused(scale[:width], runs[part], sums[part])
    sums[part] = _fused(offset[:width], F32(x_sum), sums[part])


def _bytes_of(xq, first, count) -> np.ndarray:
    """The int8 bytes of `count` 32-bit words of xq from word `first`."""
    return xq.reshape(-1)[first : first + count].view(np.int8).astype(np.int64)


def nibble_dots(values, at, lanes, shift, xq, xq_at, xq_stride, x_scales, xs_at, xs_stride, rows, width):
    """byte_vectors._nibble_dots: [rows · width] the run's Σ q · x̂ (integers), times each row's
    x_scale."""
    q = np.stack([
        (_words(values, at + 4 * lanes * c, width)[None, :] >> (8 * np.arange(4)[:, None] + shift)) & 15
        for c in range(8)
    ]).astype(np.int64)  # [8 words, 4 bytes, width]
    runs = np.empty(rows * width, F32)
    for i in range(rows):
        x = _bytes_of(xq, xq_at + i * xq_stride, 8).reshape(8, 4)
        total = np.einsum("cbl,cb->l", q, x)
        runs[i * width : (i + 1) * width] = total.astype(F32) * x_scales.reshape(-1)[xs_at + i * xs_stride]
    return runs


def byte_column_dots(
    values, at, lanes, size, xq, xq_at, xq_stride, x_runs, xr_at, xr_stride,
    scales, offsets, scale_at, sums, rows, width,
) -> None:
    """byte_vectors._byte_column_dots: sums (in transposed_lanes' order) += scale · (Σ_j w·xq · x_scale),
    then += offset · Σ x, each fused, for the block's `size` columns of int8 weights."""
    order = transposed_lanes(width)
    flat = values.reshape(-1)
    w = np.stack([flat[at + j * lanes : at + j * lanes + width] for j in range(size)]).astype(np.int64)
    scale = scales.reshape(-1)[scale_at : scale_at + width][order]
    offset = None if offsets is None else offsets.reshape(-1)[scale_at : scale_at + width][order]
    runs = x_runs.reshape(-1)
    for i in range(rows):
        x = _bytes_of(xq, xq_at + i * xq_stride, size // 4)
        run = (x @ w)[order].astype(F32) * runs[xr_at + i * xr_stride + 1]
        part = slice(i * width, (i + 1) * width)
        sums[part] = _fused(scale, run, sums[part])
        if offset is not None:
            sums[part] = _fused(offset, runs[xr_at + i * xr_stride], sums[part])


def q6_k_scales(d, sc, d_at, sc_at, width) -> np.ndarray:
    """vectors._q6_k_scales: d · sc, one rounding (exact)."""
    return d.reshape(-1)[d_at : d_at + width] * sc.reshape(-1)[sc_at : sc_at + width].astype(F32)


def _q6_k_quants(values, ql_at, qh_at, byte, k, width) -> np.ndarray:
    """The 6-bit values of a column: 4 bits at bit 8·byte + 4·(k // 2) of the words at ql_at, and above
    them 2 at bit 8·byte + 2·k of those at qh_at."""
    low = (_words(values, ql_at, width) >> (8 * byte + 4 * (k // 2))) & 15
    high = (_words(values, qh_at, width) >> (8 * byte + 2 * k)) & 3
    return (low | high << 4).astype(np.int64)


def q6_k_column(values, ql_at, qh_at, byte, k, scale, width) -> np.ndarray:
    """vectors._q6_k_column: (q − 32) · scale, one rounding."""
    return (_q6_k_quants(values, ql_at, qh_at, byte, k, width) - 32).astype(F32) * scale[:width]


def q6_k_int8_scales(d, sc, d_at, sc_at, width) -> np.ndarray:
    """vectors._q6_k_int8_scales: a block's 16 sub-blocks' d · sc [16, width]."""
    return np.stack([q6_k_scales(d, sc, d_at, sc_at + s * width, width) for s in range(16)])


def q6_k_int8_columns(values, ql_at, qh_at, width) -> np.ndarray:
    """vectors._q6_k_int8_columns: q − 32 as int8 [4 runs k, 4 columns c, width], the ql words of odd
    runs 8·width words on."""
    out = np.empty((4, 4, width), np.int8)
    for k in range(4):
        for c in range(4):
            out[k, c] = _q6_k_quants(values, ql_at + 32 * width * (k % 2), qh_at, c, k, width) - 32
    return out


def q6_k_dots(
    values, ql_at, qh_at, lanes, xq, xq_at, xq_stride, x_runs, xs_at, xs_stride, d, sc, d_at, sc_at, sums,
    rows, width,
) -> None:
    """byte_vectors._q6_k_dots: for each sub-block s of half a block in turn, sums[i] += d·sc ·
    (Σ (q − 32)·x̂ · x_scale), fused."""
    for s in range(8):
        k, second = s // 2, s % 2
        words = [(8 * (k % 2) + 4 * second + c, 4 * second + c) for c in range(4)]  # (ql's, qh's)
        q = np.stack([
            _q6_k_quants(values, ql_at + 4 * lanes * low, qh_at + 4 * lanes * high, byte, k, width)
            for low, high in words
            for byte in range(4)
        ])  # [16 columns, width]
        scale = q6_k_scales(d, sc, d_at, sc_at + s * lanes, width)
        for i in range(rows):
            x = _bytes_of(xq, xq_at + i * xq_stride + 8 * k + 4 * second, 4)
            run = ((x @ (q - 32)).astype(F32) * x_runs.reshape(-1)[xs_at + i * xs_stride + 2 * k]).astype(F32)
            part = slice(i * width, (i + 1) * width)
            sums[part] = _fused(scale, run, sums[part])


def in_lane_order(sums, rows, width) -> None:
    """byte_vectors.in_lane_order: each row's sums from transposed_lanes' order to the lanes' own."""
    order = transposed_lanes(width)
    for i in range(rows):
        part = sums[i * width : (i + 1) * width].copy()
        sums[i * width + np.asarray(order)] = part


def block_scores(q, q_at, q_stride, keys, k_at, n, block, heads, width) -> np.ndarray:
    """attention_vectors._block_scores: [heads, width] each position's Σ_d q_g[d] · keys[d, p] (keys as
    [head_dim, block] from keys.flat[k_at], widened), fused in d's order."""
    out = np.zeros((heads, width), F32)
    for g in range(heads):
        head = q.reshape(-1)[q_at + g * q_stride : q_at + g * q_stride + n]
        for d in range(n):
            out[g] = _fused(head[d], widen(keys, k_at + d * block, width), out[g])
    return out


def add_rows(acc, a_stride, kv, starts, count, n, weights, w_stride, heads) -> None:
    """attention_vectors._add_rows: each head's acc.flat[g·a_stride:… + n] += weight · row, a row of the
    cache (from kv.flat[starts[j]], widened) at a time, fused."""
    for g in range(heads):
        part = acc.reshape(-1)[g * a_stride : g * a_stride + n]
        for j in range(count):
            part[:] = _fused(widen(kv, starts[j], n), weights.reshape(-1)[g * w_stride + j], part)


def tile_scores(queries, rows, rows_at, n, keys, width) -> np.ndarray:
    """attention_vectors._tile_scores: [keys, width] each lane's Σ_d queries[d, lane] · row[d], fused in
    d's order."""
    out = np.zeros((keys, width), F32)
    for j in range(keys):
        row = rows.reshape(-1)[rows_at + j * n : rows_at + (j + 1) * n]
        for d in range(n):
            out[j] = _fused(queries[d, :width], row[d], out[j])
    return out


def tile_add(acc, d_at, weights, rows, rows_at, count, n, dims) -> None:
    """attention_vectors._tile_add: acc[d_at + i] += weights[j] · rows.flat[rows_at + j·n + d_at + i],
    the rows in order, fused."""
    for j in range(count):
        for i in range(d_at, d_at + dims):
            acc[i] = _fused(weights[j], rows.reshape(-1)[rows_at + j * n + i], acc[i])


def widen(values, at, n) -> np.ndarray:
    """attention_vectors._widen: values.flat[at:at + n] as float32 (float16 as their bits say)."""
    part = values.reshape(-1)[at : at + n]
    return part.view(np.float16).astype(F32) if part.dtype == np.uint16 else part.astype(F32)


def largest(values, at, n) -> np.float32:
    """attention_vectors._largest: the largest of values.flat[at:at + n], NaN ignored."""
    return F32(np.nanmax(values.reshape(-1)[at : at + n]))
