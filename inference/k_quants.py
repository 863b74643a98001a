"""Q4_K weights kept in their GGUF bits: the packed layout, and the kernels' half of reading it.

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

Q6_K (the output matrix and some ffn_down of a Q4_K_M model) could be kept the same way (ql and qh
bytes, 210 bytes per 256 as the GGUF), but its kernel, six bits from two bytes, costs more CPU time per
product than int8's and much more to compile: it unpacks to int8 as the other formats
(docs/performance.md, "Decode reads every weight once per token").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import carray, types
from numba.extending import overload

from .byte_vectors import _nibble_dots, _nibble_pair_dots
from .cpu import PROFILE
from .jit import njit
from .vectors import (
    _dequantize_nibbles,
    _multiply_add,
    _nibbles,
    _prefetch,
    _q4_k_scales,
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


@njit(cache=True)
def _ask_ahead_run(values, at):
    """Asks ahead for a run's 8 words of every lane, a cache line at a time. A plain call, not inlined by
    numba: inlined, its loops took seconds of a first start to compile at each of their call sites."""
    lanes = values.shape[2]
    for c in range(8):
        for line in range(0, 4 * lanes, 64):
            _prefetch(values, at + 4 * c * lanes, line)


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
    if ahead and shift == 0:  # (the run in the high nibbles reads the same bytes)
        _ask_ahead_run(values, at)
    for c in range(8):  # a word of 4 columns at a time
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
        _ask_ahead_run(values, at)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    xq_at, xs_at = i0 * n_words + 8 * r, 2 * (i0 * n_runs + r) + 1
    _nibble_dots(values, at, lanes, shift, xq, xq_at, n_words, x_runs, xs_at, 2 * n_runs, runs, rows, width)
    _q4_k_scales(scales, offsets, d_at, sc_at, lanes, scale, offset, width)
    for i in range(rows):
        _scale_run(sums, runs, i, scale, offset, x_runs[i0 + i, r, 0], width)


def accumulate_q8(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
    """accumulate for activations in bytes: xq [n, n_cols / 4] the rows' bytes four to a word, x_runs
    [n, n_cols / 32, 2] each run's Σ x and its bytes' scale (activations.quantize_rows). For one row a
    pair of runs is read once (_pair_sums_q8: their sums fit the registers twice), for more a run at
    a time. Compiled code only: the overload below picks by `rows` (a literal), so that each kernel
    compiles one of the two."""
    raise NotImplementedError


@overload(accumulate_q8, inline="always", prefer_literal=True)
def _accumulate_q8_by_rows(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, runs, rows, width, ahead):
    if not isinstance(rows, types.IntegerLiteral):
        return None
    if rows.literal_value == 1:

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
        _ask_ahead_run(values, at)
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
