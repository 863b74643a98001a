"""Products of many experts' matrices in one compiled call: a decode step's k chosen experts, or a prompt's
experts over the rows routed to each (experts.py).

Each expert's rows of input are a segment of one array (padded as kernel_product pads them), and one
parallel loop runs every (segment, group of matrix rows) pair with the kernels' own group products: the
same instructions as kernel_product's for each row, so the same bits, but one wake of the threads a
step for all experts instead of one for each, and no Python between them.
"""

from __future__ import annotations

import numpy as np
from numba import typed, types
from numba.extending import overload

from . import k_quants
from .activations import quantize_rows
from .jit import njit, prange
from .products import LANES, ROWS, _group_product, _two_row_group_product, takes_bytes

F32 = np.float32


class ExpertMatrices:
    """One matrix of each of a layer's experts (all packed alike), as lists the compiled loop indexes."""

    def __init__(self, matrices):
        first = matrices[0]
        self.n_rows, self.n_cols, self.n_groups = first.n_rows, first.n_cols, first.values.shape[0]
        self.in_q4_k, self.takes_bytes = first.in_q4_k, takes_bytes(first)
        self.values = typed.List([m.values for m in matrices])
        self.scales = None if first.scales is None else typed.List([m.scales for m in matrices])
        self.offsets = None if first.offsets is None else typed.List([m.offsets for m in matrices])


def matrices_of(matrices) -> ExpertMatrices | None:
    """The experts' matrices as one ExpertMatrices, or None where they are not all packed alike in one
    PackedMatrix each (a StackedMatrix: then each expert is multiplied on its own)."""
    if any(hasattr(m, "parts") for m in matrices):
        return None
    first = matrices[0]
    kind = (first.values.dtype, first.values.shape, first.scales is None, first.offsets is None)
    same = all((m.values.dtype, m.values.shape, m.scales is None, m.offsets is None) == kind for m in matrices)
    return ExpertMatrices(matrices) if same else None


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
        _grouped(w.values, w.scales, w.offsets, xq.view(np.int32), x_runs, out, *segments)
    else:
        x_sums = k_quants.run_sums(x) if w.in_q4_k else None
        _grouped(w.values, w.scales, w.offsets, x, x_sums, out, *segments)
    return out[:, : w.n_rows]


def _pick(arrays, e):
    """Expert e's array of a list, or None where the matrices have none."""


@overload(_pick, inline="always")
def _pick_by_type(arrays, e):
    if isinstance(arrays, types.NoneType):
        return lambda arrays, e: None
    return lambda arrays, e: arrays[e]


def _rows(x, start, n):
    """Rows start … start + n - 1 of x, or None where there is no x."""


@overload(_rows, inline="always")
def _rows_by_type(x, start, n):
    if isinstance(x, types.NoneType):
        return lambda x, start, n: None
    return lambda x, start, n: x[start : start + n]


@njit(cache=True, parallel=True)
def _grouped(values, scales, offsets, x, x_sums, out, starts, counts, experts):
    n_groups = values[0].shape[0]
    for job in prange(len(experts) * n_groups):
        j, g = job // n_groups, job % n_groups
        e, start, n = experts[j], starts[j], counts[j]
        span = starts[j + 1] - start  # n and its padding rows
        v, s, o = values[e], _pick(scales, e), _pick(offsets, e)
        xs, sums, part = x[start : start + span], _rows(x_sums, start, span), out[start : start + n]
        if n == 2:
            _two_row_group_product(v, s, o, xs, sums, part, np.int64(g))
        else:
            _group_product(v, s, o, xs, sums, part, np.int64(g))
        out[start + n : start + span, g * LANES : (g + 1) * LANES] = 0
