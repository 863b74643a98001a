"""The kernels' half of reading the IQ1–IQ3 formats, the ternary ones (TQ1_0, TQ2_0) and the binary one
(Q1_0) from their GGUF blocks (block_formats.py's layout: byte k of block b of row g·L + lane at
values[g, b, k, lane]).

The IQ formats keep each 4 or 8 weights of a row as an index into a grid of points (ggml-common.h's
iq2xxs_grid … iq1s_grid), a sign bit per weight (or an index into ksigns, the 128 bytes of 8 signs
with an even count of minus signs) and a scale per 16 or 32 weights. The grids and signs here are
gguf.quants' own (its IQ classes' init_grid), so each weight is the one it dequantizes: its float32
operations in its order. Every decoder writes run k (32 weights) of block b of group g's LANES rows
into columns c0… of tile [n_cols, LANES], as block_formats.decode_group asks; ggml-quants.c's
dequantize_row_iq2_xxs … dequantize_row_tq2_0 and dequantize_row_q1_0 are what each follows.
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import carray

from .block_vectors import _sign_bit_scales
from .cpu import PROFILE
from .half import to_f32
from .jit import njit
from .vectors import _registers

LANES = PROFILE.lanes
F32 = np.float32


def _grid(kind) -> np.ndarray:
    """A format's grid of points [n points, 4 or 8 values] as float32, as gguf.quants decodes it."""
    kind.init_grid()
    return np.ascontiguousarray(kind.grid.reshape(kind.grid_shape), F32)


IQ2_XXS_GRID, IQ2_XS_GRID, IQ2_S_GRID = (
    _grid(gguf.quants.IQ2_XXS),
    _grid(gguf.quants.IQ2_XS),
    _grid(gguf.quants.IQ2_S),
)
IQ3_XXS_GRID, IQ3_S_GRID = _grid(gguf.quants.IQ3_XXS), _grid(gguf.quants.IQ3_S)
IQ1_GRID = _grid(gguf.quants.IQ1_S)  # IQ1_M's too
IQ1_DELTA = F32(gguf.quants.IQ1_S.delta)
KSIGNS = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8).astype(np.int64)  # 7 bits → 8 signs
POWERS_OF_3 = np.array([1, 3, 9, 27, 81], np.int64)  # TQ1_0's digits


@njit(cache=True, inline="always")
def _byte_at(values, g, b, at, lane):
    return np.int64(values[g, b, at, lane])


@njit(cache=True, inline="always")
def _u16_at(values, g, b, at, lane):
    """The little-endian uint16 at bytes at, at + 1 of a lane's block b."""
    return _byte_at(values, g, b, at, lane) | (_byte_at(values, g, b, at + 1, lane) << 8)


@njit(cache=True, inline="always")
def _u32_at(values, g, b, at, lane):
    return _u16_at(values, g, b, at, lane) | (_u16_at(values, g, b, at + 2, lane) << 16)


@njit(cache=True, inline="always")
def _half_at(values, g, b, at, lane):
    """The float16 at bytes at, at + 1 of a lane's block b, as float32 (exact)."""
    return to_f32(np.uint16(_u16_at(values, g, b, at, lane)))


@njit(cache=True, inline="always")
def _signed(w, signs, j):
    """w with bit j of signs as its sign (times −1 where set, exact)."""
    return -w if (signs >> j) & 1 else w


@njit(cache=True, inline="always")
def _signed_points(grid, db, points, signs, bit0, tile, c):
    """Columns c… of tile: for each lane, db · the grid point points[lane] (4 or 8 values), value j signed
    by bit bit0 + j of signs[lane]. Points and signs come as floats (exact: under 2^11), a register each,
    so that the loop over the lanes runs in vectors."""
    for j in range(grid.shape[1]):
        for lane in range(LANES):
            w = db[lane] * grid[np.int64(points[lane]), j]
            tile[c + j, lane] = _signed(w, np.int64(signs[lane]), bit0 + j)


@njit(cache=True, inline="always")
def _iq2_scale(d, sc):
    """The IQ2 formats' scale of a 4-bit sc: d·(0.5 + sc)·0.25, rounded as gguf.quants rounds it."""
    return d * (F32(0.5) + F32(sc)) * F32(0.25)


@njit(cache=True, inline="always")
def _iq2_nibble_scales(values, g, b, at, h, db):
    """db[lane] = the IQ2 scale of nibble h of byte `at` (IQ2_XS's and IQ2_S's 16 weights' scales)."""
    for lane in range(LANES):
        db[lane] = _iq2_scale(
            _half_at(values, g, b, 0, lane), (_byte_at(values, g, b, at, lane) >> (4 * h)) & 15
        )


@njit(cache=True)
def _iq2_xxs_run(values, g, b, k, tile, c0):
    """Run k of IQ2_XXS block b (66 bytes): d, then two uint32 a run (2 + 8k): four grid indices in the
    bytes of the first, four 7-bit sign indices and a 4-bit scale (bits 28-31) in the second.
    Weight = d·(0.5 + sc)·0.25·grid·sign."""
    db, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    signs = carray(_registers(LANES), LANES)
    at = 2 + 8 * k
    for lane in range(LANES):
        db[lane] = _iq2_scale(_half_at(values, g, b, 0, lane), _byte_at(values, g, b, at + 7, lane) >> 4)
    for i in range(4):
        for lane in range(LANES):
            signs[lane] = KSIGNS[(_u32_at(values, g, b, at + 4, lane) >> (7 * i)) & 127]
            points[lane] = _byte_at(values, g, b, at + i, lane)
        _signed_points(IQ2_XXS_GRID, db, points, signs, 0, tile, c0 + 8 * i)


@njit(cache=True)
def _iq2_xs_run(values, g, b, k, tile, c0):
    """Run k of IQ2_XS block b (74 bytes): d, 32 uint16 (2…: a 9-bit grid index and a 7-bit sign index
    each, four a run), then a 4-bit scale for each 16 weights (nibbles of 66-73).
    Weight = d·(0.5 + sc)·0.25·grid·sign."""
    db, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    signs = carray(_registers(LANES), LANES)
    for i in range(4):
        if i % 2 == 0:
            _iq2_nibble_scales(values, g, b, 66 + k, i // 2, db)
        for lane in range(LANES):
            q = _u16_at(values, g, b, 2 + 8 * k + 2 * i, lane)
            signs[lane], points[lane] = KSIGNS[q >> 9], q & 511
        _signed_points(IQ2_XS_GRID, db, points, signs, 0, tile, c0 + 8 * i)


@njit(cache=True)
def _iq2_s_run(values, g, b, k, tile, c0):
    """Run k of IQ2_S block b (82 bytes): d, the low 8 bits of 32 grid indices (2…), a byte of 8 signs
    for each (34…), their high 2 bits (pairs of 66-73), a 4-bit scale for each 16 weights (nibbles of
    74-81). Weight = d·(0.5 + sc)·0.25·grid·sign."""
    db, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    signs = carray(_registers(LANES), LANES)
    for i in range(4):
        if i % 2 == 0:
            _iq2_nibble_scales(values, g, b, 74 + k, i // 2, db)
        for lane in range(LANES):
            high = (_byte_at(values, g, b, 66 + k, lane) >> (2 * i)) & 3
            points[lane] = _byte_at(values, g, b, 2 + 4 * k + i, lane) | (high << 8)
            signs[lane] = _byte_at(values, g, b, 34 + 4 * k + i, lane)
        _signed_points(IQ2_S_GRID, db, points, signs, 0, tile, c0 + 8 * i)


@njit(cache=True)
def _iq3_xxs_run(values, g, b, k, tile, c0):
    """Run k of IQ3_XXS block b (98 bytes): d, 8 grid indices of 4 weights a run (2 + 8k…), then a
    uint32 a run (66 + 4k): four 7-bit sign indices and a 4-bit scale (bits 28-31).
    Weight = d·(0.5 + sc)·0.5·grid·sign."""
    db, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    signs = carray(_registers(LANES), LANES)
    for lane in range(LANES):
        sc = F32(_byte_at(values, g, b, 69 + 4 * k, lane) >> 4)
        db[lane] = _half_at(values, g, b, 0, lane) * (F32(0.5) + sc) * F32(0.5)
    for i in range(8):  # 4 weights each, 8 signs for two
        for lane in range(LANES):
            signs[lane] = KSIGNS[(_u32_at(values, g, b, 66 + 4 * k, lane) >> (7 * (i // 2))) & 127]
            points[lane] = _byte_at(values, g, b, 2 + 8 * k + i, lane)
        _signed_points(IQ3_XXS_GRID, db, points, signs, 4 * (i % 2), tile, c0 + 4 * i)


@njit(cache=True)
def _iq3_s_run(values, g, b, k, tile, c0):
    """Run k of IQ3_S block b (110 bytes): d, the low 8 bits of 64 grid indices of 4 weights (2…), their
    high bits (bits of 66-73), a byte of 8 signs for each 8 weights (74…), a 4-bit scale a run (nibbles
    of 106-109). Weight = d·(1 + 2·sc)·grid·sign."""
    db, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    signs = carray(_registers(LANES), LANES)
    for lane in range(LANES):
        sc = (_byte_at(values, g, b, 106 + k // 2, lane) >> (4 * (k % 2))) & 15
        db[lane] = _half_at(values, g, b, 0, lane) * F32(1 + 2 * sc)
    for i in range(8):
        for lane in range(LANES):
            high = (_byte_at(values, g, b, 66 + k, lane) >> i) & 1
            points[lane] = _byte_at(values, g, b, 2 + 8 * k + i, lane) | (high << 8)
            signs[lane] = _byte_at(values, g, b, 74 + 4 * k + i // 2, lane)
        _signed_points(IQ3_S_GRID, db, points, signs, 4 * (i % 2), tile, c0 + 4 * i)


@njit(cache=True, inline="always")
def _iq1_points(dl, points, delta, tile, c):
    """Columns c… of tile: for each lane, dl · (the IQ1 grid point points[lane] + delta), as gguf.quants
    rounds it (points as floats: _signed_points)."""
    for j in range(8):
        for lane in range(LANES):
            tile[c + j, lane] = dl[lane] * (IQ1_GRID[np.int64(points[lane]), j] + delta[lane])


@njit(cache=True)
def _iq1_s_run(values, g, b, k, tile, c0):
    """Run k of IQ1_S block b (50 bytes): d, the low 8 bits of 32 grid indices (2…), then a uint16 a run
    (34 + 2k): the high 3 bits of its four indices, a 3-bit scale (bits 12-14), the delta's sign (15).
    Weight = d·(2·sc + 1)·(grid ± 0.125)."""
    dl, delta = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    points = carray(_registers(LANES), LANES)
    for lane in range(LANES):
        qh = _u16_at(values, g, b, 34 + 2 * k, lane)
        dl[lane] = _half_at(values, g, b, 0, lane) * F32(2 * ((qh >> 12) & 7) + 1)
        delta[lane] = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
    for i in range(4):
        for lane in range(LANES):
            high = (_u16_at(values, g, b, 34 + 2 * k, lane) >> (3 * i)) & 7
            points[lane] = _byte_at(values, g, b, 2 + 4 * k + i, lane) | (high << 8)
        _iq1_points(dl, points, delta, tile, c0 + 8 * i)


@njit(cache=True)
def _iq1_m_run(values, g, b, k, tile, c0):
    """Run k of IQ1_M block b (56 bytes): the low 8 bits of 32 grid indices (0…), a nibble for each
    (32…: its high 3 bits and the delta's sign), four uint16 (48…) holding a 3-bit scale for each 16
    weights and, in their top nibbles, d. Weight = d·(2·sc + 1)·(grid ± 0.125)."""
    d, dl = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    delta, points = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    for lane in range(LANES):
        d_bits = 0
        for m in range(4):
            d_bits |= ((_byte_at(values, g, b, 49 + 2 * m, lane) >> 4) & 15) << (4 * m)
        d[lane] = to_f32(np.uint16(d_bits))
    for i in range(4):
        s = 2 * k + i // 2  # the scale of weights 16·s…
        for lane in range(LANES):
            sc = (_u16_at(values, g, b, 48 + 2 * (s // 4), lane) >> (3 * (s % 4))) & 7
            dl[lane] = d[lane] * F32(2 * sc + 1)
            qh = _byte_at(values, g, b, 32 + 2 * k + i // 2, lane) >> (4 * (i % 2))
            delta[lane] = -IQ1_DELTA if qh & 8 else IQ1_DELTA
            points[lane] = _byte_at(values, g, b, 4 * k + i, lane) | ((qh & 7) << 8)
        _iq1_points(dl, points, delta, tile, c0 + 8 * i)


@njit(cache=True)
def _tq1_0_run(values, g, b, k, tile, c0):
    """Run k of TQ1_0 block b (54 bytes): five ternary digits a byte (0-47: weights 0-159 in 32 bytes,
    160-239 in 16; 48-51: 240-255, four a byte), then d (52). The n-th digit of byte q is
    (q·3ⁿ mod 256)·3 >> 8. Weight = d·(digit − 1)."""
    d = carray(_registers(LANES), LANES)
    for lane in range(LANES):
        d[lane] = _half_at(values, g, b, 52, lane)
    for j in range(32):
        w = 32 * k + j
        if w < 160:
            at, power = w % 32, w // 32
        elif w < 240:
            at, power = 32 + (w - 160) % 16, (w - 160) // 16
        else:
            at, power = 48 + (w - 240) % 4, (w - 240) // 4
        for lane in range(LANES):
            digit = (((_byte_at(values, g, b, at, lane) * POWERS_OF_3[power]) & 255) * 3) >> 8
            tile[c0 + j, lane] = d[lane] * F32(digit - 1)


@njit(cache=True)
def _tq2_0_run(values, g, b, k, tile, c0):
    """Run k of TQ2_0 block b (66 bytes): 2-bit quants (weight j of run k at bits 2·(k % 4) of byte
    32·(k // 4) + j), then d (64). Weight = d·(q − 1)."""
    d = carray(_registers(LANES), LANES)
    for lane in range(LANES):
        d[lane] = _half_at(values, g, b, 64, lane)
    for j in range(32):
        for lane in range(LANES):
            q = (_byte_at(values, g, b, 32 * (k // 4) + j, lane) >> (2 * (k % 4))) & 3
            tile[c0 + j, lane] = d[lane] * F32(q - 1)


@njit(cache=True)
def _q1_0_run(values, g, b, k, tile, c0):
    """Run k of Q1_0 block b (18 bytes, padded to 19): d, then a bit a weight (weight j of run k at bit
    j % 8 of byte 2 + 4k + j // 8). Weight = d where the bit is set, else −d."""
    d, w = _registers(LANES), _registers(LANES)
    scale, weights = carray(d, LANES), carray(w, LANES)
    block = (g * values.shape[1] + b) * values.shape[2]
    for lane in range(LANES):
        scale[lane] = _half_at(values, g, b, 0, lane)
    for j in range(32):
        _sign_bit_scales(values, (block + 2 + 4 * k + j // 8) * LANES, j % 8, d, w, LANES)
        for lane in range(LANES):
            tile[c0 + j, lane] = weights[lane]
