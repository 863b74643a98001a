"""numba, set up once: compiled kernels are cached in the user cache directory, so a warm start compiles
nothing. Every module with kernels imports `njit` and `prange` from here."""

from __future__ import annotations

import os

# numba's OpenMP threads sleep between kernels instead of spinning: a kernel runs ~100 times per
# token, and spinning threads on a 2-core machine take the cores from BLAS, the other kernel thread
# or anything else running (measured here with another job running: 1.8 tok/s spinning, 6.5 sleeping).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

from .catalog import cache_dir  # noqa: E402

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


__all__ = ["in_cache", "njit", "prange"]
