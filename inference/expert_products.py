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


def segments(counts: np.ndarray) -> np.ndarray:
    """Where each expert's segment of rows starts in the padded array, and (last) its total rows."""
    return np.concatenate([[0], np.cumsum([padded(int(n)) for n in counts])]).astype(np.int64)


def grouped_product(x: np.ndarray, starts: np.ndarray, counts: np.ndarray, experts: np.ndarray,
                    w: ExpertMatrices) -> np.ndarray:
    """out[segment j] = x[segment j] @ w[experts[j]].T for every segment, [starts[-1], w.n_rows]: x's
    segments padded with zero rows as `segments` lays them out (the padding rows of out are left 0)."""
    out = np.zeros((x.shape[0], w.n_groups * LANES), F32)
    if w.takes_bytes:
        xq, x_runs = quantize_rows(x)
        _grouped(w.values, w.scales, w.offsets, xq.view(np.int32), x_runs, out, starts, counts, experts)
    else:
        x_sums = k_quants.run_sums(x) if w.in_q4_k else None
        _grouped(w.values, w.scales, w.offsets, x, x_sums, out, starts, counts, experts)
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
        if n == 0:
            continue
        span = starts[j + 1] - start  # n and its padding rows
        v, s, o = values[e], _pick(scales, e), _pick(offsets, e)
        xs, sums, part = x[start : start + span], _rows(x_sums, start, span), out[start : start + n]
        if n == 2:
            _two_row_group_product(v, s, o, xs, sums, part, np.int64(g))
        else:
            _group_product(v, s, o, xs, sums, part, np.int64(g))
