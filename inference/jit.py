"""numba, set up once: compiled kernels are cached in the user cache directory, so a warm start compiles
nothing. Every module with kernels imports `njit` and `prange` from here."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# numba's OpenMP threads sleep between kernels instead of spinning: a kernel runs ~100 times per
# token, and spinning threads on a 2-core machine take the cores from BLAS, the other kernel thread
# or anything else running (docs/performance.md, "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

from .catalog import cache_dir  # noqa: E402
from .cpu import PROFILE  # noqa: E402

# The modules whose numba code the kernels inline from one another (products.py inlines the intrinsics
# of vectors.py and byte_vectors.py, k_quants.py's loops and the block formats' decoders), and cpu.py, whose
# profile they compile in.
KERNEL_SOURCES = (
    "cpu.py", "vectors.py", "byte_vectors.py", "k_quants.py", "products.py", "activations.py",
    "attention.py", "attention_vectors.py", "kernels.py", "quants.py", "block_formats.py", "grid_formats.py",
    "half.py", "block_vectors.py",
)


def _sources_digest() -> str:
    """numba checks a cached kernel against its own source file only, so a kernel would keep the old
    code of what it inlines from another module: compiled code is kept per version of them all."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:12]


# Compiled code lands in a folder per profile: numba keys its cache by processor and features, but
# not by the module constants a kernel was compiled with (the lanes and rows of cpu.PROFILE), so two
# profiles sharing a folder could load each other's code. NUMBA_CACHE_DIR, when the user sets it,
# holds these folders; else our own cache folder does.
_CACHE_DIR = os.path.join(
    os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba", _sources_digest(), PROFILE.key
)


def _apply_profile() -> None:
    """What numba compiles for, as cpu.py read it (NUMBA_CPU_FEATURES, when the user sets it, is kept),
    and where it caches it."""
    numba.config.CPU_FEATURES = PROFILE.features
    numba.config.CACHE_DIR = _CACHE_DIR


def _reload_config_keeping_the_profile(reload=numba.core.config.reload_config) -> None:
    """numba reads its NUMBA_* variables again before each compilation where one has changed since
    (the tests set NUMBA_CACHE_DIR for the processes they start), which would drop the profile's
    features and folder: the compiled code would no longer be what cpu.PROFILE says."""
    reload()
    _apply_profile()


_apply_profile()
numba.core.config.reload_config = _reload_config_keeping_the_profile


def in_cache(kernel) -> bool:
    """Whether a kernel's compiled code is in the cache for its current source (else it compiles). Asked
    of numba's own index, which stamps the source by its contents: comparing modification times said
    "compiling" for a checkout cloned again over the same path, whose cache numba still loaded."""
    try:
        return bool(kernel._cache._cache_file._load_index())
    except Exception:  # a private interface of numba's: if it changes, say "compiling", never fail
        return False


__all__ = ["in_cache", "njit", "prange"]
