"""Matrix products over packed weights (quants.py, k_quants.py): the compiled kernels, BLAS on dequantized
tiles, a packed matrix's rows as floats, and the plain reference of a product.

A kernel reads each weight once for all its input rows: its vector lanes run across LANES interleaved
rows of the matrix, each weight is dequantized once (value · scale + offset, as ggml's
`dequantize_row_*`) and multiplied into the partial sums of ROWS input rows at a time, which stay in
registers for the whole row of weights (LANES and ROWS fit the machine's registers: cpu.py). Every
output row is computed by the same instructions whatever the number of rows (no reassociation: only
multiply-adds are fused), so a row's result does not depend on what else is in the batch
(prompt-lookup verification and the scheduler rely on that). Inputs as bytes (activations.py) go
through the byte kernels (byte_vectors.py), exact integer sums a block at a time.

BLAS (sgemm) multiplies tiles of the matrix dequantized into a reused float32 buffer. A tile fits half
the core's L2 cache, so that sgemm reads what the dequantization just wrote from there. Which of the two
takes a product is kernels.py's choice.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import gguf
import numpy as np
from numba import carray, types
from numba.extending import overload

from . import block_formats, k_quants, threads
from .activations import quantize_rows, quantize_rows_reference
from .byte_vectors import _byte_column_dots, in_lane_order
from .cpu import PARALLEL_PRODUCT_FROM, PROFILE
from .half import to_floats
from .jit import njit, prange
from .vectors import _dequantize_column, _multiply_add, _prefetch, _registers

# numba compiles these in as constants: code compiled for other values lives in another cache folder.
LANES = PROFILE.lanes  # rows interleaved in the packed layout; one or two input rows run across all
ROWS = PROFILE.rows  # input rows a pass multiplies at once past two, their partial sums in registers,
PASS_LANES = PROFILE.pass_lanes  # across this many lanes at a time
SUMS = max(ROWS * PASS_LANES, 2 * LANES)  # (a literal, as _registers wants it)
TILE_BYTES = PROFILE.tile_bytes  # float32 tile of a matrix dequantized for BLAS
# Whether the byte products' 16-bit sums of pairs (vpmaddubsw) may add up over several words before
# widening, where a matrix's weights are small (AVX2, AVX-512 BW; VNNI's vpdpbusd adds into 32 bits)
SUMS_IN_16_BITS = PROFILE.byte_dot in ("avx2", "bw")
AHEAD_IN_PASSES = PROFILE.ahead_in_passes  # whether passes past two rows ask for their weights ahead
# From this many input rows a product with a Q6_K matrix in its bits makes each group int8 first
# (_q6_k_tile_product): a 7B's ffn_down on the Zen 4 (AVX-512) at 256 rows took 137 ms by the bits' own
# kernel and 113 through int8 tiles (kernel_rows.py, alternating: 197–237 against 125–142), at 64 about
# the same (35.0 / 33.9); at 32 int8 alone took 15.1 against 22.1, but making the matrix int8 8.4 more.
# A prompt is read 512 rows a pass (model.DEFAULT_PREFILL_BATCH). Making a group int8 now takes a quarter
# of what it did (k_quants.q6_k_group_as_int8); on AVX-512 the bits' own kernel still wins below 128 rows
# (64: 28–31 ms against 32–48). On AVX2 its several-row kernel is slower (16 rows 18–21 ms, tiles 14,
# int8 10.5–11): tiles from 8 rows there (8: 9.3 against 10.0; at 4 the own kernel, 6.0 against 6.9).
Q6_K_TILES_FROM = 8 if PROFILE.byte_dot == "avx2" else 128
F32 = np.float32


@njit(cache=True)
def _n_blocks(scales):
    """Groups of weights with a scale of their own in a row (a function of its own, where numba drops
    the branch a None takes: the layouts' overload below is typed without that pruning)."""
    return 1 if scales is None else scales.shape[1]


def _accumulate(values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead):
    """The partial sums of a pass over a group's weights, by the matrix's layout (numba picks one when
    it compiles): int8 or float values (_accumulate_values), or Q4_K's own bits (k_quants.py); `ahead`:
    whether the pass asks for its weights ahead of reading them (Profile.ahead_in_passes)."""


@overload(_accumulate, inline="always", prefer_literal=True)
def _accumulate_by_layout(
    values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
):
    if values.dtype == types.uint8 and isinstance(offsets, types.Array) and offsets.dtype == types.int8:
        if x.dtype == types.int32:  # Q6_K's bits, inputs as bytes

            def in_q6_k_bytes(
                values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
            ):
                k_quants.accumulate_q6_k_q8(
                    values, scales, offsets, x, x_sums, i0, g, lane0, sums, rows, width, ahead
                )

            return in_q6_k_bytes

        def in_q6_k(
            values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
        ):
            k_quants.accumulate_q6_k(
                values, scales, offsets, x, i0, g, lane0, sums, w, runs, rows, width, ahead
            )

        return in_q6_k
    if x.dtype == types.int32 and values.dtype == types.uint8:  # inputs as bytes (quantize_rows)

        def in_q4_k_bytes(
            values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
        ):
            k_quants.accumulate_q8(
                values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, rows, width, ahead
            )

        return in_q4_k_bytes
    if x.dtype == types.int32:

        def in_value_bytes(
            values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
        ):
            _accumulate_value_bytes(
                values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, rows, width, ahead
            )

        return in_value_bytes
    if values.dtype != types.uint8:

        def in_values(
            values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
        ):
            _accumulate_values(values, scales, offsets, x, i0, g, lane0, sums, w, rows, width, ahead)

        return in_values

    def in_q4_k(
        values, scales, offsets, x, x_sums, small, i0, g, lane0, sums, runs, w, rows, width, ahead
    ):
        k_quants.accumulate(
            values, scales, offsets, x, x_sums, i0, g, lane0, sums, runs, w, rows, width, ahead
        )

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
def _accumulate_value_bytes(
    values, scales, offsets, xq, x_runs, small, i0, g, lane0, sums, rows, width, ahead
):
    """_accumulate_values for inputs as bytes (quantize_rows): a block's Σ w·x̂ in integers, times the
    bytes' scale and the block's, plus its offset times Σ x̂ (blocks of 32 columns where there are
    offsets: takes_bytes), by byte_vectors._byte_column_dots; `small`: the matrix's weights are within
    ±32 (PackedMatrix.small), so that without VNNI four words' 16-bit sums add up before widening."""
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
        if size == 16 and SUMS_IN_16_BITS and small:
            _byte_column_dots(
                values, at, lanes, 16, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs,
                scales, offsets, scale_at, sums, rows, width, True,
            )
        elif size == 16:
            _byte_column_dots(
                values, at, lanes, 16, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs,
                scales, offsets, scale_at, sums, rows, width, False,
            )
        elif SUMS_IN_16_BITS and small:
            _byte_column_dots(
                values, at, lanes, 32, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs,
                scales, offsets, scale_at, sums, rows, width, True,
            )
        else:
            _byte_column_dots(
                values, at, lanes, 32, xq, xq_at, n_words, x_runs, xr_at, 2 * n_runs,
                scales, offsets, scale_at, sums, rows, width, False,
            )
    in_lane_order(sums, rows, width)


@njit(cache=True)  # no fastmath: numba would mark the intrinsics' multiply and add as fusable too
def _group_product(values, scales, offsets, x, x_sums, small, out, g):
    """Columns g·L … g·L + L - 1 of out = x @ w.T, ROWS rows at a time (x is padded to a multiple of
    ROWS) across PASS_LANES lanes at a time."""
    registers, runs = _registers(SUMS), _registers(SUMS)
    w = _registers(LANES)
    n = out.shape[0]
    sums = carray(registers, (ROWS, PASS_LANES))
    for i0 in range(0, n, ROWS):
        for lane0 in range(0, LANES, PASS_LANES):
            ahead = AHEAD_IN_PASSES and i0 == 0  # the pass that reads the group from memory
            _accumulate(
                values, scales, offsets, x, x_sums, small, i0, g, lane0, registers, runs, w, ROWS, PASS_LANES,
                ahead,
            )
            for i in range(min(ROWS, n - i0)):
                for r in range(PASS_LANES):
                    out[i0 + i, g * LANES + lane0 + r] = sums[i, r]


@njit(cache=True)
def _one_row_group_product(values, scales, offsets, x, x_sums, small, out, g):
    """_group_product of one row (a token decoded alone) across all LANES, no padded rows. A function of
    its own, compiled after a first start's load (compile_later_rows): until then one row goes through
    the passes, padded, which give it the same bits, so a first reply waits for neither."""
    registers, runs = _registers(SUMS), _registers(SUMS)
    w = _registers(LANES)
    _accumulate(values, scales, offsets, x, x_sums, small, 0, g, 0, registers, runs, w, 1, LANES, True)
    sums = carray(registers, LANES)
    for r in range(LANES):
        out[0, g * LANES + r] = sums[r]


@njit(cache=True)
def _two_row_group_product(values, scales, offsets, x, x_sums, small, out, g):
    """_group_product of two rows (two replies decoded together, a draft of one token verified): both
    across all LANES, no padded rows. A function of its own, compiled after a first start's load (no
    first reply waits on it: compile_later_rows)."""
    registers, runs = _registers(SUMS), _registers(SUMS)
    w = _registers(LANES)
    _accumulate(values, scales, offsets, x, x_sums, small, 0, g, 0, registers, runs, w, 2, LANES, True)
    sums = carray(registers, (2, LANES))
    for i in range(2):
        for r in range(LANES):
            out[i, g * LANES + r] = sums[i, r]


@njit(cache=True, parallel=True)
def _product(values, scales, offsets, x, x_sums, small, out):
    for g in prange(values.shape[0]):  # a group's call is its own function: its registers its own
        # (g as int64: numba types a parallel loop's index both signed and unsigned, and a uint64 g
        # would compile _group_product a second time, seconds of a first start)
        _group_product(values, scales, offsets, x, x_sums, small, out, np.int64(g))


@njit(cache=True, parallel=True)
def _one_row_product(values, scales, offsets, x, x_sums, small, out):
    for g in prange(values.shape[0]):
        _one_row_group_product(values, scales, offsets, x, x_sums, small, out, np.int64(g))


@njit(cache=True, parallel=True)
def _two_row_product(values, scales, offsets, x, x_sums, small, out):
    for g in prange(values.shape[0]):
        _two_row_group_product(values, scales, offsets, x, x_sums, small, out, np.int64(g))


@njit(cache=True, parallel=True)
def _block_product(values, x, out):
    """_product of a block format's matrix (block_formats.py), a group of rows at a time
    (block_group_product)."""
    for g in prange(values.shape[0]):
        block_group_product(values, x, out, np.int64(g))


@njit(cache=True)
def block_group_product(values, x, out, g):
    """Columns g·L … g·L + L - 1 of out = x @ w.T for a block format's w: one row straight from the
    blocks (block_formats.one_row_group); more, the group decoded into a float32 tile, then multiplied
    by the float32 kernels' own code. Either way a product is the one of the matrix in float32, bit for
    bit. The tile of a group (its columns times LANES floats) stays in the core's cache for the passes
    over it."""
    n = out.shape[0]
    if n == 1:
        block_formats.one_row_group(values, x, out, g)
        return
    tile = np.empty((1, x.shape[1], LANES), F32)
    block_formats.decode_group(values, g, tile[0])
    part = np.empty((n, LANES), F32)
    if n == 2:
        _two_row_group_product(tile, None, None, x, None, False, part, np.int64(0))
    else:
        _group_product(tile, None, None, x, None, False, part, np.int64(0))
    for i in range(n):
        for r in range(LANES):
            out[i, g * LANES + r] = part[i, r]


@njit(cache=True, parallel=True)
def _q6_k_tile_product(values, d, sc, xq, x_runs, small, out):
    """_product of many rows (as bytes) with a Q6_K matrix in its bits: each group made int8 in a tile of
    its task's own (k_quants.q6_k_group_as_int8), then multiplied by the int8 kernels' passes (paired
    where the processor sums in 16 bits). The same integers and float steps as the bits' own kernel,
    so the same bits; its several-row kernel takes each weight's bits apart for every pass."""
    n_cols, n = values.shape[1] * 4 // 3, out.shape[0]
    for g in prange(values.shape[0]):
        tile = np.empty((1, n_cols, LANES), np.int8)
        scales = np.empty((1, n_cols // 16, LANES), F32)
        k_quants.q6_k_group_as_int8(values, d, sc, g, tile[0], scales[0])
        part = np.empty((n, LANES), F32)
        _group_product(tile, scales, None, xq, x_runs, True, part, np.int64(0))
        for i in range(n):
            for r in range(LANES):
                out[i, g * LANES + r] = part[i, r]


@njit(cache=True)
def _dequantize_int8(values, scales, offsets, g0, g1, out):
    """Groups g0..g1-1 as float32 into out [n_cols, (g1 - g0)·L]: the transposed tile BLAS multiplies.
    On the calling thread: a tile takes microseconds, and waking numba's threads for each one, between
    sgemm calls whose OpenBLAS threads still spin, costs more than it saves. Plain multiply and add
    (offsets None where the matrix has none): the weights exactly as gguf.quants dequantizes them."""
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


COMPILED = (_product, _group_product, _dequantize_int8, k_quants.dequantize_tile)


def takes_bytes(w) -> bool:
    """Whether a product with w quantizes its inputs to bytes: under activations "q8", a Q4_K matrix or
    integers with a scale for each 16 or 32 columns (and an offset only for 32)."""
    if w.activations != "q8":
        return False
    if w.in_q4_k or w.in_q6_k:
        return True
    if w.values.dtype != np.int8 or w.scales is None:
        return False
    size = w.n_cols // w.scales.shape[1]
    return size == 32 or (size == 16 and w.offsets is None)


def kernel_product(x: np.ndarray, w) -> np.ndarray:
    """x [n, n_cols] float32 @ w.T in the kernels: each weight read once for all rows (as bytes where
    takes_bytes)."""
    n = x.shape[0]
    n_groups, n_cols = w.values.shape[0], w.n_cols
    out = np.empty((n, n_groups * LANES), dtype=F32)
    if n == 1 and one_row_kernel_for(w):
        product = _one_row_product
    elif n == 2:
        product = _two_row_product
    else:
        product = _q6_k_tile_product if n >= Q6_K_TILES_FROM and w.in_q6_k and takes_bytes(w) else _product
        if n % ROWS:  # the passes read ROWS rows at a time: zeros after the last
            x = np.concatenate([x, np.zeros((ROWS - n % ROWS, n_cols), F32)])
    if n == 1 and w.nbytes < PARALLEL_PRODUCT_FROM:
        with threads.kernels_on_this_thread():
            _multiply(product, x, w, out)
    else:
        _multiply(product, x, w, out)
    return out[:, : w.n_rows]


def _multiply(product, x: np.ndarray, w, out: np.ndarray) -> None:
    """out = x @ w.T by one of the product kernels, its inputs as bytes where takes_bytes; a block
    format's by its own kernel, which runs the passes' code (or the two-row kernel's)."""
    if w.values.ndim == 4:
        _block_product(w.values, x, out)
    elif takes_bytes(w):
        xq, x_runs = quantize_rows(x)
        product(w.values, w.scales, w.offsets, xq.view(np.int32), x_runs, w.small, out)
    else:
        x_sums = k_quants.run_sums(x) if w.in_q4_k else None
        product(w.values, w.scales, w.offsets, x, x_sums, w.small, out)


# Whether this process leaves the one-row kernels to compile_later_rows (compile_one_row_later), and the
# kinds of product (kind_of_product) whose one-row kernel it has made ready since.
_one_row_later = False
_one_row_ready: set[tuple] = set()


def compile_one_row_later() -> None:
    """From now on a first start's load leaves the one-row kernels (nearly half of what it compiles) to
    compile_later_rows, on a thread after the load (app/chat/build.compile_later); until a kind's is
    ready, one row goes through the passes, padded, which give it the same bits."""
    global _one_row_later
    _one_row_later = True


def one_row_kernel_for(w) -> bool:
    """Whether a product of one row with w takes the one-row kernel (else the passes). A block format's
    kernel (_block_product) compiles its one-row path with it, at the load of a model with one."""
    return w.values.ndim == 4 or not _one_row_later or kind_of_product(w) in _one_row_ready


def kind_of_product(w) -> tuple:
    """What a product with w is compiled for: its layout and whether it takes bytes."""
    return w.values.dtype, w.scales is None, w.offsets is None, takes_bytes(w)


def compile_later_rows(matrices) -> None:
    """The one-row and two-row products of these matrices' kinds (and input types), and a long prompt's
    int8 tiles of a Q6_K matrix in its bits, compiled or loaded from the cache: what a first start
    leaves to a thread of its own. Until a kind's one-row kernel is ready a decoded token goes through
    the passes, padded, which give it the same bits; a product of two rows that comes first waits for
    numba's compiler lock and runs what it compiled."""
    kinds = {}
    for matrix in matrices:
        for w in getattr(matrix, "parts", [matrix]):
            kinds.setdefault(kind_of_product(w), w)
    for kind, w in kinds.items():  # one row first: a first reply's decode
        out = np.empty((1, w.values.shape[0] * LANES), F32)
        _multiply(_one_row_product, np.zeros((1, w.n_cols), F32), w, out)
        _one_row_ready.add(kind)
    for w in kinds.values():
        kernel_product(np.zeros((2, w.n_cols), F32), w)
        if w.in_q6_k and takes_bytes(w):  # a long prompt's: its groups made int8 (_q6_k_tile_product),
            # on its first group alone (the same types): the whole of a 7B's output matrix is ~140 GOP
            first = replace(w, values=w.values[:1], scales=w.scales[:1], offsets=w.offsets[:1], n_rows=LANES)
            kernel_product(np.zeros((Q6_K_TILES_FROM, w.n_cols), F32), first)


_scratch = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A float32 buffer of at least n numbers, kept per thread: a fresh one each call would fault in
    its pages again for every matrix of every layer."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, dtype=F32)
    return buf


def tile_product(x: np.ndarray, w) -> np.ndarray:
    """x [n, n_cols] float32 @ w.T by BLAS, on tiles of w dequantized into a reused buffer."""
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
    if w.values.ndim == 4:
        block_formats.dequantize_tile(w.values, g0, g1, out)
    elif w.scales is None:
        out[:] = to_floats(w.values[g0:g1].transpose(1, 0, 2)).reshape(out.shape)
    elif w.in_q4_k:
        k_quants.dequantize_tile(w.values, w.scales, w.offsets, g0, g1, out)
    elif w.in_q6_k:
        k_quants.dequantize_q6_k_tile(w.values, w.scales, w.offsets, g0, g1, out)
    else:
        _dequantize_int8(w.values, w.scales, w.offsets, g0, g1, out)


def rows(w, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a PackedMatrix (or StackedMatrix) as float32 [len(ids), n_cols], each weight as
    gguf.quants dequantizes it (a tied embedding table's lookups; the products' reference)."""
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
    if w.in_q6_k:
        blocks = k_quants.q6_k_gguf_blocks(w.values, w.scales, w.offsets, ids)
        return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K), F32)
    if w.values.ndim == 4:
        return block_formats.gguf_rows(w.values, ids)
    g, lane = ids // LANES, ids % LANES
    values = w.values[g, :, lane]  # [n, n_cols]
    if w.scales is None:
        return to_floats(values)
    n, n_cols = values.shape
    scales = w.scales[g, :, lane]  # [n, n_blocks]
    out = values.reshape(n, scales.shape[1], -1).astype(F32) * scales[:, :, None]
    if w.offsets is not None:
        out += w.offsets[g, :, lane][:, :, None]
    return out.reshape(n, n_cols)


def product_reference(x: np.ndarray, w) -> np.ndarray:
    """What kernel_product and tile_product compute, as the maths reads, in float64: x @ w.T over the
    GGUF's own weights; where the inputs go as bytes (takes_bytes), over the bytes x̂ = xq · scale
    instead (offsets included: offset · Σ x̂), as llama.cpp's products of bytes."""
    if hasattr(w, "parts"):
        return np.concatenate([product_reference(x, part) for part in w.parts], axis=1)
    weights = rows(w, np.arange(w.n_rows)).astype(np.float64)  # [n_rows, n_cols]
    if not takes_bytes(w):
        return x.astype(np.float64) @ weights.T
    xq, x_runs = quantize_rows_reference(x)
    n, n_cols = x.shape
    x_hat = (xq.reshape(n, -1, 32) * x_runs[:, :, 1:].astype(np.float64)).reshape(n, n_cols)
    return x_hat @ weights.T
