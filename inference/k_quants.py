"""Q4_K and Q6_K weights kept in their GGUF bits: the packed layouts, and the kernels' half of reading
them.

ggml's Q4_K block holds 256 weights of a row in 144 bytes: d and dmin (float16), 12 bytes of 6-bit
scales and mins (8 of each, one per run of 32 weights), and 128 bytes of 4-bit values whose byte
32·k + l holds weight 64·k + l in its low nibble and weight 64·k + 32 + l in its high one. Weight =
d·sc·q − dmin·m (gguf.quants, ggml's dequantize_row_q4_K).

Packed, LANES rows are interleaved as in quants.py, and every value byte keeps its place in its row:
- values [groups, n_cols / 2, LANES] uint8, in words of four bytes of a row: the row's value byte k
  (128·b + k' for byte k' of block b) at values[g].flat[4·(LANES·(k // 4) + lane) + k % 4];
- scales [groups, n_cols / 256, 2, LANES] uint16: the float16 bits of d and dmin;
- offsets [groups, n_cols / 256, 16, LANES] uint8: the 8 scales, then the 8 mins.
148 bytes per 256 weights (the GGUF's 144, the 6-bit fields a byte each) where int8 values with a
float32 scale and offset per 32 take 320. A vector of words holds 4 columns of as many rows: a shift
takes one column's nibbles out (AVX-512 then turns them into floats with one permute, vectors.py),
where a byte a lane would have to be widened first. The kernels add up a run's Σ q·x, then take it
times the run's d·sc and Σ x times its −dmin·m (formed as gguf.quants forms them, in float32), as ggml
factors a block's dot product: every weight is the GGUF's, exactly, and each row's sums run in one
order whatever else is in the batch. Dequantizing each weight first (q·d·sc − dmin·m) would take two
more operations per weight, making the kernels compute-bound, and its long sums of w·x round further
from the exact product (test_kernels).

Q6_K (the output matrix and some ffn_down and attn_v of a Q4_K_M model) keeps its ql and qh bytes the
same way where the processor has VNNI and the model no other int8 matrices (formats.own_bits; its
layout further down), for products of inputs as bytes; float32 inputs take it as int8
(quants.for_inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import carray, types
from numba.extending import overload

from .byte_vectors import _nibble_dots, _nibble_pair_dots, _q6_k_half_dots, _q6_k_sub_block_dots
from .cpu import PROFILE
from .half import to_f32
from .jit import njit
from .vectors import (
    _dequantize_nibbles,
    _multiply_add,
    _nibbles,
    _prefetch,
    _q4_k_scales,
    _q6_k_column,
    _q6_k_int8_columns,
    _q6_k_int8_scales,
    _q6_k_scales,
    _registers,
    _scale_run,
)

LANES = PROFILE.lanes
F32 = np.float32


@njit(cache=True, inline="always")
def _scale_min_k4(j, block):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j, packed in 12 bytes at byte 4."""
    s = 4
    if j < 4:
        return block[s + j] & 63, block[s + j + 4] & 63
    sc = (block[s + j + 4] & 0xF) | ((block[s + j - 4] >> 6) << 4)
    m = (block[s + j + 4] >> 4) | ((block[s + j] >> 6) << 4)
    return sc, m


@njit(cache=True, inline="always")
def _store(tile, values, g, lane0, lane1):
    """Rows lane0… of a tile [LANES, n_cols] into lanes lane0… of the packed group values[g]; lanes
    outside belong to the part packed before or after this one, or stay zero (padding)."""
    if lane0 == 0 and lane1 == LANES:  # the common case, with a constant count the compiler unrolls
        for j in range(tile.shape[1]):
            for lane in range(LANES):
                values[g, j, lane] = tile[lane, j]
    else:
        for j in range(tile.shape[1]):
            for lane in range(lane0, lane1):
                values[g, j, lane] = tile[lane, j]



@njit(cache=True, inline="always")
def _store_words(tile, values, g, lane0, lane1):
    """Rows lane0… of a tile [LANES, n_bytes] into lanes lane0… of the packed group values[g], four bytes
    of a row side by side (byte k at word k // 4 of the lane, byte k % 4 in it); lanes outside belong
    to the part packed before or after this one, or stay zero (padding)."""
    flat = values[g].reshape(-1)
    for k in range(tile.shape[1]):
        at = 4 * LANES * (k // 4) + k % 4
        for lane in range(lane0, lane1):
            flat[at + 4 * lane] = tile[lane, k]


@njit(cache=True, nogil=True)
def pack_blocks(blocks, row0, per_row, values, scales, offsets, g0, g1):
    """Groups g0…g1 - 1 of Q4_K rows in this layout: each block's value bytes keep their order (a tile
    of the group's rows, then transposed, as quants._unpack_blocks), its 6-bit fields a byte each and
    its float16s their bits."""
    n_rows = blocks.shape[0] // per_row
    for g in range(g0, g1):
        lane0, lane1 = max(row0 - g * LANES, 0), min(row0 + n_rows - g * LANES, LANES)
        tile = np.empty((LANES, values.shape[1]), np.uint8)
        for lane in range(lane0, lane1):
            first = (g * LANES + lane - row0) * per_row
            for cb in range(per_row):
                block = blocks[first + cb]
                for k in range(2):  # d, dmin
                    scales[g, cb, k, lane] = np.uint16(block[2 * k]) | (np.uint16(block[2 * k + 1]) << 8)
                for sub in range(8):
                    offsets[g, cb, sub, lane], offsets[g, cb, 8 + sub, lane] = _scale_min_k4(sub, block)
                for k in range(128):  # (a loop: a slice assignment compiles its shape check's
                    tile[lane, 128 * cb + k] = block[16 + k]  # error message, seconds of a first start)
        _store_words(tile, values, g, lane0, lane1)


@njit(cache=True)
def _run(values, g, r, lane0):
    """Where run r (of 32 columns) of group g lies, from lane lane0 on: the flat indices of its d, its
    scale and its first word of value bytes (whose low nibbles hold an even run, the high ones an odd
    run; 8 words of 4 columns follow, LANES words apart).
    A plain call (LLVM inlines it): inlined by numba, each of its call sites would be typed again, for
    no speed (benchmarks/kernel_rows.py)."""
    n_bytes, lanes = values.shape[1], values.shape[2]
    block = g * (n_bytes // 128) + r // 8
    d_at, sc_at = (block * 2) * lanes + lane0, (block * 16 + r % 8) * lanes + lane0
    return d_at, sc_at, g * n_bytes * lanes + 4 * (8 * (r // 2) * lanes + lane0)


@njit(cache=True, inline="always")
def _run_sums(
    values, scales, offsets, x, x_sums, i0, sums, runs, w, scale, offset, g, r, lane0, shift, rows, width,
    ahead,
):
    """Run r's 32 columns into the sums of `rows` rows: Σ q·x over the run's 4-bit values q (their nibbles
    from bit `shift`, a literal: a shift by a variable costs speed), then that times the
    run's d·sc and Σ x times its −dmin·m, as ggml factors a block's dot product."""
    lanes = values.shape[2]
    d_at, sc_at, at = _run(values, g, r, lane0)
    for k in range(rows * width):
        runs[k] = 0
    for c in range(8):  # a word of 4 columns at a time
        if ahead and shift == 0:  # (the run in the high nibbles reads the same bytes)
            for line in range(0, 4 * lanes, 64):  # the word's bytes of every lane, a line at a time
                _prefetch(values, at + 4 * c * lanes, line)
        for byte in range(4):
            _nibbles(values, at + 4 * c * lanes, shift, byte, w, width)
            for i in range(rows):
                _multiply_add(runs, i, w, x[i0 + i, 32 * r + 4 * c + byte], width)
    _q4_k_scales(scales, offsets, d_at, sc_at, lanes, scale, offset, width)
    for i in range(rows):
        _scale_run(sums, runs, i, scale, offset, x_sums[i0 + i, r], width)


@njit(cache=True, inline="always")
def accumulate(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
    """products._accumulate for Q4_K: sums[i, r] = Σ_j w[g·L + lane0 + r, j] · x[i0 + i, j] for i < rows,
    r < width, a run of 32 columns at a time (run_sums), each in column order: the same operations in
    the same order for a row whatever the rows and width of its pass."""
    scale, offset = _registers(width), _registers(width)
    for k in range(rows * width):
        sums[k] = 0
    for r in range(0, x.shape[1] // 32, 2):  # a run in low nibbles, then the run in their high ones
        _run_sums(
            values, scales, offsets, x, x_sums, i0, sums, runs, w, scale, offset, g,
            r, lane0, 0, rows, width, ahead,
        )
        _run_sums(
            values, scales, offsets, x, x_sums, i0, sums, runs, w, scale, offset, g,
            r + 1, lane0, 4, rows, width, ahead,
        )


@njit(cache=True, inline="always")
def _run_sums_q8(
    values, scales, offsets, xq, x_runs, i0, sums, runs, scale, offset, g, r, lane0, shift, rows, width,
    ahead,
):
    """_run_sums for activations in bytes (activations.quantize_rows): the run's Σ q·x̂ in integers,
    times the bytes' scale, then as there d·sc times that and −dmin·m times the run's Σ x̂ (its bytes'
    sum times their scale: quantize_rows)."""
    lanes = values.shape[2]
    d_at, sc_at, at = _run(values, g, r, lane0)
    if ahead and shift == 0:
        for c in range(8):
            for line in range(0, 4 * lanes, 64):
                _prefetch(values, at + 4 * c * lanes, line)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    xq_at, xs_at = i0 * n_words + 8 * r, 2 * (i0 * n_runs + r) + 1
    _nibble_dots(values, at, lanes, shift, xq, xq_at, n_words, x_runs, xs_at, 2 * n_runs, runs, rows, width)
    _q4_k_scales(scales, offsets, d_at, sc_at, lanes, scale, offset, width)
    for i in range(rows):
        _scale_run(sums, runs, i, scale, offset, x_runs[i0 + i, r, 0], width)


def accumulate_q8(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
    """accumulate for activations in bytes: xq [n, n_cols / 4] the rows' bytes four to a word, x_runs
    [n, n_cols / 32, 2] each run's Σ x and its bytes' scale (activations.quantize_rows). For one row a
    pair of runs is read once (_pair_sums_q8) where their sums fit the registers twice (PAIRS_OF_RUNS),
    for more a run at a time. Compiled code only: the overload below picks by `rows` (a literal), so
    that each kernel compiles one of the two."""
    raise NotImplementedError


# Whether one row's product reads a pair of runs at once: with 32 vector registers. With AVX2's 16, LLVM
# kept the pair's sums in them and stored each word it read to the stack for the second run. On an AMD
# EPYC (Zen 4), the AVX2 profile, a 7B's ffn_gate_up shape alone read 27 GB/s from RAM on 2 threads so
# and 38 a run at a time (the second run's words read again from L1); in a 7B's decode 28–29 and 31–32
# (benchmarks/decode_matrices.py). AVX-512 alone reads 48–52 in pairs, 32–40 a run at a time.
PAIRS_OF_RUNS = PROFILE.vector_registers >= 32


@overload(accumulate_q8, inline="always", prefer_literal=True)
def _accumulate_q8_by_rows(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
    if not isinstance(rows, types.IntegerLiteral):
        return None
    if rows.literal_value == 1 and PAIRS_OF_RUNS:

        def by_pairs(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
            scale, offset, high = _registers(width), _registers(width), _registers(width)
            for k in range(width):
                sums[k] = 0
            for r in range(0, x_runs.shape[1], 2):
                _pair_sums_q8(
                    values, scales, offsets, xq, x_runs, i0, sums, runs, high, scale, offset, g, r, lane0,
                    width, ahead,
                )

        return by_pairs

    def by_runs(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
        scale, offset = _registers(width), _registers(width)
        for k in range(rows * width):
            sums[k] = 0
        for r in range(0, x_runs.shape[1], 2):  # a run in low nibbles, then the run in their high ones
            _run_sums_q8(
                values, scales, offsets, xq, x_runs, i0, sums, runs, scale, offset, g,
                r, lane0, 0, rows, width, ahead,
            )
            _run_sums_q8(
                values, scales, offsets, xq, x_runs, i0, sums, runs, scale, offset, g,
                r + 1, lane0, 4, rows, width, ahead,
            )

    return by_runs


@njit(cache=True, inline="always")
def _pair_sums_q8(
    values, scales, offsets, xq, x_runs, i0, sums, low, high, scale, offset, g, r, lane0, width, ahead
):
    """_run_sums_q8 of one row's runs r (low nibbles) and r + 1 (high ones) from one read of their
    bytes, each run's sums added as _run_sums_q8 adds them."""
    lanes = values.shape[2]
    d_at, sc_at, at = _run(values, g, r, lane0)
    if ahead:
        for c in range(8):
            for line in range(0, 4 * lanes, 64):
                _prefetch(values, at + 4 * c * lanes, line)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    xq_at, xs_at = i0 * n_words + 8 * r, 2 * (i0 * n_runs + r) + 1
    _nibble_pair_dots(values, at, lanes, xq, xq_at, n_words, x_runs, xs_at, 2 * n_runs, low, high, 1, width)
    _q4_k_scales(scales, offsets, d_at, sc_at, lanes, scale, offset, width)
    _scale_run(sums, low, 0, scale, offset, x_runs[i0, r, 0], width)
    _q4_k_scales(scales, offsets, d_at, sc_at + lanes, lanes, scale, offset, width)  # (run r + 1's)
    _scale_run(sums, high, 0, scale, offset, x_runs[i0, r + 1, 0], width)


@njit(cache=True)
def run_sums(x):
    """Σ x over each run of 32 columns [n, n_cols / 32], added in column order: the second half of a
    Q4_K run's product, once per call for every matrix row."""
    n, n_cols = x.shape
    out = np.empty((n, n_cols // 32), F32)
    for i in range(n):
        for r in range(n_cols // 32):
            total = F32(0)
            for t in range(32 * r, 32 * r + 32):
                total += x[i, t]
            out[i, r] = total
    return out


@njit(cache=True, inline="always")
def _run_tile(values, scales, offsets, scale, offset, column, g, r, shift, out, c0):
    """Run r's 32 columns into its rows of out, from column c0 on."""
    d_at, sc_at, at = _run(values, g, r, 0)
    _q4_k_scales(scales, offsets, d_at, sc_at, LANES, scale, offset, LANES)
    weights = carray(column, LANES)
    for c in range(8):
        for byte in range(4):
            _dequantize_nibbles(values, at + 4 * c * LANES, shift, byte, scale, offset, column, LANES)
            row = out[32 * r + 4 * c + byte]
            for lane in range(LANES):
                row[c0 + lane] = weights[lane]


@njit(cache=True)
def dequantize_tile(values, scales, offsets, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies
    (products.tile_product), through the same vector code as the kernels."""
    scale, offset, column = _registers(LANES), _registers(LANES), _registers(LANES)
    for g in range(g0, g1):
        for r in range(0, out.shape[0] // 32, 2):
            _run_tile(values, scales, offsets, scale, offset, column, g, r, 0, out, (g - g0) * LANES)
            _run_tile(values, scales, offsets, scale, offset, column, g, r + 1, 4, out, (g - g0) * LANES)


def gguf_blocks(values: np.ndarray, scales: np.ndarray, offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a packed matrix as the GGUF's blocks again [len(ids), bytes per row], for
    gguf.quants to dequantize (a tied embedding table's lookups)."""
    g, lane = ids // LANES, ids % LANES
    n = len(ids)
    sc, m = offsets[g, :, :8, lane], offsets[g, :, 8:, lane]  # [n, blocks, 8]: ggml's 12 bytes again
    low, high = sc[..., 4:], m[..., 4:]
    packed = [sc[..., :4] | (low >> 4) << 6, m[..., :4] | (high >> 4) << 6, (low & 15) | high << 4]
    d_dmin = scales[g, :, :, lane].view(np.uint8)  # [n, blocks, 4]
    words = values.reshape(values.shape[0], -1, LANES, 4)[g, :, lane]  # [n, n_cols / 8, 4]: the row's bytes
    return np.concatenate([d_dmin, *packed, words.reshape(n, -1, 128)], axis=2).reshape(n, -1)


# Q6_K: 256 weights of a row in 210 bytes: 128 of ql (the 4 low bits: byte 64·h + 32·(k % 2) + l holds
# weight 128·h + 32·k + l of half h, run k, in its low nibble for k < 2, else its high one), 64 of qh (the
# 2 high bits: byte 128 + 32·h + l holds run k's at bit 2·k), 16 int8 scales (one per 16 weights) and d
# (float16). Weight = d·sc·(q − 32) (ggml's dequantize_row_q6_K).
# Packed, the 192 bytes of ql and qh keep their places in words of four bytes of a row, as Q4_K's
# nibbles (values [groups, 3·n_cols / 4, LANES] uint8), d as float32 [groups, n_cols / 256, LANES] and the
# scales as int8 [groups, n_cols / 16, LANES]: 212 bytes per 256 weights where int8 values with a float32
# scale per 16 take 320. A sub-block's weights come out of two words with shifts and masks, and the
# kernels then do what they do for int8 values q − 32 with the scale d·sc, in the same order, so a
# product's bits are the same as from int8.
Q6_K_BLOCK_BYTES = 192  # ql and qh, a row's, per 256 weights
# One row's product asks, with each word it reads, for the same word Q6_K_ASK_BLOCKS blocks on (every line
# of a group asked for once, as far ahead). On an AMD EPYC (Zen 4) a 7B's ffn_gate_up shape read from RAM
# at 29–30 GB/s on 2 threads asking 1 to 8 blocks ahead alike (20 on one), against 14 (7 on one) with
# the asks of a half block all at once before it, as passes ask (the product timed alone, as
# benchmarks/read_rate.py times it).
Q6_K_ASK_BLOCKS = 4
Q6_K_ASK_AHEAD = Q6_K_ASK_BLOCKS * Q6_K_BLOCK_BYTES * LANES
_Q6_K_ASK_OFFSET = Q6_K_ASK_AHEAD - PROFILE.prefetch_bytes  # _prefetch adds the profile's distance


@njit(cache=True, nogil=True)
def pack_q6_k_blocks(blocks, row0, per_row, values, d, sc, g0, g1):
    """Groups g0…g1 - 1 of Q6_K rows in this layout: each block's ql and qh bytes in their order (a tile
    of the group's rows, then in words), its d as float32 (exact) and its scales as they are."""
    n_rows = blocks.shape[0] // per_row
    for g in range(g0, g1):
        lane0, lane1 = max(row0 - g * LANES, 0), min(row0 + n_rows - g * LANES, LANES)
        tile = np.empty((LANES, values.shape[1]), np.uint8)
        for lane in range(lane0, lane1):
            first = (g * LANES + lane - row0) * per_row
            for cb in range(per_row):
                block = blocks[first + cb]
                d[g, cb, lane] = to_f32(np.uint16(np.uint32(block[208]) | (np.uint32(block[209]) << 8)))
                for sub in range(16):
                    sc[g, 16 * cb + sub, lane] = np.int8(block[192 + sub])
                for k in range(Q6_K_BLOCK_BYTES):
                    tile[lane, Q6_K_BLOCK_BYTES * cb + k] = block[k]
        _store_words(tile, values, g, lane0, lane1)


@njit(cache=True)
def _q6_k_half(values, d, g, b, h, lane0):
    """Where half h of block b of group g lies, from lane lane0 on: the flat indices of its first word of
    ql bytes and of qh bytes (16 and 8 words follow, LANES words apart), of its d and of its first
    sub-block's scale (the next ones LANES further each)."""
    n_bytes, lanes, n_blocks = values.shape[1], values.shape[2], d.shape[1]
    block = g * n_bytes * lanes + 4 * (lanes * (Q6_K_BLOCK_BYTES // 4) * b + lane0)
    d_at = (g * n_blocks + b) * lanes + lane0
    sc_at = ((g * n_blocks + b) * 16 + 8 * h) * lanes + lane0
    return block + 4 * lanes * 16 * h, block + 4 * lanes * (32 + 8 * h), d_at, sc_at


@njit(cache=True, inline="always")
def _ask_ahead_q6_k(values, ql_at, qh_at, s):
    """Asks, Q6_K_ASK_BLOCKS blocks on, for the words of every lane that sub-block s of a half block is
    the first to read: ql words 4·s… of the first four, qh words 4·s… of the first two. A half block's
    asks go out spread over its sub-blocks, each of its lines asked for once."""
    lanes = values.shape[2]
    if s < 4:
        for line in range(0, 16 * lanes, 64):
            _prefetch(values, ql_at + 16 * lanes * s, _Q6_K_ASK_OFFSET + line)
    if s < 2:
        for line in range(0, 16 * lanes, 64):
            _prefetch(values, qh_at + 16 * lanes * s, _Q6_K_ASK_OFFSET + line)


@njit(cache=True, inline="always")
def accumulate_q6_k(values, d, sc, x, i0, g, lane0, sums, w, scale, rows, width, ahead):
    """products._accumulate for Q6_K: sums[i, r] = Σ_j w[g·L + lane0 + r, j] · x[i0 + i, j], each column
    of weights (q − 32)·d·sc in turn, as _accumulate_values multiplies int8 weights (the same bits)."""
    lanes = values.shape[2]
    for k in range(rows * width):
        sums[k] = 0
    for b in range(d.shape[1]):
        for h in range(2):
            ql_at, qh_at, d_at, sc_at = _q6_k_half(values, d, g, b, h, lane0)
            for s in range(8):  # columns 16·s… of the half: run k, its second 16 where s is odd
                if ahead:
                    _ask_ahead_q6_k(values, ql_at - 4 * lane0, qh_at - 4 * lane0, s)
                k, second = s // 2, s % 2
                _q6_k_scales(d, sc, d_at, sc_at + s * lanes, scale, width)
                for c in range(4):
                    word = 4 * lanes * (4 * second + c)
                    for byte in range(4):
                        ql = ql_at + 4 * lanes * 8 * (k % 2) + word
                        _q6_k_column(values, ql, qh_at + word, byte, k, scale, w, width)
                        j = 256 * b + 128 * h + 32 * k + 16 * second + 4 * c + byte
                        for i in range(rows):
                            _multiply_add(sums, i, w, x[i0 + i, j], width)


def accumulate_q6_k_q8(values, d, sc, xq, x_runs, i0, g, lane0, sums, rows, width, ahead):
    """accumulate_q6_k for inputs as bytes (quantize_rows), as products._accumulate_value_bytes multiplies
    int8 weights (the same bits): one row half a block at a time (byte_vectors._q6_k_half_dots, its
    sub-blocks in turn across all lanes), more rows a sub-block at a time (_q6_k_sub_block_dots).
    Compiled code only: the overload below picks by `rows` (a literal)."""
    raise NotImplementedError


@overload(accumulate_q6_k_q8, inline="always", prefer_literal=True)
def _accumulate_q6_k_q8_by_rows(values, d, sc, xq, x_runs, i0, g, lane0, sums, rows, width, ahead):
    if not isinstance(rows, types.IntegerLiteral):
        return None
    if rows.literal_value == 1:

        def by_halves(values, d, sc, xq, x_runs, i0, g, lane0, sums, rows, width, ahead):
            n_words, n_runs = xq.shape[1], x_runs.shape[1]
            for k in range(width):
                sums[k] = 0
            for b in range(d.shape[1]):
                for h in range(2):
                    ql_at, qh_at, d_at, sc_at = _q6_k_half(values, d, g, b, h, lane0)
                    first = 256 * b + 128 * h  # the half's first column
                    xq_at, xs_at = i0 * n_words + first // 4, 2 * (i0 * n_runs + first // 32) + 1
                    _q6_k_half_dots(
                        values, ql_at, qh_at, xq, xq_at, x_runs, xs_at, d, sc, d_at, sc_at, sums, width,
                        Q6_K_ASK_AHEAD,
                    )

        return by_halves

    # Passes of more rows do not ask ahead (their kernels wait on computing more than on memory): the
    # loops that ask took a second of a first start to compile (one and two rows compile after a load).
    asks_ahead = rows.literal_value <= 2

    def by_sub_blocks(values, d, sc, xq, x_runs, i0, g, lane0, sums, rows, width, ahead):
        lanes, n_words, n_runs = values.shape[2], xq.shape[1], x_runs.shape[1]
        for k in range(rows * width):
            sums[k] = 0
        for b in range(d.shape[1]):
            for h in range(2):
                ql_at, qh_at, d_at, sc_at = _q6_k_half(values, d, g, b, h, lane0)
                first = 256 * b + 128 * h
                for s in range(8):  # columns first + 16·s…: run k of the half, its second 16 where s is odd
                    if asks_ahead and ahead:
                        _ask_ahead_q6_k(values, ql_at - 4 * lane0, qh_at - 4 * lane0, s)
                    k, second = s // 2, s % 2
                    _q6_k_sub_block_dots(
                        values, ql_at + 4 * lanes * (8 * (k % 2) + 4 * second), qh_at + 16 * lanes * second,
                        lanes, k, xq, i0 * n_words + first // 4 + 8 * k + 4 * second, n_words,
                        x_runs, 2 * (i0 * n_runs + first // 32 + k) + 1, 2 * n_runs,
                        d, sc, d_at, sc_at + s * lanes, sums, rows, width,
                    )

    return by_sub_blocks


@njit(cache=True)
def dequantize_q6_k_tile(values, d, sc, g0, g1, out):
    """Groups g0..g1-1 of a Q6_K matrix as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile
    BLAS multiplies (products.tile_product), through the kernels' own column code."""
    scale, column = _registers(LANES), _registers(LANES)
    weights = carray(column, LANES)
    for g in range(g0, g1):
        c0 = (g - g0) * LANES
        for b in range(d.shape[1]):
            for h in range(2):
                ql_at, qh_at, d_at, sc_at = _q6_k_half(values, d, g, b, h, 0)
                for s in range(8):
                    k, second = s // 2, s % 2
                    _q6_k_scales(d, sc, d_at, sc_at + s * LANES, scale, LANES)
                    for c in range(4):
                        word = 4 * LANES * (4 * second + c)
                        for byte in range(4):
                            ql = ql_at + 4 * LANES * 8 * (k % 2) + word
                            _q6_k_column(values, ql, qh_at + word, byte, k, scale, column, LANES)
                            row = out[256 * b + 128 * h + 32 * k + 16 * second + 4 * c + byte]
                            for lane in range(LANES):
                                row[c0 + lane] = weights[lane]


@njit(cache=True, nogil=True)
def q6_k_as_int8(values, d, sc, out, scales, g0, g1):
    """Groups g0…g1 - 1 of a Q6_K matrix in this layout as int8 values q − 32 in out [groups, n_cols,
    LANES] and the float32 scale d·sc of each 16 in scales [groups, n_cols / 16, LANES]: the int8
    layout (quants.py), the same weights."""
    for g in range(g0, g1):
        q6_k_group_as_int8(values, d, sc, g, out[g], scales[g])


@njit(cache=True, nogil=True)
def q6_k_group_as_int8(values, d, sc, g, out, scales):
    """Group g of a Q6_K matrix as int8 into out [n_cols, LANES] and its scales [n_cols / 16, LANES]
    (q6_k_as_int8's): each word of ql and qh bytes read once for the 4 columns of every lane it holds
    bits of (vectors._q6_k_int8_columns). A long prompt's product makes each group so before its
    passes (products._q6_k_tile_product): 4-5 ms a 7B's ffn_down on one thread of the Zen 4 (AVX2) with the
    matrix in the cache, where a loop over each column's lanes took 16."""
    for b in range(d.shape[1]):
        _, _, d_at, sc_at = _q6_k_half(values, d, g, b, 0, 0)
        _q6_k_int8_scales(d, sc, d_at, sc_at, scales, 16 * b * LANES, LANES)
        for h in range(2):
            ql_at, qh_at, _, _ = _q6_k_half(values, d, g, b, h, 0)
            for m in range(8):  # the words of columns 4·m … 4·m + 3 of each run
                word, column = 4 * LANES * m, 256 * b + 128 * h + 4 * m
                _q6_k_int8_columns(values, ql_at + word, qh_at + word, out, column * LANES, LANES)


def q6_k_gguf_blocks(values: np.ndarray, d: np.ndarray, sc: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a packed Q6_K matrix as the GGUF's blocks again [len(ids), bytes per row]."""
    g, lane = ids // LANES, ids % LANES
    n = len(ids)
    words = values.reshape(values.shape[0], -1, LANES, 4)[g, :, lane]  # [n, 3·n_cols / 16, 4]: a row's bytes
    ql_qh = words.reshape(n, -1, Q6_K_BLOCK_BYTES)
    scales = sc[g, :, lane].view(np.uint8).reshape(n, -1, 16)
    halves = d[g, :, lane].astype(np.float16).view(np.uint8).reshape(n, -1, 2)  # (exact: d was a float16)
    return np.concatenate([ql_qh, scales, halves], axis=2).reshape(n, -1)


def q6_k_layout(groups: int, n_cols: int) -> list[tuple[tuple[int, ...], type]]:
    """The arrays of a Q6_K matrix (quants.layout): its ql and qh bytes, d as float32 and the scales as
    int8, for each group of LANES rows: 212 bytes per 256 weights where int8 takes 320."""
    return [
        ((groups, 3 * n_cols // 4, LANES), np.uint8),
        ((groups, n_cols // 256, LANES), F32),
        ((groups, n_cols // 16, LANES), np.int8),
    ]


def layout(groups: int, n_cols: int) -> list[tuple[tuple[int, ...], type]]:
    """The arrays of a Q4_K matrix (quants.layout): its nibbles, d/dmin as float16 bits, and the 6-bit
    scales a byte each, for each group of LANES rows: 148 bytes per 256 weights where int8 takes 320."""
    return [
        ((groups, n_cols // 2, LANES), np.uint8),
        ((groups, n_cols // 256, 2, LANES), np.uint16),
        ((groups, n_cols // 256, 16, LANES), np.uint8),
    ]


@dataclass
class StackedMatrix:
    """Packed matrices with the same columns whose rows stack: one product each, side by side. Q4_K's q
    and k joined with a Q6_K v into one int8 matrix would take 2.5x their bytes, which decode reads
    every token."""

    parts: list  # quants.PackedMatrix
    in_q4_k = False

    @property
    def n_rows(self) -> int:
        return sum(p.n_rows for p in self.parts)

    @property
    def n_cols(self) -> int:
        return self.parts[0].n_cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
