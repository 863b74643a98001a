"""GGUF weight formats → the packed layout the kernels read, without losing a bit of what the GGUF holds.

Every integer format of ggml (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is a small signed or
unsigned integer per weight times a float scale per group of 16 or 32 weights, plus a float offset in
the formats with a minimum. Those integers all fit int8, so each format unpacks here into one shape:
int8 values, a float32 scale per group and, where the format has one, a float32 offset per group —
exactly the numbers ggml's `dequantize_row_*` multiplies (ggml-quants.c; one unpacker per format below
follows it line by line). Float tensors (F32, F16, BF16) and the rarer formats keep float32 values.

Packed, 64 rows are interleaved: values [rows/64, cols, 64]. A kernel then runs its vector lanes across
64 rows at once and applies each group's scale once per group, outside the innermost loop (a scale per
32 weights inside a dot product keeps a compiler from vectorizing it).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from .jit import njit, prange
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


@dataclass
class Unpacked:
    """Row-major intermediate: values [n_rows, n_cols], scales/offsets [n_rows, n_cols / group]."""

    values: np.ndarray
    scales: np.ndarray | None
    offsets: np.ndarray | None

    @property
    def group(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as float32 [n_blocks]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0].astype(F32)


# One unpacker per format: blocks [n_blocks, block_bytes] uint8 → q [n_blocks, block_len] int8 and the
# per-group scales (and offsets) [n_blocks, groups_per_block]. Each follows ggml's dequantize_row_*.


@njit(cache=True, parallel=True)
def _unpack_q4_0(blocks, q):
    for i in prange(blocks.shape[0]):
        for j in range(16):
            b = blocks[i, 2 + j]
            q[i, j] = (b & 0xF) - 8
            q[i, j + 16] = (b >> 4) - 8


@njit(cache=True, parallel=True)
def _unpack_q4_1(blocks, q):
    for i in prange(blocks.shape[0]):
        for j in range(16):
            b = blocks[i, 4 + j]
            q[i, j] = b & 0xF
            q[i, j + 16] = b >> 4


@njit(cache=True, parallel=True)
def _unpack_q5(blocks, q, at_qh, bias):
    """Q5_0 (qh at byte 2, bias 16) and Q5_1 (qh at byte 4, no bias): 4 low bits in qs, the 5th in qh."""
    for i in prange(blocks.shape[0]):
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
            q[i, j] = np.int32((b & 0xF) | hi0) - bias
            q[i, j + 16] = np.int32((b >> 4) | hi1) - bias


@njit(cache=True, parallel=True)
def _unpack_q8_0(blocks, q):
    for i in prange(blocks.shape[0]):
        for j in range(32):
            q[i, j] = np.int8(blocks[i, 2 + j])  # two's complement byte


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
def _unpack_qk(blocks, d, dmin, q, scales, offsets, five_bits):
    """Q4_K (qs at byte 16) and Q5_K (qh at 16, qs at 48): 8 sub-blocks of 32, each d·sc·q − dmin·m."""
    at_qs = 48 if five_bits else 16
    for i in prange(blocks.shape[0]):
        for j in range(4):  # 64 values a step: low nibbles of 32 bytes, then their high nibbles
            for half in range(2):
                sub = 2 * j + half
                sc, m = _scale_min_k4(sub, blocks, i)
                scales[i, sub] = d[i] * F32(sc)
                offsets[i, sub] = -(dmin[i] * F32(m))
                for l in range(32):
                    b = blocks[i, at_qs + 32 * j + l]
                    v = (b >> 4) if half else (b & 0xF)
                    if five_bits and (blocks[i, 16 + l] >> sub) & 1:
                        v += 16
                    q[i, 64 * j + 32 * half + l] = v


@njit(cache=True, parallel=True)
def _unpack_q6_k(blocks, d, q, scales):
    """Q6_K: 16 sub-blocks of 16, each d·sc·(q − 32); 4 low bits in ql (byte 0), 2 high in qh (byte 128)."""
    for i in prange(blocks.shape[0]):
        for s in range(16):
            scales[i, s] = d[i] * F32(np.int8(blocks[i, 192 + s]))
        for n in range(2):  # two halves of 128
            for l in range(32):
                ql0 = blocks[i, 64 * n + l]
                ql1 = blocks[i, 64 * n + l + 32]
                qh = blocks[i, 128 + 32 * n + l]
                base = 128 * n + l
                q[i, base] = np.int32((ql0 & 0xF) | ((qh & 3) << 4)) - 32
                q[i, base + 32] = np.int32((ql1 & 0xF) | (((qh >> 2) & 3) << 4)) - 32
                q[i, base + 64] = np.int32((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32
                q[i, base + 96] = np.int32((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32


Q = gguf.GGMLQuantizationType
INTEGER_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def unpack(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Unpacked:
    """A GGUF tensor's bytes [n_rows, row_bytes] → Unpacked. Float and rarer formats → float32 values."""
    n_rows, n_cols = shape
    if qtype not in INTEGER_FORMATS:
        values = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=F32).reshape(shape)
        return Unpacked(values, None, None)
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    n = blocks.shape[0]
    q = np.empty((n, block_len), dtype=np.int8)
    offsets = None
    if qtype in (Q.Q4_K, Q.Q5_K):
        scales, offsets = np.empty((n, 8), F32), np.empty((n, 8), F32)
        _unpack_qk(blocks, _f16(blocks, 0), _f16(blocks, 2), q, scales, offsets, qtype == Q.Q5_K)
    elif qtype == Q.Q6_K:
        scales = np.empty((n, 16), F32)
        _unpack_q6_k(blocks, _f16(blocks, 208), q, scales)
    else:
        scales = _f16(blocks, 0)[:, None]
        if qtype in (Q.Q4_1, Q.Q5_1):
            offsets = _f16(blocks, 2)[:, None]
        if qtype == Q.Q4_0:
            _unpack_q4_0(blocks, q)
        elif qtype == Q.Q4_1:
            _unpack_q4_1(blocks, q)
        elif qtype == Q.Q8_0:
            _unpack_q8_0(blocks, q)
        else:
            _unpack_q5(blocks, q, 2 if qtype == Q.Q5_0 else 4, 16 if qtype == Q.Q5_0 else 0)
    groups = n_cols // (block_len // scales.shape[1])
    return Unpacked(
        q.reshape(n_rows, n_cols),
        scales.reshape(n_rows, groups),
        None if offsets is None else offsets.reshape(n_rows, groups),
    )


def join_rows(parts: list[Unpacked]) -> Unpacked:
    """Stack matrices with the same columns (q/k/v, gate/up) into one, so one kernel call serves all.
    Parts of different formats meet on the finest group size and add zero offsets: still exact."""
    if len(parts) == 1:
        return parts[0]
    if any(p.scales is None for p in parts):  # a float part: everything as float32
        return Unpacked(np.concatenate([dequantize(p) for p in parts]), None, None)
    group = min(p.group for p in parts)

    def per_group(a: np.ndarray | None, p: Unpacked) -> np.ndarray:
        a = np.zeros_like(p.scales) if a is None else a
        return np.repeat(a, p.group // group, axis=1)

    with_offsets = any(p.offsets is not None for p in parts)
    return Unpacked(
        np.concatenate([p.values for p in parts]),
        np.concatenate([per_group(p.scales, p) for p in parts]),
        np.concatenate([per_group(p.offsets, p) for p in parts]) if with_offsets else None,
    )


def dequantize(u: Unpacked) -> np.ndarray:
    """float32 [n_rows, n_cols]: what ggml's dequantize_row_* gives (tests check it against gguf.quants)."""
    if u.scales is None:
        return u.values
    n_rows, n_cols = u.values.shape
    w = u.values.reshape(n_rows, -1, u.group).astype(F32) * u.scales[:, :, None]
    if u.offsets is not None:
        w += u.offsets[:, :, None]
    return w.reshape(n_rows, n_cols)


def _interleave(a: np.ndarray) -> np.ndarray:
    """[n_rows, n] → [ceil(n_rows / LANES), n, LANES], zero rows padding the last group."""
    n_rows, n = a.shape
    groups = -(-n_rows // LANES)
    out = np.zeros((groups * LANES, n), dtype=a.dtype)
    out[:n_rows] = a
    return np.ascontiguousarray(out.reshape(groups, LANES, n).transpose(0, 2, 1))


def pack(u: Unpacked) -> PackedMatrix:
    return PackedMatrix(
        _interleave(u.values),
        None if u.scales is None else _interleave(u.scales),
        None if u.offsets is None else _interleave(u.offsets),
        u.values.shape[0],
    )
