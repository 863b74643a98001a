"""numba, set up once: compiled kernels are cached in the user cache directory, so a warm start compiles
nothing. Every module with kernels imports `njit` and `prange` from here."""

from __future__ import annotations

import os

import numba
from numba import njit, prange

from .catalog import cache_dir

# NUMBA_CACHE_DIR, when the user sets it, wins (numba read it on import); else our own cache folder.
if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = str(cache_dir() / "numba")


def set_threads(n: int | None) -> None:
    """Threads for the kernels (the BLAS takes its count from the environment before NumPy loads)."""
    if n:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


__all__ = ["njit", "prange", "set_threads"]
