"""What a model's products take their inputs as, and the rows of inputs as bytes.

"f32": as computed, exactly. "q8", the default: each row quantized to bytes with a scale for each run of
32 columns, as llama.cpp multiplies (its q8 inputs): the byte kernels (byte_vectors.py) then add up four
products of bytes in one 32-bit lane of an instruction, within ~0.5 % of the exact products
(docs/performance.md, "Inputs as bytes"); its logits lie nearer the exact model's than llama.cpp's on
every reference text and its greedy replies are llama.cpp's. "mixed": bytes where a product's inputs come
straight from a norm (NORMED_INPUTS), float32 for the others: nearer the exact logits than "q8" on eight
texts of fourteen, slower to prefill (docs/benchmarks.md, "Agreement with llama.cpp"). "f32" is the
exact mode.
"""

from __future__ import annotations

import numpy as np

from .cpu import PROFILE
from .jit import njit, prange

F32 = np.float32
# The matrices whose inputs come straight from an RMS norm, where no channel stands far above the rest:
# bytes with a scale per 32 columns keep them well. The others' inputs (attention's mix of values, the
# FFN's gated product) carry a few channels far above the rest, and a run's scale set by one of those
# rounds its small neighbours away: under "mixed" they stay float32, which keeps the logits nearer the
# exact model's than "q8" on most reference texts (docs/benchmarks.md).
NORMED_INPUTS = ("attn_qkv", "ffn_gate_up", "output")
# Input numbers from which quantize_rows runs on numba's threads: below it, waking them costs more than
# the rows take.
QUANTIZE_IN_PARALLEL_FROM = PROFILE.quantize_in_parallel_from


# Raised when the arithmetic of products over bytes changes (2: offsets times the sum of the bytes, not
# of the float32 inputs): KV computed from bytes names it (Weights.fingerprint), so KV stored by an
# earlier one is recomputed, not resumed with replies a fresh start would not give.
BYTES_REVISION = 2


def inputs_of(activations: str, matrix: str) -> str:
    """What one matrix's products take as inputs, "f32" or "q8", under a model's `activations`; `matrix`
    is its name in the packed file ("output", "blk.3.ffn_down", "blk.0.attn_qkv#1")."""
    if activations != "mixed":
        return activations
    return "q8" if matrix.rpartition(".")[2].partition("#")[0] in NORMED_INPUTS else "f32"


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, n_cols] float32 as bytes: xq [n, n_cols] int8 and, for each run of 32 columns, [n, n_cols /
    32, 2] its Σ x̂ = scale·Σ xq and its scale, max |x| / 127, with xq = round(x / scale). A product adds
    offset·Σ x̂, as llama.cpp adds the sums of its Q8_1 and Q8_K blocks, so that it is the one of the
    exact weights with the inputs x̂: with the exact Σ x, the bytes' rounding errors would meet the
    weights less their offset, as large as a run's range, instead of the weights. Row by row: a row's
    bytes do not depend on its batch."""
    n, n_cols = x.shape
    xq = np.empty((n, n_cols), np.int8)
    x_runs = np.empty((n, n_cols // 32, 2), F32)
    (_quantize_in_parallel if x.size >= QUANTIZE_IN_PARALLEL_FROM else _quantize)(x, xq, x_runs)
    return xq, x_runs


def quantize_rows_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_rows in plain NumPy, bit for bit: the same float32 operations, in the same order."""
    n, n_cols = x.shape
    runs = x.reshape(n, n_cols // 32, 32)
    scale = np.abs(runs).max(axis=2) / F32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale > 0, F32(1) / scale, F32(0)).astype(F32)
    xq = np.rint(runs * inverse[:, :, None]).astype(np.int8)
    total = xq.sum(axis=2, dtype=np.int32).astype(F32) * scale
    return xq.reshape(n, n_cols), np.stack([total, scale], axis=2)


def compile_quantize(in_parallel: bool = False) -> None:
    """quantize_rows' loop for a few rows (a first reply's), or `in_parallel` its loop over numba's
    threads (a long prompt's), compiled or loaded from the cache."""
    x = np.zeros((1, 32), F32)
    quantize = _quantize_in_parallel if in_parallel else _quantize
    quantize(x, np.empty((1, 32), np.int8), np.empty((1, 1, 2), F32))


@njit(cache=True, inline="always")
def _quantize_row(x, i, xq, x_runs):
    for r in range(x.shape[1] // 32):
        top = F32(0)
        for t in range(32 * r, 32 * r + 32):
            top = max(top, abs(x[i, t]))
        scale = top / F32(127)
        inverse = F32(1) / scale if scale > 0 else F32(0)
        total = 0
        for t in range(32 * r, 32 * r + 32):
            xq[i, t] = np.int8(np.rint(x[i, t] * inverse))
            total += np.int32(xq[i, t])
        x_runs[i, r, 0], x_runs[i, r, 1] = F32(total) * scale, scale


@njit(cache=True)
def _quantize(x, xq, x_runs):
    for i in range(x.shape[0]):
        _quantize_row(x, i, xq, x_runs)


@njit(cache=True, parallel=True)
def _quantize_in_parallel(x, xq, x_runs):
    for i in prange(x.shape[0]):
        _quantize_row(x, i, xq, x_runs)
