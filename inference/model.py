"""The transformer forward pass in plain NumPy: one function per idea, float32 throughout.

Shapes in comments: T new tokens, S cached positions, d = n_embd, hd = head_dim.
Architecture differences (QKV bias, q/k norms, post-norms, sliding windows, GELU vs SiLU,
embedding scale, soft-capping) are switches in `Config`, read from the GGUF metadata.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .kv_cache import KVCache
from .weights import Config

F32 = np.float32
PREFILL_BATCH = 512  # tokens per forward chunk: bounds the [T, S] attention scores in memory


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x [..., n]; mean over the last axis in float32 (np.float32 eps keeps NumPy from promoting)
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))) * weight


@lru_cache(maxsize=16)
def _rope_inv_freq(head_dim: int, base: float, freq_factors: bytes | None) -> np.ndarray:
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if freq_factors is not None:
        inv = inv / np.frombuffer(freq_factors, dtype=np.float32)
    return inv


def rope(
    x: np.ndarray, positions: np.ndarray, base: float, neox: bool, freq_factors: np.ndarray | None
) -> np.ndarray:
    """Rotate pairs of channels by position·frequency. x [n_heads, T, hd], positions [T] (may be negative)."""
    hd = x.shape[-1]
    inv = _rope_inv_freq(hd, base, None if freq_factors is None else np.asarray(freq_factors).tobytes())
    angles = positions.astype(np.float64)[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    if neox:  # pairs are (i, i + hd/2)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # pairs are (2i, 2i + 1)
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, q_pos, k_pos, scale: float, window: int, softcap: float) -> np.ndarray:
    """Grouped-query causal attention. q [n_head, T, hd], k/v [n_kv, S, hd] → [T, n_head·hd]."""
    n_head, T, hd = q.shape
    n_kv, S = k.shape[0], k.shape[1]
    group = n_head // n_kv
    qg = q.reshape(n_kv, group * T, hd)  # query heads that share a kv head, stacked
    scores = (qg @ k.transpose(0, 2, 1)).reshape(n_kv, group, T, S) * F32(scale)
    if softcap:
        scores = np.tanh(scores / F32(softcap)) * F32(softcap)
    dist = q_pos[:, None] - k_pos[None, :]  # [T, S]
    visible = dist >= 0
    if window:
        visible &= dist < window
    scores = np.where(visible, scores, F32(-np.inf))
    probs = softmax(scores).reshape(n_kv, group * T, S)
    out = (probs @ v).reshape(n_head, T, hd)
    return out.transpose(1, 0, 2).reshape(T, n_head * hd)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return F32(0.5) * x * (F32(1.0) + np.tanh(F32(0.7978845608028654) * (x + F32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def feed_forward(x: np.ndarray, w: dict, p: str, cfg: Config) -> np.ndarray:
    gate_up = x @ w[p + "ffn_gate_up"].T  # [T, 2·n_ff]
    gate, up = gate_up[:, : cfg.n_ff], gate_up[:, cfg.n_ff :]
    act = gelu_tanh(gate) if cfg.ffn_act == "gelu" else silu(gate)
    return (act * up) @ w[p + "ffn_down"].T  # [T, d]


def self_attention(x: np.ndarray, w: dict, layer: int, cfg: Config, cache: KVCache, positions: np.ndarray):
    p = f"blk.{layer}."
    T = x.shape[0]
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    qkv = x @ w[p + "attn_qkv"].T  # [T, q_dim + 2·kv_dim]
    if p + "attn_qkv_bias" in w:
        qkv += w[p + "attn_qkv_bias"]
    q = qkv[:, :q_dim].reshape(T, cfg.n_head, cfg.head_dim).transpose(1, 0, 2)  # [n_head, T, hd]
    k = qkv[:, q_dim : q_dim + kv_dim].reshape(T, cfg.n_head_kv, cfg.head_dim).transpose(1, 0, 2)
    v = qkv[:, q_dim + kv_dim :].reshape(T, cfg.n_head_kv, cfg.head_dim).transpose(1, 0, 2)
    if cfg.qk_norm:
        q = rms_norm(q, w[p + "attn_q_norm"], cfg.norm_eps)
        k = rms_norm(k, w[p + "attn_k_norm"], cfg.norm_eps)
    sliding = cfg.is_sliding(layer)
    base = cfg.rope_base_swa if sliding else cfg.rope_base
    q = rope(q, positions, base, cfg.rope_neox, w.get("rope_freqs"))
    k = rope(k, positions, base, cfg.rope_neox, w.get("rope_freqs"))
    cache.write(layer, positions, k, v)
    window = cfg.sliding_window if sliding else 0
    keys, values, key_pos = cache.read(
        layer, int(positions[-1]) + 1, first=int(positions[0]) - window + 1 if window else 0
    )
    scale = cfg.attn_scale or 1.0 / np.sqrt(cfg.head_dim)
    out = attention(q, keys, values, positions, key_pos, scale, window, cfg.attn_logit_softcap)
    return out @ w[p + "attn_output"].T  # [T, d]


def transformer_block(x: np.ndarray, w: dict, layer: int, cfg: Config, cache: KVCache, positions: np.ndarray):
    p = f"blk.{layer}."
    h = self_attention(rms_norm(x, w[p + "attn_norm"], cfg.norm_eps), w, layer, cfg, cache, positions)
    if cfg.post_norms:
        h = rms_norm(h, w[p + "post_attention_norm"], cfg.norm_eps)
    x = x + h
    h = feed_forward(rms_norm(x, w[p + "ffn_norm"], cfg.norm_eps), w, p, cfg)
    if cfg.post_norms:
        h = rms_norm(h, w[p + "post_ffw_norm"], cfg.norm_eps)
    return x + h


def output_logits(x: np.ndarray, w: dict, cfg: Config) -> np.ndarray:
    x = rms_norm(x, w["output_norm"], cfg.norm_eps)
    logits = x @ w.get("output", w["token_embd"]).T  # tied to the embeddings when output.weight is absent
    if cfg.final_logit_softcap:
        logits = np.tanh(logits / F32(cfg.final_logit_softcap)) * F32(cfg.final_logit_softcap)
    return logits


def forward(tokens, w: dict, cfg: Config, cache: KVCache, all_logits: bool = False) -> np.ndarray:
    """Run new tokens after what the cache holds; return logits [n, n_vocab] (all rows, or the last)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) == 0:
        raise ValueError("forward needs at least one token")
    if cache.n_tokens + len(tokens) > cache.n_ctx:
        raise ValueError(f"context full: {cache.n_tokens} + {len(tokens)} tokens > {cache.n_ctx}")
    outputs = []
    for start in range(0, len(tokens), PREFILL_BATCH):
        chunk = tokens[start : start + PREFILL_BATCH]
        positions = np.arange(cache.n_tokens, cache.n_tokens + len(chunk))
        x = np.asarray(w["token_embd"][chunk], dtype=F32)  # [T, d]
        if cfg.embed_scale != 1.0:
            x = x * F32(cfg.embed_scale)
        for layer in range(cfg.n_layer):
            x = transformer_block(x, w, layer, cfg, cache, positions)
        cache.tokens.extend(chunk.tolist())
        if all_logits:
            outputs.append(output_logits(x, w, cfg))
        elif start + PREFILL_BATCH >= len(tokens):
            outputs.append(output_logits(x[-1:], w, cfg))  # logits only where they are needed
    return np.concatenate(outputs) if len(outputs) > 1 else outputs[0]
