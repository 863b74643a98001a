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


def in_cache(kernel) -> bool:
    """Whether a kernel's compiled code is in the cache for its current source (else it compiles)."""
    try:
        index = kernel._cache._cache_file._index_path
        source = kernel.py_func.__code__.co_filename
        return os.path.getmtime(index) >= os.path.getmtime(source)
    except (AttributeError, OSError):
        return False


def set_threads(n: int | None) -> None:
    """Threads for the kernels (the BLAS takes its count from the environment before NumPy loads)."""
    if n:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


__all__ = ["in_cache", "njit", "prange", "set_threads"]
