"""GGUF weight formats → the packed layout the kernels read, without losing a bit of what the GGUF holds.

Every integer format of ggml (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is a small signed or
unsigned integer per weight times a float scale per group of 16 or 32 weights, plus a float offset in
the formats with a minimum. Those integers all fit int8, so each format unpacks here into one shape:
int8 values, a float32 scale per group and, where the format has one, a float32 offset per group —
exactly the numbers ggml's `dequantize_row_*` multiplies (ggml-quants.c; one unpacker per format below
follows it line by line). Float tensors (F32, F16, BF16) and the rarer formats keep float32 values.

Packed, 64 rows are interleaved: values [rows/64, cols, 64]; each unpacker writes straight into that. A kernel then runs its vector lanes across
64 rows at once and applies each group's scale once per group, outside the innermost loop (a scale per
32 weights inside a dot product keeps a compiler from vectorizing it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import gguf
import numpy as np

from . import kernels
from .jit import in_cache, njit, prange
from .kernels import LANES

F32 = np.float32


@dataclass
class PackedMatrix:
    """A weight matrix [n_rows, n_cols] as the kernels read it (rows padded to a multiple of LANES)."""

    values: np.ndarray  # [groups, n_cols, LANES] int8, or float32 for float formats
    scales: np.ndarray | None  # [groups, n_cols / group_size, LANES] float32 (None for float values)
    offsets: np.ndarray | None  # same shape as scales, for formats with a minimum (Q4_1, Q5_1, Q4_K, Q5_K)
    n_rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.values.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.values, self.scales, self.offsets) if a is not None)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as float32 [n_blocks]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0].astype(F32)


# One unpacker per format, following ggml's dequantize_row_*: blocks [n_blocks, block_bytes] uint8, in
# row-major order (`per_row` blocks a row) → the integers of each block, written to values[g, col, lane]
# of rows row0… of the packed matrix. The K-quant unpackers also give the scales (and offsets) of their
# sub-blocks [n_blocks, groups_per_block]; for the others those are one float16 per block (see pack).


@njit(cache=True)
def _n_tiles(blocks, per_row):
    """Blocks are visited in tiles of up to 64 rows × one column block: the tile's values land in one
    or two contiguous runs of the packed matrix, not scattered one byte per cache line."""
    return -(-(blocks.shape[0] // per_row) // LANES) * per_row


@njit(cache=True)
def _tile_rows(t, blocks, per_row):
    """The source rows and column block of tile t."""
    n_rows = blocks.shape[0] // per_row
    first = (t // per_row) * LANES
    return first, min(first + LANES, n_rows), t % per_row


@njit(cache=True)
def _at(i, row0, per_row, block_len):
    """Where block i's first weight goes: (group, column, lane)."""
    row = row0 + i // per_row
    return row // LANES, (i % per_row) * block_len, row % LANES


@njit(cache=True)
def _put(out, g, group, lane, repeat, value):
    """A scale (or offset) of source group `group` of a row, `repeat` times: a part whose groups are
    larger than the packed matrix's (32 beside Q6_K's 16) repeats each, which changes no weight."""
    for k in range(repeat):
        out[g, group * repeat + k, lane] = value


@njit(cache=True, parallel=True)
def _unpack_q4_0(blocks, row0, per_row, values, d, scales, repeat):
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 32)
            _put(scales, g, cb, lane, repeat, d[i])
            for j in range(16):
                b = blocks[i, 2 + j]
                values[g, c + j, lane] = (b & 0xF) - 8
                values[g, c + j + 16, lane] = (b >> 4) - 8


@njit(cache=True, parallel=True)
def _unpack_q4_1(blocks, row0, per_row, values, d, m, scales, offsets, repeat):
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 32)
            _put(scales, g, cb, lane, repeat, d[i])
            _put(offsets, g, cb, lane, repeat, m[i])
            for j in range(16):
                b = blocks[i, 4 + j]
                values[g, c + j, lane] = b & 0xF
                values[g, c + j + 16, lane] = b >> 4


@njit(cache=True, parallel=True)
def _unpack_q5(blocks, row0, per_row, values, d, m, scales, offsets, repeat, at_qh, bias):
    """Q5_0 (qh at byte 2, bias 16) and Q5_1 (qh at byte 4, no bias, an offset m): 4 low bits in qs,
    the 5th in qh. Q5_0 passes no offsets (an empty array)."""
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 32)
            _put(scales, g, cb, lane, repeat, d[i])
            if offsets.size:
                _put(offsets, g, cb, lane, repeat, m[i])
            qh = (
                np.uint32(blocks[i, at_qh])
                | (np.uint32(blocks[i, at_qh + 1]) << 8)
                | (np.uint32(blocks[i, at_qh + 2]) << 16)
                | (np.uint32(blocks[i, at_qh + 3]) << 24)
            )
            for j in range(16):
                b = np.uint32(blocks[i, at_qh + 4 + j])
                hi0 = ((qh >> j) << 4) & 0x10
                hi1 = (qh >> (j + 12)) & 0x10
                values[g, c + j, lane] = np.int32((b & 0xF) | hi0) - bias
                values[g, c + j + 16, lane] = np.int32((b >> 4) | hi1) - bias


@njit(cache=True, parallel=True)
def _unpack_q8_0(blocks, row0, per_row, values, d, scales, repeat):
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 32)
            _put(scales, g, cb, lane, repeat, d[i])
            for j in range(32):
                values[g, c + j, lane] = np.int8(blocks[i, 2 + j])  # two's complement byte


@njit(cache=True)
def _scale_min_k4(j, blocks, i):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j, packed in 12 bytes at byte 4."""
    s = 4
    if j < 4:
        return blocks[i, s + j] & 63, blocks[i, s + j + 4] & 63
    sc = (blocks[i, s + j + 4] & 0xF) | ((blocks[i, s + j - 4] >> 6) << 4)
    m = (blocks[i, s + j + 4] >> 4) | ((blocks[i, s + j] >> 6) << 4)
    return sc, m


@njit(cache=True, parallel=True)
def _unpack_qk(blocks, row0, per_row, values, d, dmin, scales, offsets, repeat, five_bits):
    """Q4_K (qs at byte 16) and Q5_K (qh at 16, qs at 48): 8 sub-blocks of 32, each d·sc·q − dmin·m."""
    at_qs = 48 if five_bits else 16
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 256)
            for j in range(4):  # 64 values a step: low nibbles of 32 bytes, then their high nibbles
                for half in range(2):
                    sub = 2 * j + half
                    sc, m = _scale_min_k4(sub, blocks, i)
                    _put(scales, g, cb * 8 + sub, lane, repeat, d[i] * F32(sc))
                    _put(offsets, g, cb * 8 + sub, lane, repeat, -(dmin[i] * F32(m)))
                    for l in range(32):
                        b = blocks[i, at_qs + 32 * j + l]
                        v = (b >> 4) if half else (b & 0xF)
                        if five_bits and (blocks[i, 16 + l] >> sub) & 1:
                            v += 16
                        values[g, c + 64 * j + 32 * half + l, lane] = v


@njit(cache=True, parallel=True)
def _unpack_q6_k(blocks, row0, per_row, values, d, scales, repeat):
    """Q6_K: 16 sub-blocks of 16, each d·sc·(q − 32); 4 low bits in ql (byte 0), 2 high in qh (byte 128)."""
    for t in prange(_n_tiles(blocks, per_row)):
        first, end, cb = _tile_rows(t, blocks, per_row)
        for row in range(first, end):
            i = row * per_row + cb
            g, c, lane = _at(i, row0, per_row, 256)
            for s in range(16):
                _put(scales, g, cb * 16 + s, lane, repeat, d[i] * F32(np.int8(blocks[i, 192 + s])))
            for n in range(2):  # two halves of 128
                for l in range(32):
                    ql0 = blocks[i, 64 * n + l]
                    ql1 = blocks[i, 64 * n + l + 32]
                    qh = blocks[i, 128 + 32 * n + l]
                    at = c + 128 * n + l
                    values[g, at, lane] = np.int32((ql0 & 0xF) | ((qh & 3) << 4)) - 32
                    values[g, at + 32, lane] = np.int32((ql1 & 0xF) | (((qh >> 2) & 3) << 4)) - 32
                    values[g, at + 64, lane] = np.int32((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32
                    values[g, at + 96, lane] = np.int32((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32


@njit(cache=True, parallel=True)
def _interleave_rows(a, row0, out):
    """Rows of a [n, cols] into out [groups, cols, LANES] as rows row0…: out[g, col, lane] = a[row, col]."""
    for i in prange(a.shape[0]):
        row = row0 + i
        g, lane = row // LANES, row % LANES
        for j in range(a.shape[1]):
            out[g, j, lane] = a[i, j]


Q = gguf.GGMLQuantizationType
INTEGER_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
GROUP = {Q.Q6_K: 16}  # weights per scale; 32 for every other integer format
HAS_OFFSETS = (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K)


def pack(parts: list[tuple[np.ndarray, Q, tuple[int, int]]]) -> PackedMatrix:
    """GGUF tensors (bytes [n_rows, row_bytes], type, shape) with the same columns → one PackedMatrix,
    their rows stacked (q/k/v or gate/up: one kernel call for all). Parts of different formats meet on
    the finest group size and zero offsets, which changes no weight; a float part makes it all float32."""
    n_cols = parts[0][2][1]
    n_rows = sum(shape[0] for _, _, shape in parts)
    groups = -(-n_rows // LANES)
    if any(qtype not in INTEGER_FORMATS for _, qtype, _ in parts):
        values = np.zeros((groups, n_cols, LANES), F32)
        row0 = 0
        for raw, qtype, shape in parts:
            _interleave_rows(np.asarray(gguf.quants.dequantize(raw, qtype), F32).reshape(shape), row0, values)
            row0 += shape[0]
        return PackedMatrix(values, None, None, n_rows)
    group = min(GROUP.get(qtype, 32) for _, qtype, _ in parts)
    with_offsets = any(qtype in HAS_OFFSETS for _, qtype, _ in parts)
    values = np.zeros((groups, n_cols, LANES), np.int8)
    scales = np.zeros((groups, n_cols // group, LANES), F32)
    offsets = np.zeros_like(scales) if with_offsets else None
    row0 = 0
    for raw, qtype, shape in parts:
        repeat = GROUP.get(qtype, 32) // group
        _unpack(raw, qtype, shape, row0, values, scales, offsets, repeat)
        row0 += shape[0]
    return PackedMatrix(values, scales, offsets, n_rows)


def _unpack(raw, qtype: Q, shape, row0: int, values, scales, offsets, repeat: int) -> None:
    """Write one integer-format tensor's values, scales and offsets at rows row0… of a packed matrix."""
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    per_row = shape[1] // block_len
    d = _f16(blocks, 208 if qtype == Q.Q6_K else 0)
    if qtype in (Q.Q4_K, Q.Q5_K):
        _unpack_qk(
            blocks, row0, per_row, values, d, _f16(blocks, 2), scales, offsets, repeat, qtype == Q.Q5_K
        )
    elif qtype == Q.Q6_K:
        _unpack_q6_k(blocks, row0, per_row, values, d, scales, repeat)
    elif qtype == Q.Q4_0:
        _unpack_q4_0(blocks, row0, per_row, values, d, scales, repeat)
    elif qtype == Q.Q4_1:
        _unpack_q4_1(blocks, row0, per_row, values, d, _f16(blocks, 2), scales, offsets, repeat)
    elif qtype == Q.Q8_0:
        _unpack_q8_0(blocks, row0, per_row, values, d, scales, repeat)
    elif qtype == Q.Q5_0:
        _unpack_q5(blocks, row0, per_row, values, d, d, scales, scales[:0], repeat, 2, 16)
    else:
        _unpack_q5(blocks, row0, per_row, values, d, _f16(blocks, 2), scales, offsets, repeat, 4, 0)


def compile_kernels(progress=None, formats=None) -> float:
    """Compile (first start) or load from the cache (later starts) the kernels of `formats` (every
    format when None), on a tiny example of each, so that no reply waits on the compiler. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    shape = (LANES, 256)
    unpackers = [
        _unpack_q4_0,
        _unpack_q4_1,
        _unpack_q5,
        _unpack_q8_0,
        _unpack_qk,
        _unpack_q6_k,
        _interleave_rows,
    ]
    cached = all(in_cache(k) for k in (*unpackers, *kernels.COMPILED))
    label = "loading compiled kernels" if cached else "compiling kernels (first start only)"
    wanted = set(INTEGER_FORMATS) | {Q.F32} if formats is None else set(formats)
    formats = [q for q in INTEGER_FORMATS if q in wanted] + ([Q.F32] if wanted - set(INTEGER_FORMATS) else [])
    x = np.zeros((1, shape[1]), F32)
    for i, qtype in enumerate(formats):
        if progress:
            progress(label, i, len(formats))
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        w = pack([(np.zeros((shape[0], shape[1] // block_len * block_bytes), np.uint8), qtype, shape)])
        kernels.matmul(x, w)  # the decode kernels, with and without offsets, float
        if i == 0:
            kernels.matmul(np.zeros((kernels.SMALL_BATCH + 1, shape[1]), F32), w)  # the prefill tiles
    if progress:
        progress(label, len(formats), len(formats))
    return time.perf_counter() - t0
