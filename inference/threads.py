"""The threads the kernels run on: how many BLAS uses, numba's own left asleep for a small product, and a
pool for work split by hand (a prompt's attention by query rows, unpacking a matrix by groups of rows).

OpenBLAS's threads spin for a while after each call before they sleep. In a step of the kernels BLAS only
multiplies the attention's small matrices, and its spinning threads would take the cores from the
kernels' threads: there BLAS runs on one thread. A long prefill through BLAS on dequantized tiles wants
every BLAS thread it started with (`--threads`). Figures: docs/performance.md, "Threads".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numba
import numpy as np
from threadpoolctl import ThreadpoolController

_blas = ThreadpoolController().select(user_api="blas").lib_controllers
_blas_threads = {id(c): c.get_num_threads() for c in _blas}  # as started (--threads)
_blas_on_one = False
_helpers: ThreadPoolExecutor | None = None


def blas_on_one_thread(one: bool) -> None:
    """BLAS on one thread (`one`), else on all it started with. Cheap when nothing changes (a ctypes
    call per BLAS library)."""
    global _blas_on_one
    _blas_on_one = one
    for c in _blas:
        want = 1 if one else _blas_threads[id(c)]
        if c.get_num_threads() != want:
            c.set_num_threads(want)


def blas_is_on_one_thread() -> bool:
    return _blas_on_one


@contextmanager
def kernels_on_this_thread() -> Iterator[None]:
    """numba's parallel kernels run on the calling thread alone while in the block: they wake no other
    thread (numba's count is the calling thread's own, so other threads' kernels keep theirs)."""
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(n)


def in_parallel(tasks: list[Callable[[], np.ndarray]]) -> list[np.ndarray]:
    """The tasks' results in order: the first run on this thread, the others on helper threads."""
    global _helpers
    if _helpers is None:
        _helpers = ThreadPoolExecutor(max(1, numba.config.NUMBA_NUM_THREADS - 1), "kernel-helper")
    others = [_helpers.submit(task) for task in tasks[1:]]
    return [tasks[0](), *(f.result() for f in others)]
