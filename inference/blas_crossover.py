"""Where BLAS takes over from the kernels (kernels.blas_from): the fewest rows from which BLAS on
dequantized tiles beats the kernels, timed on this machine's first start and kept beside its compiled
kernels, by machine profile and thread count."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numba
import numpy as np

from . import kernels
from .cpu import PROFILE
from .quants import PackedMatrix, zero_matrix

F32 = np.float32
Q = gguf.GGMLQuantizationType

# Rows at which BLAS on tiles and the kernels are timed against each other, on a matrix the size of the
# default model's larger ones. Not 64: there the kernels run at ~92 % of sgemm on float weights; BLAS won
# this test by a hair on an idle Xeon, then lost the default model's 64-token turn by 1.5x.
CROSSOVER_ROWS = (128, 256, 512)
CROSSOVER_SHAPE = (4096, kernels.BLAS_WIDEST)
_measured: dict[str, int | None] = {}  # this process's, by machine


def crossover_key() -> str:
    """What the crossover depends on: the machine profile (the kernels' code and shape) and the threads."""
    return f"{PROFILE.key} {numba.config.NUMBA_NUM_THREADS} threads"


def measured_blas_from() -> int | None:
    """kernels.blas_from for this machine profile and thread count: measured on its first start (under a
    second, after the load: warmup.compile_long_prompts), then read from a file beside the profile's
    compiled kernels."""
    machine = crossover_key()
    path = Path(numba.config.CACHE_DIR) / "blas_from.json"
    if machine not in _measured:
        try:
            kept = json.loads(path.read_text())
            if isinstance(kept, dict):  # a damaged file is measured again and rewritten
                _measured.update({k: v for k, v in kept.items() if v is None or type(v) is int})
        except (OSError, ValueError):
            pass
    if machine not in _measured:
        _measured[machine] = measure_blas_from()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_measured))
            tmp.replace(path)
        except OSError:
            pass  # measured again next start
    return _measured[machine]


def measure_blas_from(repeats: int = 5) -> int | None:
    """The fewest rows from which BLAS on dequantized tiles beats the kernels at every size measured
    (the best of `repeats` interleaved runs each), or None when the kernels win at the largest. Sizes
    are timed from the largest down, up to the first the kernels win: the smaller ones could not change
    the answer (timing all four took 6.5 s of CPU of a first start here, the largest alone half)."""
    n_cols = CROSSOVER_SHAPE[1]
    w = zero_matrix(Q.Q8_0, CROSSOVER_SHAPE)
    blas_from = None
    for n in reversed(CROSSOVER_ROWS):
        if not _blas_wins(np.zeros((n, n_cols), F32), w, repeats):
            break
        blas_from = n
    return blas_from


def _blas_wins(x: np.ndarray, w: PackedMatrix, repeats: int) -> bool:
    times = {kernels.kernel_product: [], kernels.tile_product: []}
    for _ in range(repeats):
        for product, seconds in times.items():
            kernels.blas_on_one_thread(product is kernels.kernel_product)  # as each runs in a step
            t0 = time.perf_counter()
            product(x, w)
            seconds.append(time.perf_counter() - t0)
    return min(times[kernels.tile_product]) < min(times[kernels.kernel_product])
