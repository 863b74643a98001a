"""Products of many experts' matrices in one compiled call: a decode step's k chosen experts, or a prompt's
experts over the rows routed to each (experts.py).

Each expert's rows of input are a segment of one array (padded as kernel_product pads them), and one
parallel loop runs every (segment, group of matrix rows) pair with the kernels' own group products: the
same instructions as kernel_product's for each row, so the same bits, but one wake of the threads a
step for all experts instead of one for each, and no Python between them.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types
from numba.extending import intrinsic, overload

from . import k_quants
from .activations import quantize_rows
from .jit import njit, prange
from .products import (
    LANES,
    ROWS,
    _group_product,
    _one_row_group_product,
    _two_row_group_product,
    block_group_product,
    takes_bytes,
)

F32 = np.float32


class ExpertMatrices:
    """One matrix of each of a layer's experts (all packed alike), as the compiled loop finds them: the
    addresses of each expert's arrays, and expert 0's arrays for their type and shape."""

    def __init__(self, matrices):
        self.matrices = matrices  # (keeps the arrays at those addresses)
        first = matrices[0]
        self.n_rows, self.n_groups = first.n_rows, first.values.shape[0]
        self.in_q4_k, self.takes_bytes, self.small = first.in_q4_k, takes_bytes(first), first.small
        self.values, self.scales, self.offsets = first.values, first.scales, first.offsets
        self.at = tuple(
            None if a is None else np.array([getattr(m, name).ctypes.data for m in matrices], np.int64)
            for name, a in (("values", first.values), ("scales", first.scales), ("offsets", first.offsets))
        )


def _layout(m) -> tuple:
    """What the compiled loop takes alike from every expert: each array's type, shape and contiguity, and
    whether its weights are small."""
    arrays = (m.values, m.scales, m.offsets)
    return (*(None if a is None else (a.dtype, a.shape, a.flags.c_contiguous) for a in arrays), m.small)


def matrices_of(matrices) -> ExpertMatrices | None:
    """The experts' matrices as one ExpertMatrices, or None where they are not all packed alike in one
    PackedMatrix each (a StackedMatrix…: then each expert is multiplied on its own)."""
    if any(hasattr(m, "parts") for m in matrices):
        return None
    kind = _layout(matrices[0])
    alike = all(_layout(m) == kind for m in matrices) and all(a is None or a[2] for a in kind[:3])
    return ExpertMatrices(matrices) if alike else None


def padded(n: int) -> int:
    """The rows kernel_product multiplies for n input rows: past two, a multiple of ROWS."""
    return n if n <= 2 else -(-n // ROWS) * ROWS


class Layout:
    """Where a step's (row, slot) pairs lie in the segments, one segment an expert: `experts` the
    experts chosen, in the order of their numbers, `counts` their pairs, `starts` their first rows (and
    last, the total, padding included); for each pair in segment order its row, slot and place (`at`)."""

    def __init__(self, chosen: np.ndarray, n_expert: int):
        counts = np.bincount(chosen.ravel(), minlength=n_expert)
        self.experts = np.flatnonzero(counts)
        self.counts = counts[self.experts]
        sizes = np.array([padded(int(n)) for n in self.counts], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.rows, self.slots, self.at = _pairs(chosen, self.experts, self.counts, self.starts)

    @property
    def n_rows(self) -> int:
        return int(self.starts[-1])


@njit(cache=True)
def _pairs(chosen, experts, counts, starts):
    """Each (row, slot) pair in segment order (rows in order within an expert) and its row there."""
    n, k = chosen.shape
    segment = np.full(chosen.max() + 1, -1, np.int64)
    for j in range(len(experts)):
        segment[experts[j]] = j
    filled = np.zeros(len(experts), np.int64)
    ends = np.cumsum(counts) - counts
    rows, slots, at = np.empty(n * k, np.int64), np.empty(n * k, np.int64), np.empty(n * k, np.int64)
    for t in range(n):
        for s in range(k):
            j = segment[chosen[t, s]]
            p = ends[j] + filled[j]
            rows[p], slots[p], at[p] = t, s, starts[j] + filled[j]
            filled[j] += 1
    return rows, slots, at


@njit(cache=True)
def gather_rows(x, rows, at, n_rows):
    """x's rows as the segments take them [n_rows, n_cols]: row rows[p] at at[p], zeros in padding."""
    out = np.zeros((n_rows, x.shape[1]), x.dtype)
    for p in range(len(rows)):
        out[at[p]] = x[rows[p]]
    return out


@njit(cache=True)
def add_shares(out, shares, rows, at, weights):
    """out[rows[p]] += shares[at[p]] · weights[p] for each pair p in turn (segment order: each row's
    experts in the order of their numbers), a product rounded to float32, then a sum, as NumPy adds."""
    for p in range(len(rows)):
        w = weights[p]
        for c in range(out.shape[1]):
            out[rows[p], c] += shares[at[p], c] * w


def grouped_product(x: np.ndarray, plan: Layout, w: ExpertMatrices) -> np.ndarray:
    """out[segment j] = x[segment j] @ w[plan.experts[j]].T for every segment, [plan.n_rows, w.n_rows],
    x laid out as `plan` says (gather_rows); the padding rows of out are zeros."""
    out = np.empty((x.shape[0], w.n_groups * LANES), F32)
    segments = (plan.starts, plan.counts, plan.experts)
    if w.takes_bytes:
        xq, x_runs = quantize_rows(x)
        _grouped(w.values, w.scales, w.offsets, *w.at, xq.view(np.int32), x_runs, w.small, out, *segments)
    else:
        x_sums = k_quants.run_sums(x) if w.in_q4_k else None
        _grouped(w.values, w.scales, w.offsets, *w.at, x, x_sums, w.small, out, *segments)
    return out[:, : w.n_rows]


@intrinsic
def _pointer(typingctx, address, sample):
    """An address (an integer) as a pointer to elements of sample's type."""
    sig = types.CPointer(sample.dtype)(address, sample)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


def _expert(addresses, e, sample):
    """Expert e's array, of sample's type and shape, or None where the matrices have none."""


@overload(_expert, inline="always")
def _expert_by_type(addresses, e, sample):
    if isinstance(sample, types.NoneType):
        return lambda addresses, e, sample: None
    return lambda addresses, e, sample: carray(_pointer(addresses[e], sample), sample.shape)


def _rows(x, start, n):
    """Rows start … start + n - 1 of x, or None where there is no x."""


@overload(_rows, inline="always")
def _rows_by_type(x, start, n):
    if isinstance(x, types.NoneType):
        return lambda x, start, n: None
    return lambda x, start, n: x[start : start + n]


@njit(cache=True, parallel=True)
def _grouped(
    values, scales, offsets, values_at, scales_at, offsets_at, x, x_sums, small, out, starts, counts, experts
):
    """Each segment's rows times its expert's matrix: expert e's arrays lie at values_at[e] (…), of the
    type and shape of values (…); segment j has counts[j] rows from starts[j], for expert experts[j]."""
    n_groups = values.shape[0]
    for job in prange(len(experts) * n_groups):
        j, g = job // n_groups, job % n_groups
        e, start, n = experts[j], starts[j], counts[j]
        span = starts[j + 1] - start  # n and its padding rows
        v = _expert(values_at, e, values)
        s, o = _expert(scales_at, e, scales), _expert(offsets_at, e, offsets)
        xs, sums, part = x[start : start + span], _rows(x_sums, start, span), out[start : start + n]
        _segment_product(v, s, o, xs, sums, small, part, np.int64(g))
        out[start + n : start + span, g * LANES : (g + 1) * LANES] = 0


def _segment_product(values, scales, offsets, x, x_sums, small, out, g):
    """Columns g·L … of a segment's rows out = x @ w.T (x padded as grouped_product lays it out), by the
    kernels that kernel_product takes for the matrix's layout and the segment's rows: one row (each
    of a decoded token's experts) across all lanes at once, not in the passes of ROWS rows, which
    would multiply three rows past the segment for nothing (on AVX2 in two passes of half the lanes,
    without asking for the weights ahead); a block format's (values [groups, blocks, block bytes,
    LANES]) by block_group_product."""


@overload(_segment_product, inline="always")
def _segment_product_by_layout(values, scales, offsets, x, x_sums, small, out, g):
    if values.ndim == 4:
        def in_blocks(values, scales, offsets, x, x_sums, small, out, g):
            block_group_product(values, x, out, g)

        return in_blocks

    def in_kernels(values, scales, offsets, x, x_sums, small, out, g):
        if out.shape[0] == 1:
            _one_row_group_product(values, scales, offsets, x, x_sums, small, out, g)
        elif out.shape[0] == 2:
            _two_row_group_product(values, scales, offsets, x, x_sums, small, out, g)
        else:
            _group_product(values, scales, offsets, x, x_sums, small, out, g)

    return in_kernels
