"""Choosing the next token from a logits vector, with llama.cpp's default sampler chain, in NumPy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 → greedy (argmax)
    top_k: int = 40  # 0 → off
    top_p: float = 0.95  # 1.0 → off
    min_p: float = 0.05  # 0 → off
    repeat_penalty: float = 1.0  # 1.0 → off; for tokens in the last N: logit > 0 → / penalty, else * penalty
    repeat_last_n: int = 64  # 0 → off, -1 → all of recent_tokens
    seed: int | None = None  # None → random; a seed makes a run reproducible
    grammar: str | None = None  # a compiled grammar (constrain.py): only replies it allows are drawn
    logprobs: int | None = None  # n: note each token's log-probability and the n likeliest (None: none)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # written so that NaN fails too
            raise ValueError(f"temperature must be 0 or more, not {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be between 0 and 1, not {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be between 0 and 1, not {self.min_p}")
        if not self.repeat_penalty > 0:
            raise ValueError(f"repeat_penalty must be more than 0, not {self.repeat_penalty}")


@dataclass
class TokenLogprob:
    """A drawn token's log-probability under the model (after a grammar's mask), and the likeliest."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), likeliest first


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """`token`'s log-softmax of `logits`, and the n_top likeliest tokens' (the raw distribution, before
    temperature and the other samplers, as OpenAI and llama.cpp report it)."""
    logits = np.asarray(logits, dtype=np.float64)
    best = logits.max()
    log_total = best + np.log(np.exp(logits - best).sum())
    top = (
        np.argpartition(-logits, n_top)[:n_top]
        if 0 < n_top < logits.size
        else np.arange(min(n_top, logits.size))
    )
    top = top[np.argsort(-logits[top], kind="stable")]
    return TokenLogprob(
        token, float(logits[token] - log_total), [(int(i), float(logits[i] - log_total)) for i in top]
    )


class Sampler:
    """Draws tokens: penalties → top-k → top-p → min-p → temperature → draw, as llama.cpp's default chain.

    As in llama.cpp, top-p and min-p judge the probabilities before temperature is applied, so temperature
    changes how the survivors are weighed but not which tokens survive.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def sample(self, logits: np.ndarray, recent_tokens: Sequence[int] = ()) -> int:
        """The next token id, drawn from `logits` after the chain; `recent_tokens` feed the repeat penalty."""
        ids, probs = self.distribution(logits, recent_tokens)
        if len(ids) == 1:
            return int(ids[0])  # greedy, or a single survivor: nothing to draw
        choice = int(np.searchsorted(np.cumsum(probs), self.rng.random(), side="right"))
        return int(ids[min(choice, len(ids) - 1)])  # min(): the cumulative sum may end a hair below 1

    def distribution(
        self, logits: np.ndarray, recent_tokens: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that survive the chain and the probability of drawing each (float64, summing to 1)."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)  # no copy for float32 input; never written to
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty vector, not shape {logits.shape}")
        if np.isnan(logits).any():
            # NaN would win argmax and argpartition; treat it as a token that cannot be chosen.
            logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
        logits = self._apply_repeat_penalty(logits, recent_tokens)

        if p.temperature <= 0:
            # Greedy: the penalised argmax, as llama.cpp's chain does it; no randomness is used.
            return np.array([np.argmax(logits)]), np.ones(1)

        ids = _top_k(logits, p.top_k)
        values = logits[ids]
        best = values.max()
        if not np.isfinite(best):
            # Every token is masked out (-inf): nothing to weigh, so fall back to the first.
            return ids[np.argmax(values)].reshape(1), np.ones(1)

        if p.top_p < 1.0:
            # top-p judges each token against all top-k survivors, so their total is needed before min-p.
            total = np.exp(values - best, dtype=np.float64).sum()
        if p.min_p > 0.0:
            # p_i >= min_p * p_max, written on logits: logit_i >= logit_max + log(min_p). Top-p and min-p
            # each keep a head of the ranking, so filtering by min-p first changes nothing but the cost.
            keep = values >= best + np.log(np.float32(p.min_p))
            ids, values = ids[keep], values[keep]
        if p.top_p < 1.0:
            ids, values = _top_p(ids, values, best, total, p.top_p)

        weights = np.exp((values - best) / np.float32(p.temperature), dtype=np.float64)
        return ids, weights / weights.sum()

    def _apply_repeat_penalty(self, logits: np.ndarray, recent_tokens: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_penalty == 1.0 or p.repeat_last_n == 0 or len(recent_tokens) == 0:
            return logits
        window = recent_tokens if p.repeat_last_n < 0 else recent_tokens[-p.repeat_last_n :]
        seen = np.unique(np.asarray(window, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < logits.size)]
        if seen.size == 0:
            return logits
        logits = logits.copy()  # the caller's logits stay as they were
        # llama.cpp: each token once, however often it occurred; dividing a negative logit would raise it.
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
        return logits


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, in no particular order (all ids when k is off or too large)."""
    n = logits.size
    if k <= 0 or k >= n:
        return np.arange(n)
    ids = np.arange(n)
    stride = n // (64 * k)
    if stride >= 2:
        # The k-th best of every stride-th logit is a floor that at least k logits reach, so the top k are
        # among the logits above it, typically about k * stride of them: argpartition then has little to do.
        sample = logits[::stride]
        floor = np.partition(sample, sample.size - k)[sample.size - k]
        ids = np.flatnonzero(logits >= floor)
    if ids.size > k:
        # argpartition is O(n); a full sort of a 262k vocabulary would cost far more.
        ids = ids[np.argpartition(logits[ids], ids.size - k)[ids.size - k :]]
    return ids


def _top_p(
    ids: np.ndarray, values: np.ndarray, best: float, total: float, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The smallest head of the ranking whose probability (out of `total`) reaches top_p, as llama.cpp.

    The token that carries the sum over top_p is kept, and at least one token always is. Only the head is
    sorted: it grows until it holds enough probability, which for real logits is a few hundred tokens at most.
    """
    n = len(ids)
    size = min(n, 256)
    while True:
        head = np.arange(n) if size == n else np.argpartition(values, n - size)[n - size :]
        head = head[np.argsort(-values[head], kind="stable")]
        cumulative = np.cumsum(np.exp(values[head] - best, dtype=np.float64)) / total
        if cumulative[-1] >= top_p or size == n:
            keep = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, size)
            return ids[head[:keep]], values[head[:keep]]
        size = min(n, size * 8)
