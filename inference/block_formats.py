"""Formats kept as the GGUF's own blocks: Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, NVFP4, the IQ1–IQ3 formats,
TQ1_0, TQ2_0 and Q1_0, and the kernels' half of reading them.

Each block of these formats holds 32 to 256 weights of a row in a few bytes (ggml-common.h's block_*
structs). Packed, LANES rows are interleaved as in quants.py and every byte keeps its place in its
block: values [groups, blocks per row, block bytes, LANES] uint8, byte k of block b of row g·L + lane
at values[g, b, k, lane]: exactly the GGUF's bytes (rows padded to a multiple of LANES). The packed
block size tells the kernels the format, so one compiled kernel reads them all: where two formats'
blocks are the same size (IQ3_S and Q3_K, TQ2_0 and IQ2_XXS, Q1_0 and IQ4_NL), the later one's blocks
end in a byte of padding (PACKED_BYTES).

A kernel decodes each group of LANES rows into a float32 tile (decode_group), each weight exactly as
gguf.quants dequantizes it (its float32 operations in its order; the IQ formats through their tables of
values and grids, NVFP4's scales through its 256, gguf.quants' own), the bytes of LANES rows side by
side so that each step runs across the lanes in vectors. Then the float32 kernels multiply the tile
(products._block_product), so a product is bit for bit the one of the same matrix dequantized to
float32, at a fifth to a twenty-seventh of its bytes. One row (a decoded token) takes no tile of the group:
one_row_group multiplies each weight in as it is decoded, in the same order, so with the same bits (the
formats of indices into a table and Q1_0's bits in registers, the others a run of 32 columns at a time).
gguf.quants.dequantize is each format's plain reference (ggml_quants.dequantize: Q1_0's ported from
ggml-quants.c; rows, and one_row_reference for a row's product): the tests hold the kernels to it. The
IQ1–IQ3, ternary and binary formats' decoders: grid_formats.py.
"""

from __future__ import annotations

import gguf
import numpy as np
from numba import carray

from . import ggml_quants
from . import grid_formats as grids
from .block_vectors import _column_multiply_add, _e8m0_halves, _scaled_multiply_add, _sign_bit_scales
from .cpu import PROFILE
from .grid_formats import _half_at
from .jit import njit
from .vectors import _bit_fields, _prefetch, _q3_k_quants, _registers, _table_fields

Q = gguf.GGMLQuantizationType
LANES = PROFILE.lanes
RUN = 32  # columns decoded at a time: a sub-block of every format here
K_RUNS = 256 // RUN  # runs in a block of 256 weights (Q2_K, Q3_K, IQ4_XS)
Q1_0_WEIGHTS = gguf.GGML_QUANT_SIZES[Q.Q1_0][0]  # a block's
RUN_FLOATS = RUN * LANES  # a run's tile (a literal, as _registers wants it)
F32 = np.float32
BLOCK_FORMATS = (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4) + (
    (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0)  # grid_formats.py
) + (Q.NVFP4, Q.Q1_0)  # (Q1_0: grid_formats.py)


def _packed_bytes() -> dict[Q, int]:
    """Each format's block size as packed: its GGUF block's, a byte more where an earlier format has it."""
    sizes: dict[Q, int] = {}
    for qtype in BLOCK_FORMATS:
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        sizes[qtype] = size + 1 if size in sizes.values() else size
    return sizes


PACKED_BYTES = _packed_bytes()
_Q2_K, _Q3_K, _IQ4_NL, _IQ4_XS, _MXFP4 = (PACKED_BYTES[q] for q in BLOCK_FORMATS[:5])  # bytes a block
_IQ2_XXS, _IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M, _TQ1_0, _TQ2_0, _NVFP4, _Q1_0 = (
    PACKED_BYTES[q] for q in BLOCK_FORMATS[5:]
)
# the IQ formats' 16 values of a 4-bit index (int8 as floats, exact), gguf.quants' tables
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, F32)
MXFP4_VALUES = np.array(gguf.quants.MXFP4.kvalues, F32)  # e2m1, doubled: the scale is halved to match
# NVFP4's scales: the 256 bytes of UE4M3 as float32, halved to match (gguf.quants' ue4m3_to_fp32, exact)
UE4M3_HALVES = np.asarray(gguf.quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), F32)


def format_of(values: np.ndarray) -> Q:
    """The format of a matrix packed here, by its packed block size."""
    return next(q for q in BLOCK_FORMATS if PACKED_BYTES[q] == values.shape[2])


def n_cols_of(values: np.ndarray) -> int:
    return values.shape[1] * gguf.GGML_QUANT_SIZES[format_of(values)][0]


def packed_rows(raw: np.ndarray, qtype: Q, n_rows: int) -> np.ndarray:
    """A tensor's GGUF bytes as rows [n_rows, row bytes] of its packed blocks (padded where PACKED_BYTES
    says: a copy then)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(n_rows, -1, block_bytes)
    padding = PACKED_BYTES[qtype] - block_bytes
    if padding:
        blocks = np.pad(blocks, ((0, 0), (0, 0), (0, padding)))
    return blocks.reshape(n_rows, -1)


def gguf_rows(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a packed matrix as float32, dequantized by gguf.quants from their GGUF bytes."""
    qtype = format_of(values)
    blocks = values[ids // LANES, :, : gguf.GGML_QUANT_SIZES[qtype][1], ids % LANES]  # [n, blocks, bytes]
    return np.asarray(ggml_quants.dequantize(blocks.reshape(len(ids), -1), qtype), F32)


# The decoders write run k of block b of group g's LANES rows into columns c0… of tile [n_cols, LANES],
# indexing element by element: a view (values[g, b], tile[j]) would count a reference to its array,
# an atomic operation the threads contend for. Their loops over the lanes run from 0 to LANES, a
# constant, so that numba's wrap-around of negative indices folds away: with a variable start, the
# loops were gathers and scatters instead of vector loads and stores.


@njit(cache=True)
def _q2_k_run(values, g, b, k, tile, c0):
    """Run k of Q2_K block b (84 bytes): a 4-bit scale and min a byte for each 16 weights (bytes 0-15),
    2-bit quants (16-79: weight j of run k at bits 2·(k % 4) of byte 16 + 32·(k // 4) + j), d and dmin
    (80, 82). Weight = d·sc·q − dmin·m."""
    dl, ml = carray(_registers(LANES), LANES), carray(_registers(LANES), LANES)
    q = _registers(LANES)
    quants = carray(q, LANES)
    shift, block = 2 * (k % 4), (g * values.shape[1] + b) * values.shape[2]
    for h in range(2):
        for lane in range(LANES):
            s = values[g, b, 2 * k + h, lane]
            dl[lane] = _half_at(values, g, b, 80, lane) * F32(s & 15)
            ml[lane] = _half_at(values, g, b, 82, lane) * F32(s >> 4)
        for j in range(16 * h, 16 * h + 16):
            _bit_fields(values, (block + 16 + 32 * (k // 4) + j) * LANES, shift, 3, q, LANES)
            for lane in range(LANES):
                tile[c0 + j, lane] = dl[lane] * quants[lane] - ml[lane]


@njit(cache=True)
def _q3_k_run(values, g, b, k, tile, c0):
    """Run k of Q3_K block b (110 bytes): the high bits (0-31: weight j of run k at bit k of byte j),
    2-bit low bits (32-95, as Q2_K's), 6-bit signed scales for each 16 weights (96-107: low 4 bits in
    nibbles of 96-103, high 2 in pairs of 104-107) and d (108). Weight = d·(sc − 32)·q, q the low
    bits less 4 where the high bit is clear."""
    dl = carray(_registers(LANES), LANES)
    q = _registers(LANES)
    quants = carray(q, LANES)
    shift, block = 2 * (k % 4), (g * values.shape[1] + b) * values.shape[2]
    for h in range(2):
        s = 2 * k + h
        for lane in range(LANES):
            low_bits = (values[g, b, 96 + s % 8, lane] >> (4 * (s // 8))) & 15
            high_bits = (values[g, b, 104 + s % 4, lane] >> (2 * (s // 4))) & 3
            dl[lane] = _half_at(values, g, b, 108, lane) * F32((low_bits | (high_bits << 4)) - 32)
        for j in range(16 * h, 16 * h + 16):
            low_at, high_at = (block + 32 + 32 * (k // 4) + j) * LANES, (block + j) * LANES
            _q3_k_quants(values, low_at, shift, high_at, k, q, LANES)
            for lane in range(LANES):
                tile[c0 + j, lane] = dl[lane] * quants[lane]


@njit(cache=True, inline="always")
def _table_nibbles(values, g, b, at, n, scale, table, tile, c0):
    """2n weights from the n bytes at `at` of block b into tile columns c0…: the low nibbles are weights
    0…n − 1, the high ones n…2n − 1, each scale · table[nibble] (the IQ formats' values, e2m1's)."""
    picked = _registers(LANES)
    value = carray(picked, LANES)
    block = (g * values.shape[1] + b) * values.shape[2]
    for j in range(n):
        for half in range(2):
            _table_fields(values, (block + at + j) * LANES, 4 * half, table, picked, LANES)
            for lane in range(LANES):
                tile[c0 + n * half + j, lane] = scale[lane] * value[lane]


@njit(cache=True, inline="always")
def _table_pieces(block_bytes):
    """The pieces of a run (32 weights) of a format of 4-bit indices into a table: a scale each."""
    return 2 if block_bytes == _NVFP4 else 1


@njit(cache=True, inline="always")
def _table_piece_scale(values, g, b, k, p, scale):
    """Piece p of run k of block b of a format of 4-bit indices into a table: its scale for LANES lanes,
    where its n bytes of indices lie in the block (their low nibbles are the piece's weights 0…n − 1,
    the high ones n…2n − 1; weight = scale · table[index]), n, and its table. IQ4_NL (18 bytes, one run
    of one piece): d, then the indices into IQ4_VALUES. IQ4_XS (136 bytes, a piece a run): d, the high 2
    bits of 8 scales (a uint16 at 2), their low 4 (nibbles of 4-7), then the runs' indices into
    IQ4_VALUES (8…); scale = d·(sc − 32). MXFP4 (17 bytes, one run of one piece): a power of two e
    (E8M0), then e2m1 indices into MXFP4_VALUES; the scale is half of 2^(e − 127), as
    ggml_e8m0_to_fp32_half. NVFP4 (36 bytes, two runs of two pieces of 16 weights): a UE4M3 scale for
    each piece s = 2k + p (bytes 0-3), then each piece's 8 bytes of e2m1 indices (4 + 8s…); the scale
    is halved, as ggml_ue4m3_to_fp32 (UE4M3_HALVES)."""
    d = carray(scale, LANES)
    block_bytes = values.shape[2]
    if block_bytes == _MXFP4:
        _e8m0_halves(values, (g * values.shape[1] + b) * block_bytes * LANES, scale, LANES)
        return 1, 16, MXFP4_VALUES
    if block_bytes == _NVFP4:
        s = 2 * k + p
        for lane in range(LANES):
            d[lane] = UE4M3_HALVES[values[g, b, s, lane]]
        return 4 + 8 * s, 8, MXFP4_VALUES  # (NVFP4's e2m1 values are MXFP4's)
    if block_bytes == _IQ4_NL:
        for lane in range(LANES):
            d[lane] = _half_at(values, g, b, 0, lane)
        return 2, 16, IQ4_VALUES
    for lane in range(LANES):
        low = (values[g, b, 4 + k // 2, lane] >> (4 * (k % 2))) & 15
        high = (values[g, b, 2 + k // 4, lane] >> (2 * (k % 4))) & 3
        d[lane] = _half_at(values, g, b, 0, lane) * F32((low | (high << 4)) - 32)
    return 8 + 16 * k, 16, IQ4_VALUES


@njit(cache=True)
def _table_run(values, g, b, k, tile, c0):
    """Run k of block b of IQ4_NL, IQ4_XS, MXFP4 or NVFP4 (_table_piece_scale)."""
    scale = _registers(LANES)
    for p in range(_table_pieces(values.shape[2])):
        at, n, table = _table_piece_scale(values, g, b, k, p, scale)
        _table_nibbles(values, g, b, at, n, carray(scale, LANES), table, tile, c0 + 2 * n * p)


@njit(cache=True, inline="always")
def _runs_a_block(block_bytes):
    """Runs of 32 weights in a block of the format of that packed size."""
    if block_bytes in (_IQ4_NL, _MXFP4):
        return 1
    if block_bytes == _NVFP4:
        return 2
    if block_bytes == _Q1_0:
        return 4
    return K_RUNS


@njit(cache=True)
def _decode_run(values, g, r, tile, c0):
    """Run r (32 columns) of group g's LANES rows into tile columns c0…, each weight as gguf.quants
    dequantizes it."""
    block_bytes = values.shape[2]
    runs = _runs_a_block(block_bytes)
    b, k = r // runs, r % runs  # (run k of block b)
    if block_bytes == _Q2_K:
        _q2_k_run(values, g, b, k, tile, c0)
    elif block_bytes == _Q3_K:
        _q3_k_run(values, g, b, k, tile, c0)
    elif block_bytes in (_IQ4_XS, _IQ4_NL, _MXFP4, _NVFP4):
        _table_run(values, g, b, k, tile, c0)
    elif block_bytes == _Q1_0:
        grids._q1_0_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ2_XXS:
        grids._iq2_xxs_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ2_XS:
        grids._iq2_xs_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ2_S:
        grids._iq2_s_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ3_XXS:
        grids._iq3_xxs_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ3_S:
        grids._iq3_s_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ1_S:
        grids._iq1_s_run(values, g, b, k, tile, c0)
    elif block_bytes == _IQ1_M:
        grids._iq1_m_run(values, g, b, k, tile, c0)
    elif block_bytes == _TQ1_0:
        grids._tq1_0_run(values, g, b, k, tile, c0)
    else:
        grids._tq2_0_run(values, g, b, k, tile, c0)


@njit(cache=True)
def decode_group(values, g, tile):
    """Group g's LANES rows as float32 into tile [n_cols, LANES], each weight as gguf.quants
    dequantizes it, a run of 32 columns at a time."""
    for r in range(tile.shape[0] // RUN):
        _decode_run(values, g, r, tile, RUN * r)


@njit(cache=True)
def one_row_group(values, x, out, g):
    """out[0, g·L … g·L + L − 1] = x[0] times group g's LANES rows, each weight read once from its block: the
    formats of indices into a table (MXFP4, NVFP4, IQ4_NL, IQ4_XS) decoded in registers (_table_one_row),
    Q1_0's from its sign bits in registers (_q1_0_one_row), the others' a run of 32 columns at a time into
    a tile that stays in the core's first cache. Column by column, one fused multiply-add each, as the
    float kernels multiply a tile of the whole group (products._block_product): the same bits, without
    writing the group's tile (its columns times LANES floats) and reading it back."""
    sums = _registers(LANES)
    row = carray(sums, LANES)
    for lane in range(LANES):
        row[lane] = 0
    block_bytes = values.shape[2]
    if block_bytes in (_MXFP4, _NVFP4, _IQ4_NL, _IQ4_XS):
        _table_one_row(values, x, g, sums)
    elif block_bytes == _Q1_0:
        _q1_0_one_row(values, x, g, sums)
    else:
        tile_at = _registers(RUN_FLOATS)
        tile = carray(tile_at, (RUN, LANES))
        runs = _runs_a_block(block_bytes)
        for r in range(x.shape[1] // RUN):
            if r % runs == 0:
                _ask_ahead(values, g, r // runs)
            _decode_run(values, g, r, tile, 0)
            for j in range(RUN):
                _column_multiply_add(sums, tile_at, j * LANES, x[0, RUN * r + j], LANES)
    for lane in range(LANES):
        out[0, g * LANES + lane] = row[lane]


@njit(cache=True, inline="always")
def _ask_ahead(values, g, b):
    """Asks for the weights the profile's distance past the start of group g's block b."""
    block_bytes = values.shape[2]
    at = (g * values.shape[1] + b) * block_bytes * LANES
    for line in range(0, block_bytes * LANES, 64):
        _prefetch(values, at, line)


@njit(cache=True, inline="always")
def _table_one_row(values, x, g, sums):
    """sums[:LANES] += x[0] times group g's LANES rows of MXFP4, NVFP4, IQ4_NL or IQ4_XS blocks, straight
    from their bits: each piece's scale and its nibbles (through the format's table) decoded in
    registers, each weight scale · value as _table_nibbles forms it, then multiplied in, in column
    order."""
    scale, w = _registers(LANES), _registers(LANES)
    runs, pieces = _runs_a_block(values.shape[2]), _table_pieces(values.shape[2])
    for r in range(x.shape[1] // RUN):
        b, k = r // runs, r % runs
        if k == 0:
            _ask_ahead(values, g, b)
        block = (g * values.shape[1] + b) * values.shape[2]
        for p in range(pieces):
            at, n, table = _table_piece_scale(values, g, b, k, p, scale)
            c = RUN * r + 2 * n * p
            for half in range(2):  # low nibbles: the piece's columns 0…n − 1; high: n…2n − 1
                for j in range(n):
                    _table_fields(values, (block + at + j) * LANES, 4 * half, table, w, LANES)
                    _scaled_multiply_add(sums, w, scale, x[0, c + n * half + j], LANES)


@njit(cache=True, inline="always")
def _q1_0_one_row(values, x, g, sums):
    """sums[:LANES] += x[0] times group g's LANES rows of Q1_0 blocks, straight from their bits: each
    weight d or −d by its bit (as grid_formats._q1_0_run forms it), multiplied in, in column order."""
    d, w = _registers(LANES), _registers(LANES)
    scale = carray(d, LANES)
    for b in range(values.shape[1]):
        _ask_ahead(values, g, b)
        block = (g * values.shape[1] + b) * values.shape[2]
        for lane in range(LANES):
            scale[lane] = _half_at(values, g, b, 0, lane)
        for j in range(Q1_0_WEIGHTS):
            _sign_bit_scales(values, (block + 2 + j // 8) * LANES, j % 8, d, w, LANES)
            _column_multiply_add(sums, w, 0, x[0, Q1_0_WEIGHTS * b + j], LANES)


def one_row_reference(values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """one_row_group of every group in plain NumPy: x [1, n_cols] times the rows gguf.quants dequantizes
    from the blocks, [1, groups·LANES], one fused multiply-add a column in column order (float64
    maths rounded once to float32)."""
    w = gguf_rows(values, np.arange(values.shape[0] * LANES))
    sums = np.zeros(len(w), F32)
    for j in range(w.shape[1]):
        sums = (np.float64(1) * w[:, j] * x[0, j] + sums).astype(F32)
    return sums[None]


@njit(cache=True)
def dequantize_tile(values, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies
    (products.tile_product)."""
    tile = np.empty((out.shape[0], LANES), F32)
    for g in range(g0, g1):
        decode_group(values, g, tile)
        c = (g - g0) * LANES
        for j in range(out.shape[0]):
            for lane in range(LANES):
                out[j, c + lane] = tile[j, lane]
