"""Q4_K weights kept in their GGUF bits: the packed layout, and the kernels' half of reading it.

ggml's Q4_K block holds 256 weights of a row in 144 bytes: d and dmin (float16), 12 bytes of 6-bit
sub-block scales and mins (8 of each, one per 32 weights), and 128 bytes of 4-bit values whose byte
32·k + l holds weight 64·k + l in its low nibble and weight 64·k + 32 + l in its high one. Weight
= d·sc·q − dmin·m (gguf.quants, ggml's dequantize_row_q4_K).

Packed, LANES rows are interleaved as in quants.py, and every byte keeps its place in its row:
- qs [groups, n_cols / 2, LANES] uint8: byte k of a row's block b at qs[g, 128·b + k, lane];
- halves [groups, n_cols / 256, 2, LANES] uint16: the float16 bits of d and dmin;
- six_bits [groups, n_cols / 256, 16, LANES] uint8: the 8 sub-block scales, then the 8 mins.
148 bytes per 256 weights (the GGUF's 144, the 6-bit fields a byte each), where int8 values with a
float32 scale and offset per 32 took 320. The kernels shift and mask a column of bytes into weights
and form each sub-block's scale and offset once per pass over it, as gguf.quants does, in float32:
every weight is the GGUF's, bit for bit, and the sums run over the columns in their order.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from .cpu import PROFILE
from .jit import njit
from .vectors import _dequantize_nibbles, _k_scales, _multiply_add, _registers

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
def _sub_block(g, b, n_pairs, lanes, lane0):
    """Where sub-block b (of 32 weights) of group g lies, from lane0 on: the flat index of its d, of
    its 6-bit scale and of its first column's bytes (whose low nibbles are its weights for an even b,
    the high ones for an odd b)."""
    n_super, sub = n_pairs // 128, b % 8
    d_at = ((g * n_super + b // 8) * 2) * lanes + lane0
    sc_at = ((g * n_super + b // 8) * 16 + sub) * lanes + lane0
    return d_at, sc_at, (g * n_pairs + 32 * (b // 2)) * lanes + lane0


@njit(cache=True, inline="always")
def _sub_block_sums(qs, halves, six_bits, x, i0, g, lane0, sums, w, scale, offset, b, shift, rows, width):
    """The 32 columns of sub-block b added into sums, their nibbles taken by `shift` (a literal)."""
    n_pairs, lanes = qs.shape[1], qs.shape[2]
    d_at, sc_at, at = _sub_block(g, b, n_pairs, lanes, lane0)
    _k_scales(halves, six_bits, d_at, sc_at, lanes, scale, offset, width)
    for l in range(32):
        _dequantize_nibbles(qs, at + l * lanes, shift, scale, offset, w, width)
        for i in range(rows):
            _multiply_add(sums, i, w, x[i0 + i, 32 * b + l], width)


@njit(cache=True, inline="always")
def accumulate(qs, halves, six_bits, x, i0, g, lane0, sums, w, rows, width):
    """kernels._accumulate for Q4_K: sums[i, r] = Σ_j w[g·L + lane0 + r, j] · x[i0 + i, j] for i < rows,
    r < width, j in column order, one fused multiply-add at a time (the bytes layout's arithmetic)."""
    scale, offset = _registers(width), _registers(width)
    for k in range(rows * width):
        sums[k] = 0
    for b in range(0, qs.shape[1] // 16, 2):  # sub-blocks in pairs: the low nibbles, then the high
        _sub_block_sums(qs, halves, six_bits, x, i0, g, lane0, sums, w, scale, offset, b, 0, rows, width)
        _sub_block_sums(qs, halves, six_bits, x, i0, g, lane0, sums, w, scale, offset, b + 1, 4, rows, width)


@njit(cache=True, inline="always")
def _sub_block_tile(qs, halves, six_bits, g, b, shift, scale, offset, column, out, c):
    """Sub-block b of group g into its 32 rows of out, from column c on."""
    d_at, sc_at, at = _sub_block(g, b, qs.shape[1], qs.shape[2], 0)
    _k_scales(halves, six_bits, d_at, sc_at, LANES, scale, offset, LANES)
    weights = carray(column, LANES)
    for l in range(32):
        _dequantize_nibbles(qs, at + l * LANES, shift, scale, offset, column, LANES)
        row = out[32 * b + l]
        for r in range(LANES):
            row[c + r] = weights[r]


@njit(cache=True)
def dequantize_tile(qs, halves, six_bits, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies
    (kernels.tile_product), through the same vector code as the kernels."""
    scale, offset, column = _registers(LANES), _registers(LANES), _registers(LANES)
    for g in range(g0, g1):
        for b in range(0, qs.shape[1] // 16, 2):
            _sub_block_tile(qs, halves, six_bits, g, b, 0, scale, offset, column, out, (g - g0) * LANES)
            _sub_block_tile(qs, halves, six_bits, g, b + 1, 4, scale, offset, column, out, (g - g0) * LANES)


def rows(qs: np.ndarray, halves: np.ndarray, six_bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` as float32 [len(ids), n_cols], in NumPy (a tied embedding table's lookups)."""
    g, lane = ids // LANES, ids % LANES
    n = len(ids)
    pairs = qs[g, :, lane].reshape(n, -1, 4, 1, 32)  # [n, blocks, 4, 1, 32]
    q = (pairs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15  # [n, blocks, 4, 2, 32]: column order
    d, dmin = (halves[g, :, k, lane].view(np.float16).astype(F32)[:, :, None] for k in (0, 1))
    scale = d * six_bits[g, :, :8, lane].astype(F32)  # [n, blocks, 8]
    offset = -(dmin * six_bits[g, :, 8:, lane].astype(F32))
    weights = q.reshape(n, -1, 32).astype(F32) * scale.reshape(n, -1, 1) + offset.reshape(n, -1, 1)
    return weights.reshape(n, -1)
