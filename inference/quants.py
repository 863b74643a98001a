"""GGUF weight formats → the packed layout the kernels read, without losing a bit of what the GGUF holds.

Every integer format of ggml (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is a small signed or
unsigned integer per weight times a float scale per group of 16 or 32 weights, plus a float offset in
the formats with a minimum. Those integers all fit int8, so each format unpacks here into one shape:
int8 values, a float32 scale per group and, where the format has one, a float32 offset per group —
exactly the numbers ggml's `dequantize_row_*` multiplies (ggml-quants.c; one row decoder per format
below follows it line by line). F16 and BF16 keep their 16 bits, F32 and the rarer formats float32.

Packed, LANES rows are interleaved (cpu.py: 64 for AVX-512, fewer for narrower registers): values
[rows/LANES, cols, LANES]. A kernel then runs its vector lanes across LANES rows at once and applies
each group's scale once per group, outside the innermost loop (a scale per 32 weights inside a dot
product keeps a compiler from vectorizing it).

A matrix all in Q4_K (most of a Q4_K_M model's bytes) keeps the GGUF's own bits instead, interleaved
the same way (k_quants.py): int8 with float32 scales is 2.2x its bytes, which decode reads every token
and which RAM holds; so does Q6_K on a processor with VNNI, in a model with no other int8 matrices
(formats.own_bits: int8 is 1.5x its bytes). So do Q2_K, Q3_K, the IQ and TQ formats and MXFP4
(block_formats.py). Which formats join in one matrix, and the arrays each kind packs into: formats.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import gguf
import numba
import numpy as np

from . import block_formats, ggml_quants, k_quants, kernels
from .formats import GROUP, HALF_TYPES, OWN_BITS, SMALL, kind_of, kinds_of, layout, runs_of
from .jit import njit, prange
from .k_quants import StackedMatrix, _scale_min_k4, _store
from .kernels import LANES

F32 = np.float32
Q = gguf.GGMLQuantizationType
# The formats as the kernel sees them (numba reads module constants at compile time).
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = (int(q) for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
_Q4_K, _Q5_K = int(Q.Q4_K), int(Q.Q5_K)


@dataclass
class PackedMatrix:
    """A weight matrix [n_rows, n_cols] as the kernels read it (rows padded to a multiple of LANES)."""

    values: np.ndarray  # [groups, n_cols, LANES] int8, float32 or 16-bit floats' bits; Q4_K: k_quants.py;
    # block formats: [groups, blocks, block bytes, LANES] (block_formats.py)
    scales: np.ndarray | None  # [groups, n_cols / group_size, LANES] float32 (None for float values)
    offsets: np.ndarray | None  # same shape as scales, for formats with a minimum (Q4_1, Q5_1, Q5_K)
    n_rows: int
    activations: str = "f32"  # "q8": its products take their inputs as bytes where they can (kernels.py)
    small: bool = False  # int8 weights all within ±32 (formats.SMALL): byte_vectors' sums add up in 16 bits

    @property
    def in_q4_k(self) -> bool:
        """Q4_K in its own bits: values, scales (d, dmin) and offsets (sc, m) in k_quants.py's layout."""
        return self.values.dtype == np.uint8 and self.values.ndim == 3 and self.scales.dtype == np.uint16

    @property
    def in_q6_k(self) -> bool:
        """Q6_K in its own bits: values (ql, qh), scales (d) and offsets (the int8 sc) in k_quants.py's."""
        return self.values.dtype == np.uint8 and self.values.ndim == 3 and self.offsets.dtype == np.int8

    @property
    def n_cols(self) -> int:
        if self.values.ndim == 4:  # a block format's blocks (block_formats.py)
            return block_formats.n_cols_of(self.values)
        if self.in_q6_k:  # six bits a weight: 3 bytes for 4
            return self.values.shape[1] * 4 // 3
        return self.values.shape[1] * (2 if self.in_q4_k else 1)  # Q4_K: two weights a byte

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_cols

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.values, self.scales, self.offsets) if a is not None)


# One unpacker for every integer format, following ggml's dequantize_row_* (ggml-quants.c) line by line:
# blocks [n_blocks, block_bytes] uint8 of one GGUF tensor, in row-major order (`per_row` blocks a row)
# → its integers at rows row0… of the packed values [groups, n_cols, LANES], and the scale (and offset)
# of each group of weights in scales (offsets) [groups, n_cols / group_size, LANES].
#
# Each packed group (64 rows) is one task: its rows are read in file order and decoded, vectorized
# along the row, into a tile [LANES, n_cols]; then the tile is transposed into the group. Writing
# each weight straight to its lane instead (one byte every 64, and 64 rows of the file read at once)
# took 2–4× the CPU time. The float16 scales are converted here too, not by NumPy beforehand. The row
# decoders are plain calls, not numba's inline="always", which typed a copy per call site: 4.1 s of CPU
# to compile _unpack_blocks on a first start, 2.6 s as calls (the same speed within the noise, as
# LLVM inlines them itself).


@njit(cache=True)
def _half(block, at):
    """The IEEE float16 at byte `at` of a block, as float32 (exact: every float16 is a float32)."""
    h = np.uint32(block[at]) | (np.uint32(block[at + 1]) << 8)
    exponent, mantissa = (h >> 10) & 0x1F, h & 0x3FF
    if exponent == 0:  # zero or subnormal: mantissa · 2^-24
        value = F32(mantissa) * F32(2.0**-24)
        return -value if h & 0x8000 else value
    exponent = np.uint32(0xFF) if exponent == 31 else exponent + 112  # inf and NaN keep all ones
    return np.uint32(((h & 0x8000) << 16) | (exponent << 23) | (mantissa << 13)).view(F32)


@njit(cache=True)
def _put(out, group, lane, repeat, value):
    """A scale (or offset) of source group `group` of a row, `repeat` times: a part whose groups are
    larger than the packed matrix's (32 beside Q6_K's 16) repeats each, which changes no weight."""
    for k in range(repeat):
        out[group * repeat + k, lane] = value


@njit(cache=True)
def _row_q4(row, out, scales, offsets, lane, repeat, has_min):
    """Q4_0 (d, then 16 bytes of nibbles; q − 8) and Q4_1 (d, m, then the nibbles; q)."""
    at = 4 if has_min else 2
    bias = 0 if has_min else 8
    for cb in range(row.shape[0]):
        block, c = row[cb], 32 * cb
        _put(scales, cb, lane, repeat, _half(block, 0))
        if has_min:
            _put(offsets, cb, lane, repeat, _half(block, 2))
        for j in range(16):
            b = np.int32(block[at + j])
            out[c + j] = (b & 0xF) - bias
            out[c + j + 16] = (b >> 4) - bias


@njit(cache=True)
def _row_q5(row, out, scales, offsets, lane, repeat, has_min):
    """Q5_0 (d, qh, qs; q − 16) and Q5_1 (d, m, qh, qs; q): 4 low bits in qs, the 5th in qh."""
    at_qh = 4 if has_min else 2
    bias = 0 if has_min else 16
    for cb in range(row.shape[0]):
        block, c = row[cb], 32 * cb
        _put(scales, cb, lane, repeat, _half(block, 0))
        if has_min:
            _put(offsets, cb, lane, repeat, _half(block, 2))
        qh = (
            np.uint32(block[at_qh])
            | (np.uint32(block[at_qh + 1]) << 8)
            | (np.uint32(block[at_qh + 2]) << 16)
            | (np.uint32(block[at_qh + 3]) << 24)
        )
        for j in range(16):
            b = np.uint32(block[at_qh + 4 + j])
            out[c + j] = np.int32((b & 0xF) | (((qh >> j) << 4) & 0x10)) - bias
            out[c + j + 16] = np.int32((b >> 4) | ((qh >> (j + 12)) & 0x10)) - bias


@njit(cache=True)
def _row_q8_0(row, out, scales, lane, repeat):
    for cb in range(row.shape[0]):
        block, c = row[cb], 32 * cb
        _put(scales, cb, lane, repeat, _half(block, 0))
        for j in range(32):
            out[c + j] = np.int8(block[2 + j])  # two's complement byte


@njit(cache=True)
def _row_qk(row, out, scales, offsets, lane, repeat, five_bits):
    """Q4_K (qs at byte 16) and Q5_K (qh at 16, qs at 48): 8 sub-blocks of 32, each d·sc·q − dmin·m."""
    at_qs = 48 if five_bits else 16
    for cb in range(row.shape[0]):
        block, c = row[cb], 256 * cb
        d, dmin = _half(block, 0), _half(block, 2)
        for j in range(4):  # 64 values a step: low nibbles of 32 bytes, then their high nibbles
            for half in range(2):
                sub = 2 * j + half
                sc, m = _scale_min_k4(sub, block)
                _put(scales, cb * 8 + sub, lane, repeat, d * F32(sc))
                _put(offsets, cb * 8 + sub, lane, repeat, -(dmin * F32(m)))
                at = c + 64 * j + 32 * half
                for l in range(32):
                    b = np.int32(block[at_qs + 32 * j + l])
                    v = (b >> 4) if half else (b & 0xF)
                    if five_bits:
                        v |= ((np.int32(block[16 + l]) >> sub) & 1) << 4
                    out[at + l] = v


@njit(cache=True)
def _row_q6_k(row, out, scales, lane, repeat):
    """Q6_K: 16 sub-blocks of 16, each d·sc·(q − 32); 4 low bits in ql (byte 0), 2 high in qh (byte 128)."""
    for cb in range(row.shape[0]):
        block, c = row[cb], 256 * cb
        d = _half(block, 208)
        for s in range(16):
            _put(scales, cb * 16 + s, lane, repeat, d * F32(np.int8(block[192 + s])))
        for n in range(2):  # two halves of 128
            for l in range(32):
                ql0 = np.int32(block[64 * n + l])
                ql1 = np.int32(block[64 * n + l + 32])
                qh = np.int32(block[128 + 32 * n + l])
                at = c + 128 * n + l
                out[at] = ((ql0 & 0xF) | ((qh & 3) << 4)) - 32
                out[at + 32] = ((ql1 & 0xF) | (((qh >> 2) & 3) << 4)) - 32
                out[at + 64] = ((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32
                out[at + 96] = ((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32


@njit(cache=True, nogil=True)
def _unpack_blocks(blocks, row0, per_row, values, scales, offsets, repeat, qtype, g0, g1):
    """Groups g0…g1 - 1 of the rows; formats without offsets pass their scales as `offsets` (never
    written). Not numba's parallel loop: that compiled in 2.4x the time (15.6 against 6.4 s of CPU on
    a first start), and a thread per part of the groups, the GIL let go, unpacks as fast."""
    n_rows = blocks.shape[0] // per_row
    for g in range(g0, g1):
        lane0, lane1 = max(row0 - g * LANES, 0), min(row0 + n_rows - g * LANES, LANES)
        tile = np.empty((LANES, values.shape[1]), np.int8)
        sc, off = scales[g], offsets[g]
        for lane in range(lane0, lane1):
            first = (g * LANES + lane - row0) * per_row
            row, out = blocks[first : first + per_row], tile[lane]
            if qtype == _Q4_0 or qtype == _Q4_1:
                _row_q4(row, out, sc, off, lane, repeat, qtype == _Q4_1)
            elif qtype == _Q5_0 or qtype == _Q5_1:
                _row_q5(row, out, sc, off, lane, repeat, qtype == _Q5_1)
            elif qtype == _Q8_0:
                _row_q8_0(row, out, sc, lane, repeat)
            elif qtype == _Q4_K or qtype == _Q5_K:
                _row_qk(row, out, sc, off, lane, repeat, qtype == _Q5_K)
            else:
                _row_q6_k(row, out, sc, lane, repeat)
        _store(tile, values, g, lane0, lane1)


@njit(cache=True, parallel=True)
def _interleave_rows(a, row0, out):
    """Rows of a [n, cols] into out [groups, cols, LANES] as rows row0…: out[g, col, lane] = a[row, col]."""
    for i in prange(a.shape[0]):
        row = row0 + i
        g, lane = row // LANES, row % LANES
        for j in range(a.shape[1]):
            out[g, j, lane] = a[i, j]


def pack(
    parts: list[tuple[np.ndarray, Q, tuple[int, int]]], own: dict = OWN_BITS
) -> PackedMatrix | StackedMatrix:
    """GGUF tensors (bytes [n_rows, row_bytes], type, shape) with the same columns → their rows in one
    PackedMatrix (q/k/v, gate/up: one kernel call), or where a format kept in its own bits (`own`: the
    model's, formats.own_bits) meets others, a StackedMatrix (formats.py)."""
    if len(kinds_of({qtype for _, qtype, _ in parts}, own)) == 1:
        return pack_one(parts, own)
    return StackedMatrix([pack_one(run, own) for run in runs_of(parts, own)])


def pack_one(parts: list[tuple[np.ndarray, Q, tuple[int, int]]], own: dict = OWN_BITS) -> PackedMatrix:
    """pack into one PackedMatrix. Parts of different formats meet on the finest group size and zero
    offsets, which changes no weight; a float part makes it all float32."""
    n_cols = parts[0][2][1]
    n_rows = sum(shape[0] for _, _, shape in parts)
    formats = {qtype for _, qtype, _ in parts}
    arrays = layout(formats, n_rows, n_cols, own)
    values, scales, offsets = (None if a is None else np.zeros(*a) for a in arrays)
    kind = kind_of(formats, own)
    row0 = 0
    for raw, qtype, shape in parts:
        if kind == "float weights":
            _interleave_rows(np.asarray(ggml_quants.dequantize(raw, qtype), F32).reshape(shape), row0, values)
        elif kind == "Q4_K weights":  # kept in its bits (k_quants.py)
            _in_parallel_over_groups(k_quants.pack_blocks, raw, qtype, shape, row0, (values, scales, offsets))
        elif kind == "Q6_K weights":  # (k_quants.py)
            _in_parallel_over_groups(
                k_quants.pack_q6_k_blocks, raw, qtype, shape, row0, (values, scales, offsets)
            )
        elif qtype in HALF_TYPES and kind == own.get(qtype):  # their 16 bits
            _interleave_rows(raw.view(HALF_TYPES[qtype]).reshape(shape), row0, values)
        elif values.ndim == 4:  # the GGUF's blocks, byte for byte (block_formats.py)
            blocks = block_formats.packed_rows(raw, qtype, shape[0])
            _interleave_rows(blocks, row0, values.reshape(values.shape[0], -1, LANES))
        else:
            repeat = GROUP.get(qtype, 32) // (n_cols // scales.shape[1])
            _unpack(raw, qtype, shape, row0, values, scales, offsets, repeat)
        row0 += shape[0]
    return PackedMatrix(values, scales, offsets, n_rows, small=formats <= set(SMALL))


def _unpack(raw, qtype: Q, shape, row0: int, values, scales, offsets, repeat: int) -> None:
    """Write one integer-format tensor's values, scales and offsets at rows row0… of a packed matrix."""
    offsets = scales if offsets is None else offsets
    _in_parallel_over_groups(
        _unpack_blocks, raw, qtype, shape, row0, (values, scales, offsets, repeat, int(qtype))
    )


def _in_parallel_over_groups(unpack, raw, qtype: Q, shape, row0: int, arrays) -> None:
    """unpack(blocks, row0, blocks per row, *arrays, g0, g1) for the groups of rows row0… of one
    tensor, split over the threads."""
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    first, last = row0 // LANES, (row0 + shape[0] - 1) // LANES + 1
    parts = np.linspace(first, last, min(numba.config.NUMBA_NUM_THREADS, last - first) + 1).astype(int)
    args = (blocks, row0, shape[1] // block_len, *arrays)
    kernels.in_parallel([partial(unpack, *args, g0, g1) for g0, g1 in zip(parts[:-1], parts[1:])])


def for_inputs(w: PackedMatrix, inputs: str) -> PackedMatrix:
    """w as products with these inputs ("f32" or "q8") read it: Q6_K in its own bits, for float32 inputs,
    as int8 values with a float32 scale per 16 (the same weights; formats.kind_taken). With inputs as
    bytes a sub-block's weights come out of their words for all its columns at once, but float32
    inputs take each weight out on its own: 9 vector operations per 16 weights where int8 takes 4, so
    a 7B's decode took 1.2x the time (docs/performance.md)."""
    if not (w.in_q6_k and inputs == "f32"):
        return replace(w, activations=inputs)
    groups, n_cols = w.values.shape[0], w.n_cols
    values = np.empty((groups, n_cols, LANES), np.int8)
    scales = np.empty((groups, n_cols // 16, LANES), F32)
    parts = np.linspace(0, groups, min(numba.config.NUMBA_NUM_THREADS, groups) + 1).astype(int)
    convert = partial(k_quants.q6_k_as_int8, w.values, w.scales, w.offsets, values, scales)
    kernels.in_parallel([partial(convert, g0, g1) for g0, g1 in zip(parts[:-1], parts[1:])])
    return PackedMatrix(values, scales, None, w.n_rows, inputs, small=True)  # (q − 32: within ±32)


def zero_matrix(
    formats, shape: tuple[int, int] = (LANES, 256), activations: str = "f32", own: dict = OWN_BITS
) -> PackedMatrix:
    """A matrix of a format (or of formats joined in one), all zeros, laid out as pack lays it out but
    not packed (the unpacking loops compile only where a model is packed)."""
    formats = {formats} if isinstance(formats, Q) else set(formats)
    arrays = (None if a is None else np.zeros(*a) for a in layout(formats, *shape, own))
    return PackedMatrix(*arrays, n_rows=shape[0], activations=activations, small=formats <= set(SMALL))
