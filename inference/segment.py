"""The rows of a forward step that belong to one sequence: where their KV goes and what each attends to
(forward.py's steps hold one or more)."""

from __future__ import annotations

import numpy as np

from .kv_arena import KVViews
from .kv_cache import KVSequence

F32 = np.float32


class Segment:
    """The rows of a forward step that belong to one sequence, and where their KV goes."""

    def __init__(
        self,
        seq: KVSequence,
        rows: slice,
        tokens: np.ndarray,
        attention_rows: int,
        all_rows: bool,
        commit: bool,
    ):
        self.seq, self.rows, self.tokens = seq, rows, tokens
        self.attention_rows = attention_rows  # query rows per attention call (1: each as its own decode)
        # the rows that go on past the last layer's attention: all of them (their logits are wanted) or
        # only the last (a prompt's: llama.cpp's skipping of unused outputs)
        self.kept = rows if all_rows else slice(rows.stop - 1, rows.stop)
        self.commit = commit  # whether the sequence takes the new tokens (else see verify_draft)
        self.positions = np.arange(seq.n_tokens, seq.n_tokens + len(tokens))
        self.where = seq.reserve(len(tokens))  # where the new tokens' KV goes (for seq.write)
        self._views: dict[tuple[int, int, int], tuple] = {}

    def view(self, window: int, lo: int, hi: int) -> tuple[KVViews, np.ndarray | None]:
        """What rows lo..hi-1 attend to: the cached positions from the first key any of them sees to the
        last row's own, and their mask (made once per window, read by every layer)."""
        if (window, lo, hi) not in self._views:
            positions = self.positions[lo:hi]
            first = _first_seen(positions, window)
            end = int(positions[-1]) + 1
            views = self.seq.views(first, end)
            dist = positions[:, None] - np.arange(first, end)[None, :]  # [rows, S]
            hidden = dist < 0
            if window:
                hidden |= dist >= window
            mask = np.where(hidden, F32(-np.inf), F32(0.0)) if hidden.any() else None
            self._views[window, lo, hi] = (views, mask)
        return self._views[window, lo, hi]

    def seen(self, window: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, int]:
        """What each of rows lo..hi-1 attends to as view()'s mask says, as spans of the view's positions:
        row r sees [seen_from[r], seen_to[r]), the view starting at position `first` (for
        attention.rows_attention)."""
        positions = self.positions[lo:hi]
        first = _first_seen(positions, window)
        seen_from = np.maximum(positions - window + 1 - first, 0) if window else np.zeros_like(positions)
        return seen_from, positions - first + 1, first


def _first_seen(positions: np.ndarray, window: int) -> int:
    """The first position that any of these rows (in order) attends to."""
    return max(int(positions[0]) - window + 1, 0) if window else 0
