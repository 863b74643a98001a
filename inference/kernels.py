"""Which kernel takes each piece of the forward pass's work, and the names the forward pass calls them by.

The kernels live in rooms of their own, each fast kernel with its plain NumPy reference beside it (as
ggml keeps `*_generic` beside `arch/x86`), which the tests hold it to:
- products.py: matrix products over packed weights, in the compiled kernels or BLAS on dequantized
  tiles, and a packed matrix's rows as floats;
- activations.py: what products take their inputs as, and inputs quantized to bytes;
- attention.py: one new token's attention over the cache;
- threads.py: how many threads BLAS runs on, and a pool for work split by hand;
- vectors.py, byte_vectors.py (and k_quants.py for Q4_K's bits): the kernels' building blocks.

Up to KERNEL_ROWS input rows the kernels always take a product, so a row's bits never depend on its
batch. Past it, BLAS on dequantized tiles takes products from `blas_from` rows on, where this machine
measured it faster (blas_crossover.measured_blas_from, use_blas_from), with matrices of at most
BLAS_WIDEST columns of a model whose every product takes float32 (use_blas_threads_for); inputs as bytes
stay in the kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numba
import numpy as np

from . import threads
from .activation_modes import ACTIVATIONS, DEFAULT_ACTIVATIONS
from .activations import compile_quantize, quantize_rows
from .attention import (
    _exp_nonpositive,
    _merge_chunks,
    _one_token_attention,
    one_token_attention,
    rows_attention,
    tokens_attention,
)
from .cpu import PROFILE
from .products import COMPILED as _PRODUCTS
from .products import LANES, PASS_LANES, ROWS, kernel_product, rows, takes_bytes, tile_product
from .threads import blas_on_one_thread, in_parallel

KERNEL_ROWS = 32  # up to this many rows the kernels always run: a row's bits never depend on its batch
# The most columns of a matrix that BLAS on dequantized tiles takes, the crossover's matrix's
# (blas_crossover.py). Each sgemm call reads every input row for its tile's outputs, and a tile holds
# fewer groups of rows the more columns a matrix has (one group of LANES at 3584 and past): on a 7B's
# matrices (3584 and 18944 columns) and the 0.5B's ffn_down (4864) the kernels ran 1.4-3x faster at
# 512 rows (docs/performance.md, "Long prompts on wide matrices").
BLAS_WIDEST = 1024


class MeasuredLater:
    """blas_from until it is measured: `measure` runs once, on the thread that first asks (a load's
    compile-later thread, or a long prompt's step that comes sooner); a second caller waits for its
    answer, so a product's way never depends on which came first."""

    def __init__(self, measure: Callable[[], int | None]):
        self.measure, self.lock, self.measured = measure, threading.Lock(), None

    def value(self) -> int | None:
        with self.lock:
            if self.measure is not None:
                self.measured, self.measure = self.measure(), None
            return self.measured


# From this many rows on BLAS on dequantized tiles multiplies faster than the kernels; None: the kernels
# are faster at any size. Measured once per machine, where first needed (blas_crossover.py).
blas_from: int | None | MeasuredLater = KERNEL_ROWS + 1
# Query rows × cached positions from which a step of the kernels splits its attention by query rows over
# the threads (the profile's). Each part is single-threaded BLAS, exp and sums, all of which let go of
# the GIL; decode (one row) is never split.
PARALLEL_ATTENTION_FROM = PROFILE.parallel_attention_from
COMPILED = (*_PRODUCTS, _one_token_attention, _merge_chunks)


def use_blas_from(n: int | None | MeasuredLater) -> None:
    """BLAS takes products from n rows on (None: never), as measured on this machine (MeasuredLater:
    measured where first needed)."""
    global blas_from
    blas_from = n


def known_blas_from() -> int | None:
    """blas_from, measured first if it is not yet (waiting for a measurement under way)."""
    global blas_from
    pending = blas_from
    if not isinstance(pending, MeasuredLater):
        return pending
    n = pending.value()
    if blas_from is pending:
        blas_from = n
    return n


def kernels_take(rows: int) -> bool:
    """Whether a product of `rows` input rows runs in the kernels (else BLAS on dequantized tiles)."""
    if rows <= KERNEL_ROWS:
        return True
    n = known_blas_from()
    return n is None or rows < n


def tiles_fit(rows: int, w) -> bool:
    """Whether a product of `rows` input rows with the PackedMatrix w suits BLAS on dequantized tiles:
    float32 inputs past the crossover, a matrix of at most BLAS_WIDEST columns."""
    return not takes_bytes(w) and w.n_cols <= BLAS_WIDEST and not kernels_take(rows)


def tiles_take(rows: int, w) -> bool:
    """Whether that product runs as BLAS on tiles (else in the kernels): where it suits them and BLAS
    has all its threads (use_blas_threads_for). On one thread, its tiles would have one core where the
    kernels have all."""
    return tiles_fit(rows, w) and not threads.blas_is_on_one_thread()


def matmul(x: np.ndarray, w) -> np.ndarray:
    """x [n, n_cols] float32 @ w.T → [n, n_rows] for a PackedMatrix (or StackedMatrix) w."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if hasattr(w, "parts"):
        return np.concatenate([matmul(x, part) for part in w.parts], axis=1)
    return tile_product(x, w) if tiles_take(x.shape[0], w) else kernel_product(x, w)


def use_blas_threads_for(rows: int, activations: str = "f32", matrices: Callable[[], list] = list) -> None:
    """Before a forward step of `rows` rows of a model with these activations and `matrices` (a callable,
    called only where a product of so many rows may go to BLAS): BLAS on all the threads it started with
    where the model's every product takes float32 and one of them suits BLAS's tiles (tiles_fit), else on
    one thread, and then the kernels take every product. Beside the kernels, BLAS's spinning threads
    take the cores from them: a "mixed" step's products of bytes (most of its work) ran slower beside
    BLAS on all threads than its float32 products gained (docs/performance.md, "Long prompts on wide
    matrices")."""
    if activations != "f32" or kernels_take(rows):
        blas_on_one_thread(True)
        return
    parts = [part for w in matrices() for part in getattr(w, "parts", [w])]
    blas_on_one_thread(not any(tiles_fit(rows, w) for w in parts))


def attention_threads(rows: int, positions: int) -> int:
    """How many threads share the attention of `rows` query rows over `positions` cached ones: one
    where BLAS runs on all of its own (a step through dequantized tiles) or the work is small."""
    if not threads.blas_is_on_one_thread() or rows < 2 or rows * positions < PARALLEL_ATTENTION_FROM:
        return 1
    return min(numba.config.NUMBA_NUM_THREADS, rows)


__all__ = [
    "ACTIVATIONS",
    "BLAS_WIDEST",
    "COMPILED",
    "DEFAULT_ACTIVATIONS",
    "KERNEL_ROWS",
    "LANES",
    "MeasuredLater",
    "PASS_LANES",
    "ROWS",
    "_exp_nonpositive",
    "_one_token_attention",
    "attention_threads",
    "blas_on_one_thread",
    "compile_quantize",
    "in_parallel",
    "kernel_product",
    "kernels_take",
    "known_blas_from",
    "matmul",
    "one_token_attention",
    "quantize_rows",
    "rows",
    "takes_bytes",
    "tile_product",
    "tiles_fit",
    "tiles_take",
    "rows_attention",
    "tokens_attention",
    "use_blas_from",
    "use_blas_threads_for",
]
