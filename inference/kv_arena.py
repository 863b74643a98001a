"""Where a model's KV lies in RAM: the arena of a block pool (kv_cache), its element types, and views
of a sequence's positions in it for the forward pass.

Values are laid out `[layer, kv_head, slot·B + i, head_dim]`: each head's values are contiguous rows, and
a sequence whose blocks sit in consecutive slots (the pool's allocator tries to keep them so) is read by
attention as a plain slice — no gathering of the history on every token. Keys are laid out `[layer,
kv_head, slot, head_dim, B]`: a block's positions across the lanes, so that one token's scores are
multiply-adds of a query element into a vector of positions, no lanes summed across and each key
widened once for all the query heads that share it (attention.py; docs/performance.md, "Decode over a
long history"). `key_run` gives positions' keys back as rows."""

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


def arena(
    n_layer: int, n_kv: int, n_slots: int, head_dim: int, dtype: np.dtype, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The keys [layer, kv_head, slot, head_dim, B] and values [layer, kv_head, slot·B + i, head_dim] of
    a pool, their first slots faulted in now, as llama.cpp allocates its KV buffer when a context is
    made: the kernel's page faults would otherwise cost a resumed conversation more than decoding it."""
    k = _zeroed((n_layer, n_kv, n_slots, head_dim, block_size), dtype)
    v = _zeroed((n_layer, n_kv, n_slots * block_size, head_dim), dtype)
    warm = min(n_slots, -(-PREFAULT_TOKENS // block_size))
    k[:, :, :warm] = 0
    v[:, :, : warm * block_size] = 0
    return k, v


def keys_as_blocks(k: np.ndarray, block_size: int) -> np.ndarray:
    """Keys [..., N, head_dim] laid out as the arena's, [..., slot, head_dim, B] (the last block padded
    with zeros): position p at slot p // B, lane p % B."""
    *lead, n, hd = k.shape
    slots = -(-n // block_size)
    padded = np.zeros((*lead, slots * block_size, hd), k.dtype)
    padded[..., :n, :] = k
    blocks = padded.reshape(*lead, slots, block_size, hd).swapaxes(-1, -2)
    return np.ascontiguousarray(blocks)


def key_run(k: np.ndarray, first: int, n: int) -> np.ndarray:
    """The keys of arena positions first..first+n-1 of keys laid out [..., slot, head_dim, B], as rows
    [..., n, head_dim]: a view of a copy of the blocks they lie in, made [..., head_dim, positions] (a
    copy of whole runs of B lanes, as quick as NumPy copies; element by element, indexing by arrays,
    took 2-5 times as long)."""
    B = k.shape[-1]
    s0, s1 = first // B, -(-(first + n) // B)
    blocks = np.moveaxis(k[..., s0:s1, :, :], -2, -3)  # [..., head_dim, slots, B]
    rows = blocks.reshape(*blocks.shape[:-2], (s1 - s0) * B)
    return rows[..., first - s0 * B : first - s0 * B + n].swapaxes(-1, -2)


class KVViews:
    """Some positions of a sequence where they lie in the arena: per layer, (k, v) pieces
    [kv_head, S_i, head_dim], one per run of consecutive slots, in position order (the keys as views of
    copies, key_run; the values as views). Valid until the sequence's blocks change (made once per
    forward step, read by every layer)."""

    __slots__ = ("_k", "_v", "_slices", "_runs", "n_positions")

    def __init__(self, k: np.ndarray, v: np.ndarray, slices: list[slice]):
        self._k, self._v, self._slices = k, v, slices
        # the same runs as (first, n) rows, for the compiled kernels: built once, read by every layer
        self._runs = np.array([(s.start, s.stop - s.start) for s in slices], dtype=np.int64).reshape(-1, 2)
        self.n_positions = int(self._runs[:, 1].sum())

    def layer(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        k, v = self._k[layer], self._v[layer]
        return [(key_run(k, s.start, s.stop - s.start), v[:, s]) for s in self._slices]

    def runs(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same positions for compiled kernels: the layer's keys [kv_head, slots, head_dim, B] and
        values [kv_head, N, head_dim] whole, C-contiguous, and the runs [n_runs, 2] (first, n) of arena
        positions (slot·B + i) where they lie."""
        return self._k[layer], self._v[layer], self._runs
