"""Q4_K and Q6_K weights kept in their GGUF bits: the packed layouts, and the kernels' half of reading them.

ggml's K-quant blocks hold 256 weights of a row (gguf.quants, ggml's dequantize_row_q4_K / _q6_K):
- Q4_K, 144 bytes: d and dmin (float16), 12 bytes of 6-bit scales and mins (8 of each, one per run of
  32 weights), 128 bytes of 4-bit values whose byte 32·k + l holds weight 64·k + l in its low nibble
  and weight 64·k + 32 + l in its high one. Weight = d·sc·q − dmin·m.
- Q6_K, 210 bytes: ql (128 bytes of low nibbles), qh (64 bytes of 2-bit pairs), 16 signed 8-bit
  scales (one per run of 16 weights), d (float16). Weight 128·n + 32·k + l (n < 2, k < 4, l < 32) has
  the nibble of ql[64·n + 32·(k % 2) + l] at bit 4·(k // 2) and bits 2·k… of qh[32·n + l] above
  it, less 32; weight = d·sc·(q − 32).

Packed, LANES rows are interleaved as in quants.py, and every byte of values keeps its place in its row:
- Q4_K: values [groups, n_cols / 2, LANES] uint8, byte k of a row's block b at values[g, 128·b + k];
  scales [groups, n_cols / 256, 2, LANES] uint16: the float16 bits of d and dmin; offsets [groups,
  n_cols / 256, 16, LANES] uint8: the 8 scales, then the 8 mins. 148 bytes per 256 weights.
- Q6_K: values [groups, n_cols · 3 / 4, LANES] uint8, ql then qh of block b at values[g, 192·b + k];
  scales [groups, n_cols / 16, LANES] int8; offsets [groups, n_cols / 256, LANES] uint16: d's bits.
  210 bytes per 256 weights, as the GGUF.
where int8 values with a float32 scale (and offset) per 16 or 32 took 320. The kernels shift and mask
a column of bytes into weights and form a run's scale (and offset) once, as gguf.quants does, in
float32: every weight is the GGUF's, bit for bit, and the sums run over the columns in their order.
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import carray

from .cpu import PROFILE
from .jit import njit
from .vectors import _dequantize_bits, _k_scales, _multiply_add, _registers

LANES = PROFILE.lanes
F32 = np.float32
_Q4_K = int(gguf.GGMLQuantizationType.Q4_K)


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


@njit(cache=True, nogil=True)
def _pack_k_blocks(blocks, row0, per_row, values, scales, offsets, qtype, g0, g1):
    """Groups g0…g1 - 1 of Q4_K or Q6_K rows in k_quants.py's layouts: each block's value bytes keep
    their order (a tile of the group's rows, then transposed, as _unpack_blocks), its scales a byte each
    and its float16s their bits."""
    n_rows = blocks.shape[0] // per_row
    size = values.shape[1] // per_row  # value bytes per block
    for g in range(g0, g1):
        lane0, lane1 = max(row0 - g * LANES, 0), min(row0 + n_rows - g * LANES, LANES)
        tile = np.empty((LANES, values.shape[1]), np.uint8)
        for lane in range(lane0, lane1):
            first = (g * LANES + lane - row0) * per_row
            for cb in range(per_row):
                block = blocks[first + cb]
                if qtype == _Q4_K:  # d, dmin; 8 scales and 8 mins; qs
                    for k in range(2):
                        scales[g, cb, k, lane] = np.uint16(block[2 * k]) | (np.uint16(block[2 * k + 1]) << 8)
                    for sub in range(8):
                        offsets[g, cb, sub, lane], offsets[g, cb, 8 + sub, lane] = _scale_min_k4(sub, block)
                    tile[lane, size * cb : size * (cb + 1)] = block[16:]
                else:  # Q6_K: ql and qh; 16 scales; d
                    for sub in range(16):
                        scales[g, cb, sub, lane] = np.int8(block[192 + sub])
                    offsets[g, cb, 0, lane] = np.uint16(block[208]) | (np.uint16(block[209]) << 8)
                    tile[lane, size * cb : size * (cb + 1)] = block[:192]
        _store(tile, values, g, lane0, lane1)


# A run: the columns that share one scale (32 in Q4_K, 16 in Q6_K). Where run r of group g lies, from
# lane lane0 on: the flat indices of its d and its scale, of its first column's bytes and of its high
# bits' bytes (Q6_K), and its first column. The bit their weights start at is a literal where the runs
# are visited (_dequantize_bits): a shift by a variable took Q4_K from 0.9 to 0.8 of int8's speed
# and Q6_K to half of it.


@njit(cache=True, inline="always")
def _q4_k_run(values, g, r, lane0):
    n_bytes, lanes = values.shape[1], values.shape[2]
    block = g * (n_bytes // 128) + r // 8
    d_at, sc_at = (block * 2) * lanes + lane0, (block * 16 + r % 8) * lanes + lane0
    return d_at, sc_at, (g * n_bytes + 32 * (r // 2)) * lanes + lane0, 0, 32 * r


@njit(cache=True, inline="always")
def _q6_k_run(values, g, r, lane0):
    n_bytes, lanes = values.shape[1], values.shape[2]
    n, k, h = (r % 16) // 8, (r % 8) // 2, r % 2
    ql = (g * n_bytes + 192 * (r // 16)) * lanes + lane0
    low_at = ql + (64 * n + 32 * (k % 2) + 16 * h) * lanes
    high_at = ql + (128 + 32 * n + 16 * h) * lanes
    d_at, sc_at = (g * (n_bytes // 192) + r // 16) * lanes + lane0, (g * (n_bytes // 12) + r) * lanes + lane0
    return d_at, sc_at, low_at, high_at, 256 * (r // 16) + 128 * n + 32 * k + 16 * h


@njit(cache=True, inline="always")
def _run_sums(values, halves, small, x, i0, sums, w, scale, offset, run, size, shift, high_shift, high_bits, rows, width):
    """One run's columns, dequantized `width` lanes at a time, multiplied into the sums of `rows` rows."""
    lanes = values.shape[2]
    d_at, sc_at, at, high_at, j = run
    _k_scales(halves, small, d_at, sc_at, lanes, scale, offset, width)
    for t in range(size):
        _dequantize_bits(values, at + t * lanes, shift, high_at + t * lanes, high_shift, high_bits, scale, offset, w, width)
        for i in range(rows):
            _multiply_add(sums, i, w, x[i0 + i, j + t], width)


@njit(cache=True, inline="always")
def accumulate_q4_k(values, scales, offsets, x, i0, g, lane0, sums, w, rows, width):
    """kernels._accumulate for Q4_K: sums[i, r] = Σ_j w[g·L + lane0 + r, j] · x[i0 + i, j] for i < rows,
    r < width, j in column order, one fused multiply-add at a time (the int8 layout's arithmetic)."""
    scale, offset = _registers(width), _registers(width)
    for k in range(rows * width):
        sums[k] = 0
    for r in range(0, x.shape[1] // 32, 2):  # a run of low nibbles, then the run in their high ones
        low, high = _q4_k_run(values, g, r, lane0), _q4_k_run(values, g, r + 1, lane0)
        _run_sums(values, scales, offsets, x, i0, sums, w, scale, offset, low, 32, 0, 0, 0, rows, width)
        _run_sums(values, scales, offsets, x, i0, sums, w, scale, offset, high, 32, 4, 0, 0, rows, width)


@njit(cache=True, inline="always")
def _q6_k_pair(values, scales, offsets, x, i0, g, lane0, sums, w, scale, r, shift, high_shift, rows, width):
    """Runs r and r + 1 of Q6_K: 32 columns whose bits start at the same places in their bytes."""
    for run in (_q6_k_run(values, g, r, lane0), _q6_k_run(values, g, r + 1, lane0)):
        _run_sums(values, offsets, scales, x, i0, sums, w, scale, None, run, 16, shift, high_shift, 2, rows, width)


@njit(cache=True, inline="always")
def accumulate_q6_k(values, scales, offsets, x, i0, g, lane0, sums, w, rows, width):
    """accumulate_q4_k for Q6_K (offsets holds d: no offset)."""
    scale = _registers(width)
    for k in range(rows * width):
        sums[k] = 0
    for r in range(0, x.shape[1] // 16, 8):  # 128 columns: ql's low nibbles, then its high ones
        _q6_k_pair(values, scales, offsets, x, i0, g, lane0, sums, w, scale, r, 0, 0, rows, width)
        _q6_k_pair(values, scales, offsets, x, i0, g, lane0, sums, w, scale, r + 2, 0, 2, rows, width)
        _q6_k_pair(values, scales, offsets, x, i0, g, lane0, sums, w, scale, r + 4, 4, 4, rows, width)
        _q6_k_pair(values, scales, offsets, x, i0, g, lane0, sums, w, scale, r + 6, 4, 6, rows, width)


@njit(cache=True, inline="always")
def _run_tile(values, halves, small, scale, offset, column, run, size, shift, high_shift, high_bits, out, c):
    """One run's columns into its rows of out, from column c on."""
    d_at, sc_at, at, high_at, j = run
    _k_scales(halves, small, d_at, sc_at, LANES, scale, offset, LANES)
    weights = carray(column, LANES)
    for t in range(size):
        _dequantize_bits(values, at + t * LANES, shift, high_at + t * LANES, high_shift, high_bits, scale, offset, column, LANES)
        row = out[j + t]
        for r in range(LANES):
            row[c + r] = weights[r]


# Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies
# (kernels.tile_product), through the same vector code as the kernels.


@njit(cache=True)
def dequantize_tile_q4_k(values, scales, offsets, g0, g1, out):
    scale, offset, column = _registers(LANES), _registers(LANES), _registers(LANES)
    for g in range(g0, g1):
        c = (g - g0) * LANES
        for r in range(0, out.shape[0] // 32, 2):
            low, high = _q4_k_run(values, g, r, 0), _q4_k_run(values, g, r + 1, 0)
            _run_tile(values, scales, offsets, scale, offset, column, low, 32, 0, 0, 0, out, c)
            _run_tile(values, scales, offsets, scale, offset, column, high, 32, 4, 0, 0, out, c)


@njit(cache=True)
def dequantize_tile_q6_k(values, scales, offsets, g0, g1, out):
    scale, column = _registers(LANES), _registers(LANES)
    for g in range(g0, g1):
        c = (g - g0) * LANES
        for r in range(out.shape[0] // 16):  # (order does not matter here: shifts by the run)
            run = _q6_k_run(values, g, r, 0)
            k = (r % 8) // 2
            if k == 0:
                _run_tile(values, offsets, scales, scale, None, column, run, 16, 0, 0, 2, out, c)
            elif k == 1:
                _run_tile(values, offsets, scales, scale, None, column, run, 16, 0, 2, 2, out, c)
            elif k == 2:
                _run_tile(values, offsets, scales, scale, None, column, run, 16, 4, 4, 2, out, c)
            else:
                _run_tile(values, offsets, scales, scale, None, column, run, 16, 4, 6, 2, out, c)


def gguf_blocks(layout: str, values: np.ndarray, scales: np.ndarray, offsets: np.ndarray, ids: np.ndarray):
    """Rows `ids` of a packed matrix as the GGUF's blocks again [len(ids), bytes per row], for
    gguf.quants to dequantize (a tied embedding table's lookups)."""
    g, lane = ids // LANES, ids % LANES
    n = len(ids)
    if layout == "q6_k":  # ql and qh, scales, d
        parts = (values[g, :, lane], scales[g, :, :, lane].view(np.uint8), offsets[g, :, :, lane].view(np.uint8))
        return np.concatenate([p.reshape(n, -1, size) for p, size in zip(parts, (192, 16, 2))], axis=2).reshape(n, -1)
    sc, m = offsets[g, :, :8, lane], offsets[g, :, 8:, lane]  # [n, blocks, 8]: ggml's 12 bytes again
    packed = np.concatenate(
        [sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6, (sc[..., 4:] & 15) | m[..., 4:] << 4],
        axis=2,
    )
    d_dmin = scales[g, :, :, lane].view(np.uint8)  # [n, blocks, 4]: d, dmin
    return np.concatenate([d_dmin, packed, values[g, :, lane].reshape(n, -1, 128)], axis=2).reshape(n, -1)


GGUF_TYPES = {"q4_k": gguf.GGMLQuantizationType.Q4_K, "q6_k": gguf.GGMLQuantizationType.Q6_K}
ACCUMULATE = {"q4_k": accumulate_q4_k, "q6_k": accumulate_q6_k}
DEQUANTIZE_TILE = {"q4_k": dequantize_tile_q4_k, "q6_k": dequantize_tile_q6_k}


def layout_of(values_dtype, scales_dtype) -> str:
    """Which layout a packed matrix's arrays are: "values" (int8 or float values with float32 scales),
    "q4_k" or "q6_k" (numpy dtypes, or numba's when the kernels compile)."""
    if str(values_dtype) != "uint8":
        return "values"
    return "q4_k" if str(scales_dtype) == "uint16" else "q6_k"
