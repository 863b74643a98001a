"""The KV cache of one sequence: keys and values of every layer, float32, one contiguous array each.

Laid out `[layer, kv_head, position, head_dim]` so that each head's keys are contiguous rows: a matmul
over a strided view would silently leave BLAS for a slow loop.
"""

from __future__ import annotations

import numpy as np

from .weights import Config


class KVCache:
    def __init__(self, cfg: Config, n_ctx: int):
        shape = (cfg.n_layer, cfg.n_head_kv, n_ctx, cfg.head_dim)
        self.n_ctx = n_ctx
        self.k = np.zeros(shape, dtype=np.float32)  # untouched pages cost no memory until written
        self.v = np.zeros(shape, dtype=np.float32)
        self.tokens: list[int] = []  # the token at each cached position

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def write(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        # k, v [n_kv, T, hd] for consecutive positions
        start, end = int(positions[0]), int(positions[-1]) + 1
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def read(self, layer: int, end: int, first: int = 0):
        """Keys, values [n_kv, S, hd] and their positions [S] for positions first..end-1."""
        first = max(first, 0)
        return self.k[layer, :, first:end], self.v[layer, :, first:end], np.arange(first, end)

    def truncate(self, n_tokens: int) -> None:
        """Forget every position from n_tokens on (llama.cpp's seq_rm)."""
        del self.tokens[max(n_tokens, 0) :]

    def common_prefix(self, ids) -> int:
        """How many leading tokens of ids this cache already holds."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def nbytes_used(self) -> int:
        return 2 * self.k[:, :, : self.n_tokens].nbytes
