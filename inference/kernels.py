"""Compiled kernels over packed weights (see quants.py): the matrix work of the forward pass.

Decode (1–8 rows) reads each weight once for all rows: the vector lanes run across 64 interleaved rows
of the matrix, each input row is multiplied into a 64-wide partial sum per group of 16–32 weights, and
the group's scale (and offset) is applied once per group. Activations stay float32. Every output row
is computed by the same instructions whatever the number of rows, so a row's result does not depend on
what else is in the batch (prompt-lookup verification relies on that).

Prefill (many rows) dequantizes tiles of the matrix into a reused float32 buffer and hands them to
BLAS (sgemm), which is faster per row than any kernel here. A tile fits the core's L2 cache, so that
sgemm reads what the dequantization just wrote from there: with 16 MB tiles both went through memory,
a fixed ~0.3 s per forward pass however few its rows (a new turn of 16 tokens after a long chat).
"""

from __future__ import annotations

import threading

import numpy as np

from .jit import njit, prange

LANES = 64  # rows interleaved in the packed layout: 8 AVX2 or 4 AVX-512 float vectors
SMALL_BATCH = 8  # up to this many rows the kernels run; more go to BLAS on dequantized tiles
TILE_BYTES = 512 << 10  # float32 tile of a matrix dequantized for BLAS: 2 groups of 896 columns
F32 = np.float32


@njit(cache=True, parallel=True, fastmath=True)
def _matvec_int8(values, scales, offsets, has_offsets, x, xsum, out):
    """out[i, g·L + r] = Σ_b scale[g,b,r]·Σ_{j∈b} values[g,j,r]·x[i,j] (+ offset[g,b,r]·xsum[i,b])."""
    n_groups, n_cols, _ = values.shape
    n_blocks = scales.shape[1]
    size = n_cols // n_blocks
    n = x.shape[0]
    for g in prange(n_groups):
        acc = np.zeros((n, LANES), F32)
        part = np.empty((n, LANES), F32)
        w = np.empty(LANES, F32)
        for b in range(n_blocks):
            part[:] = 0
            for j in range(b * size, (b + 1) * size):
                if n == 1:
                    xj = x[0, j]
                    for r in range(LANES):
                        part[0, r] += F32(values[g, j, r]) * xj
                else:  # each weight converted once, then used by every row (the same products)
                    for r in range(LANES):
                        w[r] = F32(values[g, j, r])
                    for i in range(n):
                        xj = x[i, j]
                        for r in range(LANES):
                            part[i, r] += w[r] * xj
            for i in range(n):
                for r in range(LANES):
                    acc[i, r] += part[i, r] * scales[g, b, r]
                if has_offsets:
                    for r in range(LANES):
                        acc[i, r] += offsets[g, b, r] * xsum[i, b]
        for i in range(n):
            for r in range(LANES):
                out[i, g * LANES + r] = acc[i, r]


@njit(cache=True, parallel=True, fastmath=True)
def _matvec_f32(values, x, out):
    n_groups, n_cols, _ = values.shape
    n = x.shape[0]
    for g in prange(n_groups):
        acc = np.zeros((n, LANES), F32)
        for i in range(n):
            for j in range(n_cols):
                xj = x[i, j]
                for r in range(LANES):
                    acc[i, r] += values[g, j, r] * xj
        for i in range(n):
            for r in range(LANES):
                out[i, g * LANES + r] = acc[i, r]


@njit(cache=True, fastmath=True)
def _dequantize_int8(values, scales, offsets, has_offsets, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies.
    On the calling thread: a tile takes microseconds, and waking numba's threads for each one, between
    sgemm calls whose OpenBLAS threads still spin, was slower with 2 threads (by 3-20 % at 16-64 rows,
    in interleaved runs) and no faster with 1."""
    _, n_cols, _ = values.shape
    n_blocks = scales.shape[1]
    size = n_cols // n_blocks
    for g in range(g0, g1):
        c = (g - g0) * LANES
        for b in range(n_blocks):
            s, o = scales[g, b], offsets[g, b]
            for j in range(b * size, (b + 1) * size):
                row, v = out[j, c : c + LANES], values[g, j]
                if has_offsets:  # two loops, so that each vectorizes without a branch inside
                    for r in range(LANES):
                        row[r] = F32(v[r]) * s[r] + o[r]
                else:
                    for r in range(LANES):
                        row[r] = F32(v[r]) * s[r]


COMPILED = (_matvec_int8, _matvec_f32, _dequantize_int8)

_scratch = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A float32 buffer of at least n numbers, kept per thread: a fresh one each call would fault in
    its pages again for every matrix of every layer."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, dtype=F32)
    return buf


def matmul(x: np.ndarray, w) -> np.ndarray:
    """x [n, n_cols] float32 @ w.T → [n, n_rows] for a PackedMatrix w."""
    n = x.shape[0]
    n_groups, n_cols, _ = w.values.shape
    x = np.ascontiguousarray(x, dtype=F32)
    if n <= SMALL_BATCH:
        out = np.empty((n, n_groups * LANES), dtype=F32)
        if w.scales is None:
            _matvec_f32(w.values, x, out)
        else:
            xsum = _block_sums(x, w.scales.shape[1]) if w.offsets is not None else x
            _matvec_int8(w.values, w.scales, *_offsets(w), x, xsum, out)
        return out[:, : w.n_rows]
    out = np.empty((n, w.n_rows), dtype=F32)
    tile = max(1, TILE_BYTES // (4 * n_cols * LANES))  # groups per tile
    buf = _tile_buffer(n_cols * tile * LANES)
    for g0 in range(0, n_groups, tile):
        g1 = min(g0 + tile, n_groups)
        rows = (g1 - g0) * LANES
        b = buf[: n_cols * rows].reshape(n_cols, rows)
        _dequantize_into(w, g0, g1, b)
        lo, hi = g0 * LANES, min(g1 * LANES, w.n_rows)
        np.matmul(x, b[:, : hi - lo], out=out[:, lo:hi])  # BLAS writes into out's columns directly
    return out


def _dequantize_into(w, g0: int, g1: int, out: np.ndarray) -> None:
    if w.scales is None:
        out[:] = w.values[g0:g1].transpose(1, 0, 2).reshape(out.shape)
    else:
        _dequantize_int8(w.values, w.scales, *_offsets(w), g0, g1, out)


def _offsets(w) -> tuple[np.ndarray, bool]:
    """A kernel's offsets argument and whether to use it: a matrix without offsets passes its scales,
    of the same type, so that one compiled kernel serves both."""
    return (w.offsets, True) if w.offsets is not None else (w.scales, False)


def _block_sums(x: np.ndarray, n_blocks: int) -> np.ndarray:
    """Σ of x over each group of columns [n, n_blocks]: what a group's offset multiplies."""
    n = x.shape[0]
    return np.ascontiguousarray(x.reshape(n, n_blocks, -1).sum(axis=2, dtype=F32))


def rows(w, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a PackedMatrix as float32 [len(ids), n_cols] (a tied embedding table's lookups)."""
    ids = np.asarray(ids, dtype=np.int64)
    g, lane = ids // LANES, ids % LANES
    values = w.values[g, :, lane]  # [n, n_cols]
    if w.scales is None:
        return values.astype(F32)
    n, n_cols = values.shape
    scales = w.scales[g, :, lane]  # [n, n_blocks]
    out = values.reshape(n, scales.shape[1], -1).astype(F32) * scales[:, :, None]
    if w.offsets is not None:
        out += w.offsets[g, :, lane][:, :, None]
    return out.reshape(n, n_cols)
