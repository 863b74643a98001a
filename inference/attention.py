"""The attention of one new token over the cache, compiled (flash-decoding), and its plain reference.

Decoding one token attends over the whole cache. BLAS does poorly on that shape (a few query rows
against thousands of keys, on the one thread a step of the kernels leaves it) and needs a float16 cache
copied into float32 first. This kernel reads each key and value once, as float16 where it lies, for all
the query heads sharing it, on every thread, a chunk of positions per task: a chunk's sums are its own
and are merged in one order afterwards, so a token's result does not depend on the number of threads or
on what else is in the batch. From how many cached positions it takes over from BLAS is the profile's
(cpu.py); figures in docs/performance.md, "Decode over a long history".
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .half import bits_view, to_f32
from .jit import njit, prange
from .vectors import _prefetch

F32 = np.float32
ATTENTION_CHUNK = 256  # positions per task: enough work per task, few enough for one chunk's scores
LOG2E, LN2_HI, LN2_LO = F32(1.4426950408889634), F32(0.693359375), F32(-2.12194440e-4)
# Multiply-adds may be fused, nothing else: the exp's polynomial is evaluated as written.
EXACT = {"contract"}
# Dot products may be reassociated (vectorized across head_dim), in the same order on every call.
DOT = {"contract", "reassoc"}


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer `bits` (what C does with a union)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(bits), codegen


@njit(cache=True, inline="always", fastmath=EXACT)
def _exp_nonpositive(x):
    """exp(x) for x ≤ 0 in float32 arithmetic that vectorizes (libm's expf does not): x = n·ln 2 + r,
    |r| ≤ ln 2 / 2, a degree-6 Taylor polynomial of r times 2^n built from its bits: within 2 float32
    ulps of exp (test_kernels). Below -87.3 (where float32 leaves its normal range) it gives ~1e-38,
    nothing in a softmax."""
    x = max(x, F32(-87.3))
    n = np.floor(x * LOG2E + F32(0.5))
    r = x - n * LN2_HI - n * LN2_LO
    p = F32(1 / 720) * r + F32(1 / 120)
    p = p * r + F32(1 / 24)
    p = p * r + F32(1 / 6)
    p = p * r + F32(0.5)
    p = p * r + F32(1)
    p = p * r + F32(1)
    return p * _float_from_bits((np.int32(n) + 127) << 23)


@njit(cache=True, parallel=True, fastmath=DOT)
def _one_token_attention(q, k, v, runs, m_out, l_out, acc_out):
    """Attention of one new token over a chunk of positions per task, as flash-decoding does: for the
    positions runs (first, n) of one layer of the cache k, v [n_kv, N, hd] (whole: their last axis
    contiguous, which the vectorized loops rely on), q [n_kv, group, hd] → per kv head h and chunk c the
    scores' max m_out[h, c, g], the sum of exp(score - max) l_out[h, c, g] and the sum of those
    weights times the values acc_out[h, c, g] [hd]; one_token_attention merges the chunks."""
    n_kv, group, hd = q.shape
    chunks = m_out.shape[1]
    for task in prange(n_kv * chunks):
        h, c = task // chunks, task % chunks
        lo = c * ATTENTION_CHUNK
        where = np.empty(ATTENTION_CHUNK, np.int64)  # the chunk's positions in the cache
        size, base = 0, 0
        for r in range(runs.shape[0]):
            first, n = runs[r, 0], runs[r, 1]
            for t in range(max(lo, base), min(lo + ATTENTION_CHUNK, base + n)):
                where[size] = first + t - base
                size += 1
            base += n
        scores = np.empty((group, ATTENTION_CHUNK), F32)
        kv = np.empty(hd, F32)  # a key or value row as float32, converted once for the group's heads
        for i in range(size):
            row = where[i]
            _prefetch(k, (h * k.shape[1] + row) * hd, 0)  # rows ahead, as the products ask for weights
            for d in range(hd):
                kv[d] = to_f32(k[h, row, d])
            for g in range(group):
                dot = F32(0)
                for d in range(hd):
                    dot += q[h, g, d] * kv[d]
                scores[g, i] = dot
        acc = np.zeros((group, hd), F32)
        for g in range(group):
            top = scores[g, 0]
            for i in range(1, size):
                top = max(top, scores[g, i])
            total = F32(0)
            for i in range(size):
                e = _exp_nonpositive(scores[g, i] - top)
                scores[g, i] = e
                total += e
            m_out[h, c, g], l_out[h, c, g] = top, total
        for i in range(size):
            row = where[i]
            _prefetch(v, (h * v.shape[1] + row) * hd, 0)
            for d in range(hd):
                kv[d] = to_f32(v[h, row, d])
            for g in range(group):
                weight = scores[g, i]
                for d in range(hd):
                    acc[g, d] += weight * kv[d]
        for g in range(group):  # (a loop: `acc_out[h, c] = acc` compiles its shape check's error
            for d in range(hd):  # message, seconds of a first start)
                acc_out[h, c, g, d] = acc[g, d]


def one_token_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, runs, sinks=None) -> np.ndarray:
    """softmax(q · keys) · values for one new token: q [n_kv, group, hd] (scaled), k, v one layer of the
    cache [n_kv, N, hd] (float32, or float16 read as float32) and the runs (first, n) of it to attend to
    → [n_kv, group, hd]. `sinks` [n_kv, group]: each head's logit more in its softmax, with no value
    (gpt-oss), joined where the chunks are. One call for all heads: each call wakes numba's threads."""
    n_kv, group, hd = q.shape
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)  # (as it comes from KVViews.runs: no copy)
    chunks = -(-int(runs[:, 1].sum()) // ATTENTION_CHUNK)
    m = np.empty((n_kv, chunks, group), F32)
    l = np.empty((n_kv, chunks, group), F32)
    acc = np.empty((n_kv, chunks, group, hd), F32)
    _one_token_attention(q, bits_view(k), bits_view(v), runs, m, l, acc)
    top = m.max(axis=1, keepdims=True)  # [n_kv, 1, group]
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, :])
    scale = np.exp(m - top)  # each chunk's weights against the largest max
    total = (l * scale).sum(axis=1)  # [n_kv, group]
    if sinks is not None:
        total += np.exp(sinks - top[:, 0])
    return (acc * scale[..., None]).sum(axis=1) / total[..., None]


def one_token_attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, runs, sinks=None):
    """one_token_attention as the maths reads, in float64: softmax over the runs' positions (and the
    sinks) at once."""
    where = np.concatenate([np.arange(first, first + n) for first, n in runs])
    keys, values = k[:, where].astype(np.float64), v[:, where].astype(np.float64)  # [n_kv, S, hd]
    scores = q.astype(np.float64) @ keys.transpose(0, 2, 1)  # [n_kv, group, S]
    if sinks is not None:  # a last score whose value is zero
        scores = np.concatenate([scores, sinks[..., None].astype(np.float64)], axis=-1)
        values = np.concatenate([values, np.zeros_like(values[:, :1])], axis=1)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ values

