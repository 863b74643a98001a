"""Where a model's KV lies in RAM: the arena of a block pool (kv_cache), its element types, and views
of a sequence's positions in it for the forward pass.

The arena is laid out `[layer, kv_head, slot·B + i, head_dim]`: each head's keys are contiguous rows,
and a sequence whose blocks sit in consecutive slots (the pool's allocator tries to keep them so) is
read by attention as a plain slice — no gathering of the history on every token."""

from __future__ import annotations

import mmap

import numpy as np

# The live cache's element type (llama.cpp's --cache-type-k/v): float16, as llama.cpp's default, halves
# RAM and what attention reads (it accumulates in float32); float32 keeps the KV exactly as computed.
CACHE_TYPES = {"f16": np.float16, "f32": np.float32}
DEFAULT_CACHE_TYPE = "f16"
PREFAULT_TOKENS = 4096


def element_type(cache_type: str) -> np.dtype:
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"unknown KV cache type {cache_type!r}; expected one of {', '.join(CACHE_TYPES)}")
    return np.dtype(CACHE_TYPES[cache_type])


def _zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeroed memory whose pages are only taken when first written (anonymous mmap), on 4 KB pages. On 2
    MB pages each layer's and head's part of the arena, written at first only at its start, would take a
    whole huge page: the default model's pool on a 24 GB machine (87,360 positions, 4,096 of them faulted
    in) 210 MB resident against 48, and decode at 4,096 positions no faster. (Python's mmap(-1) is shared
    memory, which Linux keeps on 4 KB pages unless transparent_hugepage/shmem_enabled says otherwise.)"""
    buf = mmap.mmap(-1, int(np.prod(shape)) * dtype.itemsize)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def arena(shape: tuple[int, ...], dtype: np.dtype, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values [layer, kv_head, slot·B + i, head_dim] of a pool, their first slots faulted
    in now, as llama.cpp allocates its KV buffer when a context is made: the kernel's page faults would
    otherwise cost a resumed conversation more than decoding it."""
    k, v = _zeroed(shape, dtype), _zeroed(shape, dtype)
    warm = min(shape[2], -(-PREFAULT_TOKENS // block_size) * block_size)
    k[:, :, :warm] = 0
    v[:, :, :warm] = 0
    return k, v


class KVViews:
    """Some positions of a sequence where they lie in the arena: per layer, (k, v) pieces
    [kv_head, S_i, head_dim], one per run of consecutive slots, in position order. Views, not copies:
    valid until the sequence's blocks change (made once per forward step, read by every layer)."""

    __slots__ = ("_k", "_v", "_slices", "_runs", "n_positions")

    def __init__(self, k: np.ndarray, v: np.ndarray, slices: list[slice]):
        self._k, self._v, self._slices = k, v, slices
        # the same runs as (first, n) rows, for the compiled kernels: built once, read by every layer
        self._runs = np.array([(s.start, s.stop - s.start) for s in slices], dtype=np.int64).reshape(-1, 2)
        self.n_positions = int(self._runs[:, 1].sum())

    def layer(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        k, v = self._k[layer], self._v[layer]
        return [(k[:, s], v[:, s]) for s in self._slices]

    def runs(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same positions for compiled kernels: the layer's keys and values whole, [kv_head, N,
        head_dim] and C-contiguous, and the runs [n_runs, 2] (first, n) along N where they lie."""
        return self._k[layer], self._v[layer], self._runs
