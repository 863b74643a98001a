"""numba, set up once: compiled kernels are cached in the user cache directory, so a warm start compiles
nothing. Every module with kernels imports `njit` and `prange` from here."""

from __future__ import annotations

import os

# numba's OpenMP threads sleep between kernels instead of spinning: a kernel runs ~100 times per
# token, and spinning threads on a 2-core machine take the cores from BLAS, the other kernel thread
# or anything else running (measured here with another job running: 1.8 tok/s spinning, 6.5 sleeping).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import platform  # noqa: E402

import numba  # noqa: E402
from llvmlite import binding as llvm  # noqa: E402
from numba import njit, prange  # noqa: E402

from .catalog import cache_dir  # noqa: E402

# LLVM tunes recent Intel cores to prefer 256-bit vectors even where AVX-512 exists. The kernels keep
# 4 × 64 partial sums in registers: 16 of the 32 512-bit registers, but all 32 of the 256-bit ones,
# with none left for the weights (they spilled: the multi-row kernels ran at a third of the speed).
# It is a tuning flag: on a processor without AVX-512 it changes nothing. NUMBA_CPU_FEATURES wins.
if not os.environ.get("NUMBA_CPU_FEATURES") and platform.machine().lower() in ("x86_64", "amd64"):
    numba.config.CPU_FEATURES = llvm.get_host_cpu_features().flatten() + ",-prefer-256-bit"

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
