"""Compiled kernels over packed weights (see quants.py): the matrix work of the forward pass.

Up to KERNEL_ROWS input rows, a kernel reads each weight once for all of them: its vector lanes run
across LANES interleaved rows of the matrix, each weight is dequantized once (value · scale + offset, as
ggml's `dequantize_row_*`) and multiplied into the partial sums of ROWS input rows at a time, which
stay in registers for the whole row of weights (LANES and ROWS fit the machine's registers: cpu.py).
Activations stay float32. Every output row is computed by the same instructions whatever the number of rows (no
reassociation: only multiply-adds are fused), so a row's result does not depend on what else is in
the batch (prompt-lookup verification and the scheduler rely on that).

Past KERNEL_ROWS rows, where the machine measured it faster (`blas_from`, see quants.measure_blas_from),
rows go to BLAS (sgemm) on tiles of the matrix dequantized into a reused float32 buffer. A tile fits the
core's L2 cache, so that sgemm reads what the dequantization just wrote from there: with 16 MB tiles
both went through memory, a fixed ~0.3 s per forward pass. Which one is faster depends on the processor:
on the Intel cores of earlier measurements BLAS won from ~40 rows, on an AMD EPYC (Zen 5) the kernels
won at every size up to 512 rows, by 1.2-1.7x.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import gguf
import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic, overload
from threadpoolctl import ThreadpoolController

from . import k_quants
from .cpu import PROFILE
from .half import bits_view, to_f32
from .jit import njit, prange
from .vectors import (
    _byte_column_dots,
    _dequantize_column,
    _multiply_add,
    _prefetch,
    _registers,
    in_lane_order,
)

# numba compiles these in as constants: code compiled for other values lives in another cache folder.
LANES = PROFILE.lanes  # rows interleaved in the packed layout; one or two input rows run across all
ROWS = PROFILE.rows  # input rows a pass multiplies at once past two, their partial sums in registers,
PASS_LANES = PROFILE.pass_lanes  # across this many lanes at a time
SUMS = max(ROWS * PASS_LANES, 2 * LANES)  # (a literal, as _registers wants it)
KERNEL_ROWS = 32  # up to this many rows the kernels always run: a row's bits never depend on its batch
# From this many rows on BLAS on dequantized tiles multiplies faster than the kernels; None: the kernels
# are faster at any size. Measured once per machine when the kernels are compiled (quants.py).
blas_from: int | None = KERNEL_ROWS + 1
TILE_BYTES = PROFILE.tile_bytes  # float32 tile of a matrix dequantized for BLAS
F32 = np.float32
# Which passes ask for their weights ahead of reading them (vectors.AHEAD): one or two input rows wait
# on memory, always; more rows in the first pass over a group only, and only where a pass covers the
# whole group (AVX-512: 8 replies at once decoded 2.5 -> 2.9-3.2x one's speed). In the AVX2 profile's
# passes of 16 of 32 lanes the test cost 12 % of a 7B's 32-token prefill (9.1 -> 8.0 tok/s).
AHEAD_IN_PASSES = PASS_LANES == LANES
# Multiply-adds may be fused, nothing reassociated: a row's sums are added in one order in every batch.
EXACT = {"contract"}


@njit(cache=True)
def _n_blocks(scales):
    """Groups of weights with a scale of their own in a row (a function of its own, where numba drops
    the branch a None takes: the layouts' overload below is typed without that pruning)."""
    return 1 if scales is None else scales.shape[1]


def _accumulate(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
    """The partial sums of a pass over a group's weights, by the matrix's layout (numba picks one when
    it compiles): int8 or float values (_accumulate_values), or Q4_K's own bits (k_quants.py); `ahead`:
    whether the pass asks for its weights ahead of reading them (AHEAD_IN_PASSES)."""


@overload(_accumulate, inline="always", prefer_literal=True)
def _accumulate_by_layout(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
    if x.dtype == types.int32 and values.dtype == types.uint8:  # inputs as bytes (quantize_rows)

        def in_q4_k_bytes(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
            k_quants.accumulate_q8(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, rows, width, ahead)

        return in_q4_k_bytes
    if x.dtype == types.int32:

        def in_value_bytes(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
            _accumulate_value_bytes(values, scales, offsets, x, x_sums, i0, g, lane0, sums, rows, width, ahead)

        return in_value_bytes
    if values.dtype != types.uint8:

        def in_values(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
            _accumulate_values(values, scales, offsets, x, i0, g, lane0, sums, w, rows, width, ahead)

        return in_values

    def in_q4_k(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead):
        k_quants.accumulate(values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead)

    return in_q4_k


@njit(cache=True, inline="always")
def _accumulate_values(values, scales, offsets, x, i0, g, lane0, sums, w, rows, width, ahead):
    """sums[i, r] = Σ_j w[g·L + lane0 + r, j] · x[i0 + i, j] for i < rows, r < width (constants where it
    is inlined, so that the loop over i unrolls), w dequantized one column of `width` weights at a time.
    Scales and offsets are None where the matrix has none: numba compiles only what a matrix takes.
    Each sum is added up in the same order (j) whatever the rows and width, one fused multiply-add at a
    time: a row's bits do not depend on the pass it is computed in."""
    _, n_cols, lanes = values.shape
    n_blocks = _n_blocks(scales)
    size = n_cols // n_blocks
    for k in range(rows * width):
        sums[k] = 0
    for b in range(n_blocks):
        for j in range(b * size, (b + 1) * size):
            at, scale_at = (g * n_cols + j) * lanes + lane0, (g * n_blocks + b) * lanes + lane0
            if ahead:
                for line in range(0, lanes * values.itemsize, 64):
                    _prefetch(values, at, line)
            _dequantize_column(values, scales, offsets, at, scale_at, w, width)
            for i in range(rows):
                _multiply_add(sums, i, w, x[i0 + i, j], width)


@njit(cache=True, inline="always")
def _accumulate_value_bytes(values, scales, offsets, xq, x_runs, i0, g, lane0, sums, rows, width, ahead):
    """_accumulate_values for inputs as bytes (quantize_rows): a block's Σ w·x̂ in integers, times the
    bytes' scale and the block's, plus its offset times Σ x (blocks of 32 columns where there are offsets:
    takes_bytes), by vectors._byte_column_dots."""
    _, n_cols, lanes = values.shape
    n_blocks, n_words, n_runs = scales.shape[1], xq.shape[1], x_runs.shape[1]
    size = n_cols // n_blocks
    for k in range(rows * width):
        sums[k] = 0
    for b in range(n_blocks):
        at, scale_at = (g * n_cols + b * size) * lanes + lane0, (g * n_blocks + b) * lanes + lane0
        if ahead:
            for line in range(0, size * lanes, 64):
                _prefetch(values, at, line)
        xq_at, xr_at = i0 * n_words + b * size // 4, 2 * (i0 * n_runs + b * size // 32)
        if size == 16:
            _byte_column_dots(values, at, lanes, 16, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at, sums, rows, width)
        else:
            _byte_column_dots(values, at, lanes, 32, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at, sums, rows, width)
    in_lane_order(sums, rows, width)


@njit(cache=True)  # no fastmath: numba would mark the intrinsics' multiply and add as fusable too
def _group_product(values, scales, offsets, x, x_sums, out, g):
    """Columns g·L … g·L + L - 1 of out = x @ w.T: one or two rows alone across all LANES, else ROWS
    rows at a time (x is padded to a multiple of ROWS) across PASS_LANES lanes at a time."""
    registers, runs = _registers(SUMS), _registers(SUMS)
    w = _registers(LANES)
    n = out.shape[0]
    if n <= 2:  # one token decoded alone, or two replies: no padded rows to compute
        sums = carray(registers, (2, LANES))
        if n == 1:
            _accumulate(values, scales, offsets, x, x_sums, 0, g, 0, registers, runs, w, 1, LANES, True)
        else:
            _accumulate(values, scales, offsets, x, x_sums, 0, g, 0, registers, runs, w, 2, LANES, True)
        for i in range(n):
            for r in range(LANES):
                out[i, g * LANES + r] = sums[i, r]
        return
    sums = carray(registers, (ROWS, PASS_LANES))
    for i0 in range(0, n, ROWS):
        for lane0 in range(0, LANES, PASS_LANES):
            ahead = AHEAD_IN_PASSES and i0 == 0  # the pass that reads the group from memory
            _accumulate(values, scales, offsets, x, x_sums, i0, g, lane0, registers, runs, w, ROWS, PASS_LANES, ahead)
            for i in range(min(ROWS, n - i0)):
                for r in range(PASS_LANES):
                    out[i0 + i, g * LANES + lane0 + r] = sums[i, r]


@njit(cache=True, parallel=True)
def _product(values, scales, offsets, x, x_sums, out):
    for g in prange(values.shape[0]):  # a group's call is its own function: its registers its own
        # (g as int64: numba types a parallel loop's index both signed and unsigned, and a uint64 g
        # compiled _group_product a second time, 4-5 s of a first start)
        _group_product(values, scales, offsets, x, x_sums, out, np.int64(g))


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, n_cols] float32 as bytes, llama.cpp's way of multiplying faster (activations q8): xq [n,
    n_cols] int8 and, for each run of 32 columns, [n, n_cols / 32, 2] its Σ x (in column order, as
    k_quants.run_sums) and its scale, max |x| / 127, with xq = round(x / scale). Row by row: a row's
    bytes do not depend on its batch. On numba's threads only for a large x: waking them costs ~50 µs,
    a tenth of a default-model token's time over its ~100 products."""
    n, n_cols = x.shape
    xq = np.empty((n, n_cols), np.int8)
    x_runs = np.empty((n, n_cols // 32, 2), F32)
    (_quantize_in_parallel if x.size >= QUANTIZE_IN_PARALLEL_FROM else _quantize)(x, xq, x_runs)
    return xq, x_runs


QUANTIZE_IN_PARALLEL_FROM = 1 << 16  # input numbers


def compile_quantize() -> None:
    """Both of quantize_rows' loops, compiled or loaded from the cache (a first start's, not a reply's)."""
    x = np.zeros((1, 32), F32)
    for quantize in (_quantize, _quantize_in_parallel):
        quantize(x, np.empty((1, 32), np.int8), np.empty((1, 1, 2), F32))


@njit(cache=True, inline="always")
def _quantize_row(x, i, xq, x_runs):
    for r in range(x.shape[1] // 32):
        total, top = F32(0), F32(0)
        for t in range(32 * r, 32 * r + 32):
            total += x[i, t]
            top = max(top, abs(x[i, t]))
        scale = top / F32(127)
        inverse = F32(1) / scale if scale > 0 else F32(0)
        for t in range(32 * r, 32 * r + 32):
            xq[i, t] = np.int8(np.rint(x[i, t] * inverse))
        x_runs[i, r, 0], x_runs[i, r, 1] = total, scale


@njit(cache=True)
def _quantize(x, xq, x_runs):
    for i in range(x.shape[0]):
        _quantize_row(x, i, xq, x_runs)


@njit(cache=True, parallel=True)
def _quantize_in_parallel(x, xq, x_runs):
    for i in prange(x.shape[0]):
        _quantize_row(x, i, xq, x_runs)


@njit(cache=True)
def _dequantize_int8(values, scales, offsets, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies.
    On the calling thread: a tile takes microseconds, and waking numba's threads for each one, between
    sgemm calls whose OpenBLAS threads still spin, was slower with 2 threads (by 3-20 % at 16-64 rows,
    in interleaved runs) and no faster with 1. Plain multiply and add (offsets None where the matrix has
    none): the weights exactly as gguf.quants dequantizes them."""
    _, n_cols, _ = values.shape
    n_blocks = scales.shape[1]
    size = n_cols // n_blocks
    for g in range(g0, g1):
        c = (g - g0) * LANES
        for b in range(n_blocks):
            s = scales[g, b]
            for j in range(b * size, (b + 1) * size):
                row, v = out[j, c : c + LANES], values[g, j]
                if offsets is None:
                    for r in range(LANES):
                        row[r] = F32(v[r]) * s[r]
                else:
                    o = offsets[g, b]
                    for r in range(LANES):
                        row[r] = F32(v[r]) * s[r] + o[r]


# -- attention of one new token ----------------------------------------------------------------------
# Decoding one token attends over the whole cache: 100 MB of float32 keys and values per token at
# 4,096 positions for the default model. BLAS read them at ~7 GB/s there (7 query rows against 4,096
# keys is a shape sgemm does poorly, on the one thread that steps of the kernels leave it), where a
# plain loop reads memory at 40 GB/s. This kernel reads each key and value once for all the query
# heads sharing it, on every thread, a chunk of positions per task (flash-decoding): a chunk's sums
# are its own and are merged in one order afterwards, so a token's result does not depend on the
# number of threads or on what else is in the batch.

ATTENTION_CHUNK = 256  # positions per task
LOG2E, LN2_HI, LN2_LO = F32(1.4426950408889634), F32(0.693359375), F32(-2.12194440e-4)
# Dot products may be reassociated (vectorized across head_dim), in the same order on every call.
DOT = {"contract", "reassoc"}


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer `bits` (what C does with a union)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(bits), codegen


@njit(cache=True, inline="always", fastmath=EXACT)
def _exp_nonpositive(x):
    """exp(x) for x ≤ 0 in float32 arithmetic that vectorizes (libm's expf does not): x = n·ln 2 + r,
    |r| ≤ ln 2 / 2, a degree-6 Taylor polynomial of r times 2^n built from its bits: within 2 float32 ulps
    of exp (test_kernels). Below -87.3 (where float32 leaves its normal range) it gives ~1e-38, nothing
    in a softmax."""
    x = max(x, F32(-87.3))
    n = np.floor(x * LOG2E + F32(0.5))
    r = x - n * LN2_HI - n * LN2_LO
    p = F32(1 / 720) * r + F32(1 / 120)
    p = p * r + F32(1 / 24)
    p = p * r + F32(1 / 6)
    p = p * r + F32(0.5)
    p = p * r + F32(1)
    p = p * r + F32(1)
    return p * _float_from_bits((np.int32(n) + 127) << 23)


@njit(cache=True, parallel=True, fastmath=DOT)
def _one_token_attention(q, k, v, runs, m_out, l_out, acc_out):
    """Attention of one new token over a chunk of positions per task, as flash-decoding does: for the
    positions runs (first, n) of one layer of the cache k, v [n_kv, N, hd] (whole: their last axis
    contiguous, which the vectorized loops rely on), q [n_kv, group, hd] → per kv head h and chunk c the
    scores' max m_out[h, c, g], the sum of exp(score - max) l_out[h, c, g] and the sum of those
    weights times the values acc_out[h, c, g] [hd]; one_token_attention merges the chunks."""
    n_kv, group, hd = q.shape
    chunks = m_out.shape[1]
    for task in prange(n_kv * chunks):
        h, c = task // chunks, task % chunks
        lo = c * ATTENTION_CHUNK
        where = np.empty(ATTENTION_CHUNK, np.int64)  # the chunk's positions in the cache
        size, base = 0, 0
        for r in range(runs.shape[0]):
            first, n = runs[r, 0], runs[r, 1]
            for t in range(max(lo, base), min(lo + ATTENTION_CHUNK, base + n)):
                where[size] = first + t - base
                size += 1
            base += n
        scores = np.empty((group, ATTENTION_CHUNK), F32)
        kv = np.empty(hd, F32)  # a key or value row as float32, converted once for the group's heads
        for i in range(size):
            row = where[i]
            _prefetch(k, (h * k.shape[1] + row) * hd, 0)  # 2 KB on (vectors.AHEAD): a page's end
            for d in range(hd):
                kv[d] = to_f32(k[h, row, d])
            for g in range(group):
                dot = F32(0)
                for d in range(hd):
                    dot += q[h, g, d] * kv[d]
                scores[g, i] = dot
        acc = np.zeros((group, hd), F32)
        for g in range(group):
            top = scores[g, 0]
            for i in range(1, size):
                top = max(top, scores[g, i])
            total = F32(0)
            for i in range(size):
                e = _exp_nonpositive(scores[g, i] - top)
                scores[g, i] = e
                total += e
            m_out[h, c, g], l_out[h, c, g] = top, total
        for i in range(size):
            row = where[i]
            _prefetch(v, (h * v.shape[1] + row) * hd, 0)
            for d in range(hd):
                kv[d] = to_f32(v[h, row, d])
            for g in range(group):
                weight = scores[g, i]
                for d in range(hd):
                    acc[g, d] += weight * kv[d]
        for g in range(group):  # (a loop: `acc_out[h, c] = acc` compiled its shape check's error
            for d in range(hd):  # message, 2.7 s of a first start)
                acc_out[h, c, g, d] = acc[g, d]


def one_token_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, runs) -> np.ndarray:
    """softmax(q · keys) · values for one new token: q [n_kv, group, hd] (scaled), k, v one layer of the
    cache [n_kv, N, hd] (float32, or float16 read as float32) and the runs (first, n) of it to attend to
    → [n_kv, group, hd]. One call for all heads: waking numba's threads costs ~60 µs a call here (one
    call per head cost more than it saved)."""
    n_kv, group, hd = q.shape
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)  # (as it comes from KVViews.runs: no copy)
    chunks = -(-int(runs[:, 1].sum()) // ATTENTION_CHUNK)
    m = np.empty((n_kv, chunks, group), F32)
    l = np.empty((n_kv, chunks, group), F32)
    acc = np.empty((n_kv, chunks, group, hd), F32)
    _one_token_attention(q, bits_view(k), bits_view(v), runs, m, l, acc)
    scale = np.exp(m - m.max(axis=1, keepdims=True))  # each chunk's weights against the largest max
    total = (l * scale).sum(axis=1)  # [n_kv, group]
    return (acc * scale[..., None]).sum(axis=1) / total[..., None]


COMPILED = (_product, _group_product, _dequantize_int8, k_quants.dequantize_tile, _one_token_attention)

# OpenBLAS's threads spin for a while after each call before they sleep. In a step of the kernels
# (≤ KERNEL_ROWS rows) BLAS only multiplies the attention's small matrices, and its spinning threads
# took the two cores from the kernels' threads: with BLAS on one thread there, a 16-token turn after
# 1,024 tokens took 149-190 instead of 208-228 ms and decode at context 4,096 ran 9.7-12.3 instead of
# 9.0-9.8 tok/s (interleaved runs); a long prefill wants every BLAS thread.
_blas = ThreadpoolController().select(user_api="blas").lib_controllers
_blas_threads = {id(c): c.get_num_threads() for c in _blas}  # as started (--threads)


def kernels_take(rows: int) -> bool:
    """Whether a product of `rows` input rows runs in the kernels (else BLAS on dequantized tiles)."""
    return rows <= KERNEL_ROWS or blas_from is None or rows < blas_from


def use_blas_threads_for(rows: int, activations: str = "f32") -> None:
    """Before a forward step of `rows` rows of a model with these activations: BLAS on one thread for a
    step of the kernels (any step where inputs go as bytes), else on all it started with. Cheap when
    nothing changes (a ctypes call per BLAS library). (In a long prefill through the kernels too: with
    BLAS on two threads for the attention, 512 tokens took 1.4x longer.)"""
    blas_on_one_thread(activations != "f32" or kernels_take(rows))


def blas_on_one_thread(one: bool) -> None:
    global _blas_on_one
    _blas_on_one = one
    for c in _blas:
        want = 1 if one else _blas_threads[id(c)]
        if c.get_num_threads() != want:
            c.set_num_threads(want)


_blas_on_one = False
# Query rows × cached positions from which a step of the kernels splits its attention by query rows over
# the threads (cpu.py). Each part is single-threaded BLAS, exp and sums, all of which let go of the GIL;
# decode (one row) is never split.
PARALLEL_ATTENTION_FROM = PROFILE.parallel_attention_from
_helpers: ThreadPoolExecutor | None = None


def attention_threads(rows: int, positions: int) -> int:
    """How many threads share the attention of `rows` query rows over `positions` cached ones: one
    where BLAS runs on all of its own (a step through dequantized tiles) or the work is small."""
    if not _blas_on_one or rows < 2 or rows * positions < PARALLEL_ATTENTION_FROM:
        return 1
    return min(numba.config.NUMBA_NUM_THREADS, rows)


def in_parallel(tasks: list[Callable[[], np.ndarray]]) -> list[np.ndarray]:
    """The tasks' results in order: the first run on this thread, the others on helper threads."""
    global _helpers
    if _helpers is None:
        _helpers = ThreadPoolExecutor(max(1, numba.config.NUMBA_NUM_THREADS - 1), "kernel-helper")
    others = [_helpers.submit(task) for task in tasks[1:]]
    return [tasks[0](), *(f.result() for f in others)]


_scratch = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A float32 buffer of at least n numbers, kept per thread: a fresh one each call would fault in
    its pages again for every matrix of every layer."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, dtype=F32)
    return buf


def matmul(x: np.ndarray, w) -> np.ndarray:
    """x [n, n_cols] float32 @ w.T → [n, n_rows] for a PackedMatrix (or StackedMatrix) w."""
    x = np.ascontiguousarray(x, dtype=F32)
    if hasattr(w, "parts"):
        return np.concatenate([matmul(x, part) for part in w.parts], axis=1)
    if takes_bytes(w) or kernels_take(x.shape[0]):
        return kernel_product(x, w)
    return tile_product(x, w)


# What a model's products take their inputs as (Model's `activations`): "f32" as computed, exactly; "q8"
# quantized to bytes, a scale for each 32 columns of a row (quantize_rows), as llama.cpp multiplies:
# 4 products of bytes in one 32-bit lane of an instruction (vectors._nibble_dots), 2.5x sgemm's speed on
# a 7B's Q4_K matrices at 512 rows here, within ~0.5 % of the exact products (docs/performance.md).
ACTIVATIONS = ("f32", "q8")


def takes_bytes(w) -> bool:
    """Whether a product with w quantizes its inputs to bytes: under activations "q8", a Q4_K matrix or
    integers with a scale for each 16 or 32 columns (and an offset only for 32)."""
    if w.activations != "q8":
        return False
    if w.in_q4_k:
        return True
    if w.values.dtype != np.int8 or w.scales is None:
        return False
    size = w.n_cols // w.scales.shape[1]
    return size == 32 or (size == 16 and w.offsets is None)


def kernel_product(x: np.ndarray, w) -> np.ndarray:
    """matmul in the kernels: each weight read once for all rows (as bytes where takes_bytes)."""
    n = x.shape[0]
    n_groups, n_cols = w.values.shape[0], w.n_cols
    out = np.empty((n, n_groups * LANES), dtype=F32)
    if n > 2 and n % ROWS:  # the kernel reads ROWS rows at a time past 2: zeros after the last
        x = np.concatenate([x, np.zeros((ROWS - n % ROWS, n_cols), F32)])
    if takes_bytes(w):
        xq, x_runs = quantize_rows(x)
        _product(w.values, w.scales, w.offsets, xq.view(np.int32), x_runs, out)
    else:
        x_sums = k_quants.run_sums(x) if w.in_q4_k else None
        _product(w.values, w.scales, w.offsets, x, x_sums, out)
    return out[:, : w.n_rows]


def tile_product(x: np.ndarray, w) -> np.ndarray:
    """matmul by BLAS, on tiles of w dequantized into a reused buffer."""
    n = x.shape[0]
    n_groups, n_cols = w.values.shape[0], w.n_cols
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
    elif w.in_q4_k:
        k_quants.dequantize_tile(w.values, w.scales, w.offsets, g0, g1, out)
    else:
        _dequantize_int8(w.values, w.scales, w.offsets, g0, g1, out)


def rows(w, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a PackedMatrix (or StackedMatrix) as float32 [len(ids), n_cols] (a tied embedding
    table's lookups)."""
    ids = np.asarray(ids, dtype=np.int64)
    if hasattr(w, "parts"):
        starts = np.cumsum([0] + [p.n_rows for p in w.parts])
        out = np.empty((len(ids), w.n_cols), F32)
        for part, start, end in zip(w.parts, starts[:-1], starts[1:], strict=True):
            mine = (ids >= start) & (ids < end)
            out[mine] = rows(part, ids[mine] - start)
        return out
    if w.in_q4_k:
        blocks = k_quants.gguf_blocks(w.values, w.scales, w.offsets, ids)
        return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K), F32)
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
