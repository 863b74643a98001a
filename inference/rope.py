"""Rotary position embeddings (RoPE), with the frequencies as each architecture changes them: per-frequency
factors (llama 3, phi3's LongRoPE) and YaRN's stretch of a trained context (gpt-oss), as ggml's rope
computes them (ggml-cpu ops.cpp: rope_yarn, ggml_rope_yarn_corr_dims)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

F32 = np.float32
# YaRN's corrections: the channels that turn more than YARN_BETA_FAST times over the original context
# keep their frequency, those that turn fewer than YARN_BETA_SLOW times are stretched, a ramp between
# (llama.cpp's defaults, which no gpt-oss GGUF overrides)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def yarn_frequencies(inv: np.ndarray, n_dims: int, base: float, factor: float, orig_ctx: int) -> np.ndarray:
    """YaRN's frequencies [n_dims/2] from RoPE's `inv`: each pair i turns at its own frequency
    (extrapolated) below the fast correction dimension, at it divided by `factor` (interpolated) above
    the slow one, and at a linear mix between."""

    def corr_dim(rotations: float) -> float:
        return n_dims * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(YARN_BETA_FAST)))
    high = min(n_dims - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
    ramp = 1.0 - np.clip((np.arange(len(inv)) - low) / max(0.001, high - low), 0.0, 1.0)
    return inv / factor * (1.0 - ramp) + inv * ramp


def yarn_scale(factor: float) -> float:
    """What YaRN multiplies cos and sin by (its attention temperature), as llama.cpp sets it."""
    return 1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0


@lru_cache(maxsize=8)
def _cos_sin(positions: bytes, head_dim: int, base: float, factors: bytes | None, scale: float, yarn):
    """cos and sin of position·frequency [T, hd/2], times `scale`; the same for every layer of a step
    (per RoPE base). `yarn`: (factor, original context) or None."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if factors is not None:
        inv = inv / np.frombuffer(factors, dtype=np.float32)
    if yarn is not None:
        inv = yarn_frequencies(inv, head_dim, base, *yarn)
    angles = np.frombuffer(positions, dtype=np.int64).astype(np.float64)[:, None] * inv[None, :]
    cos, sin = (np.cos(angles) * scale).astype(F32), (np.sin(angles) * scale).astype(F32)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    base: float,
    neox: bool,
    freq_factors: np.ndarray | None,
    n_rot: int = 0,
    scale: float = 1.0,
    yarn: tuple[float, int] | None = None,
) -> np.ndarray:
    """Rotate pairs of channels by position·frequency. x [n_heads, T, hd], positions [T] (may be negative).
    Only the first n_rot channels turn where n_rot is set (0: all), the others pass as they are; `scale`
    multiplies the turned ones (LongRoPE's attention factor, YaRN's); `yarn`: (factor, original
    context) where YaRN stretches the frequencies."""
    hd = x.shape[-1]
    if 0 < n_rot < hd:
        turned = rope(x[..., :n_rot], positions, base, neox, freq_factors, 0, scale, yarn)
        return np.concatenate([turned, x[..., n_rot:]], axis=-1)
    factors = None if freq_factors is None else np.asarray(freq_factors).tobytes()
    cos, sin = _cos_sin(np.asarray(positions, dtype=np.int64).tobytes(), hd, base, factors, scale, yarn)
    if neox:  # pairs are (i, i + hd/2)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs are (2i, 2i + 1)
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out
