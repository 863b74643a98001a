"""The attention of a new token over the cache, compiled (flash-decoding), several sequences' tokens in
one call, and its plain reference.

Decoding one token attends over the whole cache. BLAS does poorly on that shape (a few query rows
against thousands of keys, on the one thread a step of the kernels leaves it) and needs a float16 cache
copied into float32 first. This kernel reads each key and value once, as float16 where it lies, for all
the query heads sharing it (the keys a vector of positions at a time: the arena holds them so,
kv_arena.py), on every thread, a chunk of positions per task: a chunk's sums are its own
and are merged in one order afterwards, so a token's result does not depend on the number of threads or
on what else is in the batch (every reply of a scheduler's step goes in one call: tokens_attention).
From how many cached positions it takes over from BLAS is the profile's (cpu.py); figures in
docs/performance.md, "Decode over a long history".

Several new rows of one sequence (a turn, a prompt's piece) go to rows_attention instead: a query in
each lane of a vector, so that its scores and weighted sums are each lane's own fused multiply-adds with
no lanes summed across, each key and value widened once a call, the softmax online over blocks of
positions: BLAS took 1.2-2 times as long in a turn (scores written out and read back by NumPy's passes,
the cache copied into float32 first). A row's result is the same beside any others, and the same
decoded alone before KERNEL_ATTENTION_FROM positions (where single rows take it too).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import threads
from .attention_vectors import _add_rows, _block_scores, _largest, _tile_add, _tile_scores, _widen
from .cpu import PARALLEL_TOKEN_ATTENTION_FROM, PROFILE
from .half import bits_view, to_f32
from .jit import njit, prange
from .kv_arena import keys_as_blocks
from .kv_cache import DEFAULT_BLOCK_SIZE
from .vectors import _prefetch

F32 = np.float32
WIDTH = PROFILE.vector_floats  # the building blocks' vectors (a literal, as they want it)
PREFETCH_BYTES = PROFILE.prefetch_bytes  # how far ahead _prefetch asks (a row's own lines: less this)
SUMS_BLOCK = 4  # a head's weighted sums are padded to a multiple of this many vectors (_weighted_sums)
QUAD_VECTORS = 4 if PROFILE.vector_registers >= 32 else 2  # each head's sums a 4-head pass holds
ATTENTION_CHUNK = 256  # positions per task: enough work per task, few enough for one chunk's scores
# rows_attention: positions widened and scored at a time (a block's keys and values stay in L1), keys
# scored per _tile_scores call and columns of the weighted sums per _tile_add call (sums in registers)
TILE_BLOCK, TILE_KEYS, TILE_DIMS = 32, 8, 8
UNSEEN = F32(-3e38)  # its masked scores: finite, as fast-math wants (exp of it less a score: 0)
LOG2E, LN2_HI, LN2_LO = F32(1.4426950408889634), F32(0.693359375), F32(-2.12194440e-4)
# Multiply-adds may be fused, nothing else: the exp's polynomial is evaluated as written.
EXACT = {"contract"}
# Dot products may be reassociated (vectorized across head_dim), in the same order on every call.
DOT = {"contract", "reassoc"}
# The exps of a row of scores side by side in vectors, their sum reassociated (the scores are finite).
SOFTMAX = {"contract", "reassoc", "nnan", "ninf", "nsz"}


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


@njit(cache=True, fastmath=SOFTMAX)
def _exp_in_place(scores, top):
    """scores = exp(scores - top) (top their largest), and their sum, side by side in vectors: a
    function of its own, handed a row of its own (LLVM left the loop scalar in the kernel's parallel
    loop, or indexed from an offset)."""
    total = F32(0)
    for i in range(len(scores)):
        e = _exp_nonpositive(scores[i] - top)
        scores[i] = e
        total += e
    return total


@njit(cache=True, inline="always")
def _block_heads(heads, padded, k, at, scores, first, stride):
    """scores[g·stride + first + lane] = heads[g] · the keys of `WIDTH` positions of a block of k [n_kv,
    slots, hd, B] from k.flat[at] (_block_scores): 7 heads a call where the group is made of 7s (Qwen2's),
    else 4, 2 and 1 (each call's sums a vector a head, in registers)."""
    group, g = heads.shape[0], 0
    hd, B = k.shape[2], k.shape[3]
    while group % 7 == 0 and g < group:
        _block_scores(heads, g * padded, padded, k, at, hd, B, scores, g * stride + first, stride, 7, WIDTH)
        g += 7
    while g + 4 <= group:
        _block_scores(heads, g * padded, padded, k, at, hd, B, scores, g * stride + first, stride, 4, WIDTH)
        g += 4
    if g + 2 <= group:
        _block_scores(heads, g * padded, padded, k, at, hd, B, scores, g * stride + first, stride, 2, WIDTH)
        g += 2
    if g < group:
        _block_scores(heads, g * padded, padded, k, at, hd, B, scores, g * stride + first, stride, 1, WIDTH)


@njit(cache=True, inline="always")
def _key_scores(heads, padded, k, h, where, size, scores, stride, v, starts):
    """scores[g·stride + i] = heads[g] · the key of position where[i] (of head h of a layer of keys k
    [n_kv, slots, hd, B], float16 bits or float32) for every query head g and i < size: a vector of
    positions at a time where they lie side by side in one block (a block's whole vectors, the sequence's
    last positions included: the lanes past them are scored too, and never read), else one at a time.
    Each position's score is the same fused sum in d's order either way. Asks, as it goes, for these
    positions' values (v's rows from v.flat[starts[i]]), which are read after the softmax. (Asking for
    the next block's keys too made no difference: the processor's prefetcher follows a block's rows.)"""
    slots, hd, B = k.shape[1], k.shape[2], k.shape[3]
    group = heads.shape[0]
    i = 0
    while i < size:
        p = where[i]
        n = min(WIDTH, size - i)
        if p % B + WIDTH <= B and where[i + n - 1] - p == n - 1:
            _block_heads(heads, padded, k, ((h * slots + p // B) * hd) * B + p % B, scores, i, stride)
        else:
            n = 1
            for g in range(group):
                scores[g * stride + i] = _key_score(heads, g, k, h, p // B, p % B)
        for j in range(i, i + n):
            for line in range(0, hd * v.itemsize, 64):
                _prefetch(v, starts[j], line - PREFETCH_BYTES)
        i += WIDTH if n > 1 else 1


@njit(cache=True, fastmath=EXACT)
def _key_score(heads, g, k, h, slot, lane):
    """heads[g] · the key in lane `lane` of block `slot` of head h, fused in d's order as _block_scores
    sums it (a function of its own: the kernel's fast-math would let LLVM reorder the sum)."""
    total = F32(0)
    for d in range(k.shape[2]):
        total = heads[g, d] * to_f32(k[h, slot, d, lane]) + total
    return total


@njit(cache=True, inline="always")
def _weighted_sums(acc, sums, v, starts, size, hd, scores, stride):
    """acc[g·sums + d] += scores[g·stride + j] · values[j, d] for every query head g, the values'
    rows j < size (from v.flat[starts[j]]) in order. A pass of _add_rows over the rows takes 7 heads
    where the group is made of 7s (Qwen2's: each value widened once, 7 sums that do not wait on one
    another, a vector of each), else 4 (a group of 8, Qwen3's or gpt-oss's, in two passes of 16 sums in
    flight rather than 7 and then 1 alone), then 2 or 1, with more vectors of each head's sums a pass,
    as many as registers allow (gemma-3-270m's 4 heads of 256 at 4,096 positions on the Zen 4: a vector
    of each took 4-19 % longer than the kernel before, 4 of each 5-10 % less, 2 on the AVX2 profile 16 %
    less)."""
    group, g = acc.shape[0] // sums, 0
    while group % 7 == 0 and g < group:
        _add_rows(acc[g * sums :], sums, v, starts, size, hd, scores[g * stride :], stride, 7, 1, WIDTH)
        g += 7
    while g + 4 <= group:
        vectors = QUAD_VECTORS
        _add_rows(acc[g * sums :], sums, v, starts, size, hd, scores[g * stride :], stride, 4, vectors, WIDTH)
        g += 4
    if g + 2 <= group:
        _add_rows(acc[g * sums :], sums, v, starts, size, hd, scores[g * stride :], stride, 2, 2, WIDTH)
        g += 2
    if g < group:
        _add_rows(acc[g * sums :], sums, v, starts, size, hd, scores[g * stride :], stride, 1, 4, WIDTH)


@njit(cache=True, parallel=True, fastmath=DOT)
def _one_token_attention(q, k, v, runs, first_run, first_chunk, m_out, l_out, acc_out):
    """Attention of new tokens, each over its own positions, a chunk of positions per task, as flash-decoding
    does: token t (of q [n_tok, n_kv, group, hd], scaled) attends to the runs (first, n) runs[first_run[t] :
    first_run[t + 1]] of one layer of the cache, keys k [n_kv, slots, hd, B] and values v [n_kv, N, hd]
    (whole, C-contiguous; position p of the runs is lane p % B of block p // B of k); its chunks are
    first_chunk[t] … of the outputs' chunk axis. Per kv head h and chunk c: the scores' max m_out[h, c, g],
    the sum of exp(score - max) l_out[h, c, g] and the sum of those weights times the values acc_out[h, c, g]
    [hd]; _merge_chunks joins each token's chunks. A task's sums depend on its chunk alone, not on the other
    tokens or the threads."""
    n_tok, n_kv, group, hd = q.shape
    width = WIDTH
    padded = -(-hd // width) * width  # rows padded with zeros to whole vectors
    summed = -(-hd // (SUMS_BLOCK * width)) * SUMS_BLOCK * width  # a head's weighted sums, padded
    stride = ATTENTION_CHUNK + width  # a head's scores, room to pad the last vector
    chunks = first_chunk[n_tok]
    for task in prange(n_kv * chunks):
        h, c = task // chunks, task % chunks
        t = 0
        while first_chunk[t + 1] <= c:
            t += 1
        lo = (c - first_chunk[t]) * ATTENTION_CHUNK
        where = np.empty(ATTENTION_CHUNK, np.int64)  # the chunk's positions in the cache
        starts = np.empty(ATTENTION_CHUNK, np.int64)  # where their values' rows start, in elements
        size, base = 0, 0
        for r in range(first_run[t], first_run[t + 1]):
            first, n = runs[r, 0], runs[r, 1]
            for p in range(max(lo, base), min(lo + ATTENTION_CHUNK, base + n)):
                where[size] = first + p - base
                starts[size] = (h * v.shape[1] + where[size]) * hd
                size += 1
            base += n
        heads = np.zeros((group, padded), F32)  # the query heads of kv head h
        for g in range(group):
            for d in range(hd):
                heads[g, d] = q[t, h, g, d]
        scores = np.empty(group * stride, F32)
        acc = np.zeros(group * summed, F32)
        _key_scores(heads, padded, k, h, where, size, scores, stride, v, starts)
        tail = -(-size // width) * width
        for g in range(group):
            for i in range(size, tail):
                scores[g * stride + i] = -np.inf
            top = _largest(scores, g * stride, tail, width)
            total = _exp_in_place(scores[g * stride : g * stride + size], top)
            m_out[h, c, g], l_out[h, c, g] = top, total
        _weighted_sums(acc, summed, v, starts, size, hd, scores, stride)
        for g in range(group):  # (a loop: `acc_out[h, c] = acc` compiles its shape check's error
            for d in range(hd):  # message, seconds of a first start)
                acc_out[h, c, g, d] = acc[g * summed + d]


def one_token_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, runs, sinks=None) -> np.ndarray:
    """softmax(q · keys) · values for one new token: q [n_kv, group, hd] (scaled), k, v one layer of the
    cache (float32, or float16 read as float32): keys [n_kv, slots, hd, B] as the arena holds them or rows
    [n_kv, N, hd], values [n_kv, N, hd]; and the runs (first, n) of its positions to attend to
    → [n_kv, group, hd]. `sinks` [n_kv, group]: each head's logit more in its softmax, with no value
    (gpt-oss), joined where the chunks are."""
    return tokens_attention(q[None], k, v, [runs], sinks)[0]


def tokens_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, runs: list, sinks=None) -> np.ndarray:
    """one_token_attention of several new tokens (several sequences' next tokens) in one call: q [n_tok,
    n_kv, group, hd], runs[t] the runs of token t → [n_tok, n_kv, group, hd]. One call for all: each call
    wakes numba's threads (none under PARALLEL_TOKEN_ATTENTION_FROM multiply-adds of scores: the calling
    thread alone is sooner). Each token's result has the bits it gets alone: its chunks are computed alone and
    merged alone, on any number of threads."""
    n_tok, n_kv, group, hd = q.shape
    runs = [np.asarray(r, dtype=np.int64).reshape(-1, 2) for r in runs]  # (as from KVViews.runs: no copy)
    first_run = np.cumsum([0] + [len(r) for r in runs])
    first_chunk = np.cumsum([0] + [-(-int(r[:, 1].sum()) // ATTENTION_CHUNK) for r in runs])
    total = int(first_chunk[-1])
    m = np.empty((n_kv, total, group), F32)
    l = np.empty((n_kv, total, group), F32)
    acc = np.empty((n_kv, total, group, hd), F32)
    joined = runs[0] if n_tok == 1 else np.concatenate(runs)
    k = as_blocks(k)
    few = int(joined[:, 1].sum()) * n_kv * group * hd < PARALLEL_TOKEN_ATTENTION_FROM
    with threads.kernels_on_this_thread() if few else nullcontext():
        _one_token_attention(q, bits_view(k), bits_view(v), joined, first_run, first_chunk, m, l, acc)
    out = np.empty((n_tok, n_kv, group, hd), F32)
    no_sinks = sinks is None
    sinks = np.zeros((n_kv, group), F32) if no_sinks else np.asarray(sinks, F32)
    _merge_chunks(m, l, acc, first_chunk, sinks, no_sinks, out)
    return out


def as_blocks(k: np.ndarray) -> np.ndarray:
    """A layer of keys as the kernels read them, [n_kv, slots, hd, B] (the arena's layout), from that or
    from rows [n_kv, N, hd] (a copy, in blocks of the pool's default size)."""
    return k if k.ndim == 4 else keys_as_blocks(k, DEFAULT_BLOCK_SIZE)


@njit(cache=True)
def _merge_chunks(m, l, acc, first_chunk, sinks, no_sinks, out):
    """Each token's chunks of _one_token_attention joined, in chunk order: out[t, h, g] = Σ_c w_c ·
    acc[h, c, g] / Σ_c w_c · l[h, c, g], w_c = exp(m[h, c, g] - the largest m), a sink (unless
    no_sinks) a weight more with no value. Compiled: a handful of NumPy calls here cost more than the
    attention of a few hundred positions."""
    n_tok, n_kv, group, hd = out.shape
    for t in range(n_tok):
        lo, hi = first_chunk[t], first_chunk[t + 1]
        for h in range(n_kv):
            for g in range(group):
                top = F32(-np.inf) if no_sinks else sinks[h, g]  # (all float32, as the kernel's sums)
                for c in range(lo, hi):
                    top = max(top, m[h, c, g])
                weight = F32(0) if no_sinks else _exp_nonpositive(sinks[h, g] - top)
                for d in range(hd):
                    out[t, h, g, d] = 0
                for c in range(lo, hi):
                    scale = _exp_nonpositive(m[h, c, g] - top)
                    weight += l[h, c, g] * scale
                    for d in range(hd):
                        out[t, h, g, d] += acc[h, c, g, d] * scale
                for d in range(hd):
                    out[t, h, g, d] /= weight


@njit(cache=True, fastmath=SOFTMAX)
def _online_softmax(scores, n, b, masked, lo, hi, softcap, top, total, acc, shift, scale):
    """A block's scores [n, lanes] (positions b…) made its weights, lane by lane: soft-capped (gemma2's
    tanh(score / softcap) · softcap, where softcap is not 0), masked outside each lane's [lo, hi), the
    running max `top` raised to the block's, the running sum `total` and weighted sums `acc` [hd, lanes]
    scaled to it, exp(score - top) added to total (shift, scale: room for a number per lane). A function
    of its own, as _exp_in_place is: in the kernel's parallel loop LLVM left these loops scalar. No
    infinities (fast-math assumes none): UNSEEN stands for a masked score and a max not yet had."""
    width = scores.shape[1]
    if softcap:
        for j in range(n):
            for lane in range(width):
                scores[j, lane] = np.tanh(scores[j, lane] / softcap) * softcap
    if masked:
        for j in range(n):
            for lane in range(width):
                if b + j < lo[lane] or b + j >= hi[lane]:
                    scores[j, lane] = UNSEEN
    for lane in range(width):
        shift[lane], scale[lane] = top[lane], 1
    for j in range(n):
        for lane in range(width):
            shift[lane] = max(shift[lane], scores[j, lane])
    for lane in range(width):
        if shift[lane] == UNSEEN:  # nothing seen yet: nothing to scale
            shift[lane] = 0
        else:
            scale[lane] = _exp_nonpositive(top[lane] - shift[lane])
            top[lane] = shift[lane]
        total[lane] *= scale[lane]
    for d in range(acc.shape[0]):
        for lane in range(width):
            acc[d, lane] *= scale[lane]
    for j in range(n):
        for lane in range(width):
            scores[j, lane] = _exp_nonpositive(scores[j, lane] - shift[lane])
    if masked:
        for j in range(n):
            for lane in range(width):
                if b + j < lo[lane] or b + j >= hi[lane]:
                    scores[j, lane] = 0
    for j in range(n):
        for lane in range(width):
            total[lane] += scores[j, lane]


@njit(cache=True)
def _gather_rows(kv, where, out):
    """out[h, i] = row where[i] of head h of a layer of keys or values, as float32: the positions a call of
    rows_attention reads, widened once for all its tasks (each would otherwise widen them again)."""
    n_kv, _, hd = kv.shape
    n = len(where)
    whole = hd - hd % WIDTH
    for h in range(n_kv):
        for i in range(n):
            row = where[i]
            _widen(kv, (h * kv.shape[1] + row) * hd, out, (h * n + i) * hd, whole, WIDTH)
            for d in range(whole, hd):
                out[h, i, d] = to_f32(kv[h, row, d])


@njit(cache=True)
def _gather_key_rows(k, where, out):
    """out[h, i] = the key of arena position where[i] of head h of a layer of keys k [n_kv, slots, hd,
    B] (float16 bits or float32), as float32: each block the positions lie in widened whole once, then
    its lanes taken apart into rows."""
    n_kv, slots, hd, B = k.shape
    block = np.empty(hd * B, F32)
    for h in range(n_kv):
        widened = -1
        for i in range(len(where)):
            slot, lane = where[i] // B, where[i] % B
            if slot != widened:
                _widen(k, (h * slots + slot) * hd * B, block, 0, hd * B, WIDTH)
                widened = slot
            for d in range(hd):
                out[h, i, d] = block[d * B + lane]


@njit(cache=True, parallel=True, fastmath=DOT)
def _rows_attention(q, k, v, seen_from, seen_to, origin, softcap, sinks, no_sinks, out):
    """rows_attention's kernel: a task per kv head h and tile of WIDTH query vectors (q [n_tok, n_kv,
    group, hd] flattened to its n_tok·group queries of h; the last tile padded with the last query,
    its sums unused) over k, v [n_kv, S, hd] (float32, the positions in order). Lane by lane: positions
    b … b + TILE_BLOCK scored, the ones outside the query's own [seen_from, seen_to) masked, the
    running max, sum of exps and weighted sums rescaled to the block's max and added to. Blocks start
    where the sequence's position (origin + b) is a multiple of TILE_BLOCK, so a query's sums are the
    same in any tile and any view that holds its positions: positions it does not see add exactly 0
    and a block of none of them scales its sums by exactly 1."""
    n_tok, n_kv, group, hd = q.shape
    S = k.shape[1]
    width = WIDTH
    n_vec = n_tok * group
    tiles = -(-n_vec // width)
    for task in prange(n_kv * tiles):
        h, tile = task // tiles, task % tiles
        queries = np.zeros((hd, width), F32)  # transposed: a query in each lane
        lo, hi = np.empty(width, np.int64), np.empty(width, np.int64)
        top, total = np.empty(width, F32), np.empty(width, F32)
        for lane in range(width):
            f = min(tile * width + lane, n_vec - 1)
            t, g = f // group, f % group
            lo[lane], hi[lane] = seen_from[t], seen_to[t]
            top[lane] = UNSEEN if no_sinks else sinks[h, g]  # a sink: a score more, with no value
            total[lane] = 0 if no_sinks else 1
            for d in range(hd):
                queries[d, lane] = q[t, h, g, d]
        acc = np.zeros((hd, width), F32)
        scores = np.empty((TILE_BLOCK, width), F32)
        shift, scale = np.empty(width, F32), np.empty(width, F32)
        first, last, latest_from, earliest_to = lo.min(), hi.max(), lo.max(), hi.min()
        for edge in range(first - (origin + first) % TILE_BLOCK, last, TILE_BLOCK):
            b = max(edge, 0)  # (a view may start inside a block)
            n = min(edge + TILE_BLOCK, last) - b
            at = (h * S + b) * hd
            for j in range(0, n - n % TILE_KEYS, TILE_KEYS):
                _tile_scores(queries, k, at + j * hd, hd, scores, j * width, TILE_KEYS, width)
            for j in range(n - n % TILE_KEYS, n):  # (the last keys past the layer's: one at a time)
                _tile_scores(queries, k, at + j * hd, hd, scores, j * width, 1, width)
            masked = b < latest_from or b + n > earliest_to
            _online_softmax(scores, n, b, masked, lo, hi, softcap, top, total, acc, shift, scale)
            for d in range(0, hd, TILE_DIMS):
                _tile_add(acc, d, scores, v, at, n, hd, TILE_DIMS, width)
        for lane in range(min(width, n_vec - tile * width)):
            f = tile * width + lane
            t, g = f // group, f % group
            for d in range(hd):
                out[t, h, g, d] = acc[d, lane] / total[lane]


def rows_attention(
    q: np.ndarray, k, v, runs, seen_from, seen_to, origin=0, softcap=0.0, sinks=None
) -> np.ndarray:
    """softmax(q · keys) · values for several new rows of one sequence: q [n_tok, n_kv, group, hd] (scaled),
    k, v one layer of the cache as one_token_attention's, the runs (first, n) of it in position order, and per
    row the part of those positions it sees, [seen_from[t], seen_to[t]) counted along the runs (a causal mask,
    a sliding window) → [n_tok, n_kv, group, hd]; `origin`: the first of those positions' place in the
    sequence; `softcap` as forward.attention's (0: none); `sinks` as one_token_attention's. The heads' size a
    multiple of TILE_DIMS (every model's; attend() asks BLAS otherwise). A row's result depends on its query
    and the positions it sees alone: the same beside any other rows, in any view (a prompt read in pieces or
    whole, a token decoded before KERNEL_ATTENTION_FROM positions)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    where = np.concatenate([np.arange(first, first + n) for first, n in runs])
    n_tok, n_kv, group, hd = q.shape
    out = np.empty((n_tok, n_kv, group, hd), F32)
    no_sinks = sinks is None
    sinks = np.zeros((n_kv, group), F32) if no_sinks else np.asarray(sinks, F32).reshape(n_kv, group)
    seen_from, seen_to = (np.asarray(a, dtype=np.int64) for a in (seen_from, seen_to))
    keys, values = (np.empty((n_kv, len(where), hd), F32) for _ in range(2))
    _gather_key_rows(bits_view(as_blocks(k)), where, keys)
    _gather_rows(bits_view(v), where, values)
    _rows_attention(q, keys, values, seen_from, seen_to, origin, F32(softcap), sinks, no_sinks, out)
    return out


def one_token_attention_reference(q, k, v, runs, sinks=None, softcap=0.0) -> np.ndarray:
    """one_token_attention as the maths reads, in float64: softmax over the runs' positions (and the
    sinks) at once, the scores soft-capped where softcap is not 0."""
    where = np.concatenate([np.arange(first, first + n) for first, n in runs])
    keys, values = k[:, where].astype(np.float64), v[:, where].astype(np.float64)  # [n_kv, S, hd]
    scores = q.astype(np.float64) @ keys.transpose(0, 2, 1)  # [n_kv, group, S]
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    if sinks is not None:  # a last score whose value is zero
        scores = np.concatenate([scores, sinks[..., None].astype(np.float64)], axis=-1)
        values = np.concatenate([values, np.zeros_like(values[:, :1])], axis=1)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ values
