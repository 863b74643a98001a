"""The transformer forward pass in plain NumPy: one function per idea, float32 activations throughout
(the weights stay quantized; their matrix products are compiled kernels, see kernels.py).

Shapes in comments: T new tokens, S cached positions, d = n_embd, hd = head_dim.
Architecture differences (QKV bias, q/k norms, pre- and post-norms, sliding windows, GELU vs SiLU,
embedding, residual and logit scales, soft-capping, layers without RoPE) are switches in
`ModelConfig`, read from the GGUF metadata.
The weights come as `Weights` (built once at load by weights.py), the KV as `KVSequence`s whose
memory layout is kv_cache.py's business. One call of `step` is one forward pass: cutting a long
prompt into passes is the caller's (model.Model.prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import experts, kernels
from .attention import TILE_DIMS
from .config import ModelConfig
from .cpu import PROFILE
from .errors import ContextFullError
from .kv_arena import KVViews
from .kv_cache import KVSequence
from .rope import rope
from .segment import Segment

if TYPE_CHECKING:
    from .experts import Experts
    from .quants import PackedMatrix, StackedMatrix

F32 = np.float32


class Embeddings(Protocol):
    def rows(self, ids: np.ndarray) -> np.ndarray: ...  # float32 [len(ids), d]


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block's weights as the kernels read them; the optional ones are None where the
    architecture has none."""

    attn_norm: np.ndarray | None  # [d] (None: olmo2, whose norms come after)
    attn_qkv: PackedMatrix | StackedMatrix  # q, k and v fused: [q_dim + 2·kv_dim, d]
    attn_output: PackedMatrix  # [d, q_dim]
    ffn_norm: np.ndarray | None  # [d]
    ffn_gate_up: PackedMatrix | None = None  # gate and up fused: [2·n_ff, d] (None: experts instead)
    ffn_down: PackedMatrix | None = None  # [d, n_ff]
    experts: Experts | None = None  # a mixture of experts in place of the one FFN (qwen3moe)
    attn_qkv_bias: np.ndarray | None = None  # [q_dim + 2·kv_dim] (qwen2)
    attn_q_norm: np.ndarray | None = None  # [hd] (qwen3, gemma3); [q_dim] (olmo2)
    attn_k_norm: np.ndarray | None = None  # [hd]; [kv_dim] (olmo2)
    post_attention_norm: np.ndarray | None = None  # [d] (gemma3)
    post_ffw_norm: np.ndarray | None = None  # [d]
    attn_output_bias: np.ndarray | None = None  # [d] (gpt-oss)
    attn_sinks: np.ndarray | None = None  # [n_head] each head's sink logit (gpt-oss)


@dataclass(frozen=True)
class Weights:
    """Everything the forward pass reads of a model's tensors."""

    token_embd: Embeddings
    output_norm: np.ndarray  # [d]
    output: PackedMatrix  # [n_vocab, d]
    layers: tuple[LayerWeights, ...]
    rope_freqs: np.ndarray | None = None  # [n_rot/2] per-frequency factors (llama 3; phi3's LongRoPE)
    activations: str = "f32"  # what its products take their inputs as (kernels.ACTIVATIONS)

    def matrices(self) -> list[PackedMatrix | StackedMatrix]:
        """Every weight matrix the forward pass multiplies (a mixture's router and experts included)."""
        found = [self.output]
        for layer in self.layers:
            found += [layer.attn_qkv, layer.attn_output, layer.ffn_gate_up, layer.ffn_down]
            if layer.experts is not None:
                found += [layer.experts.router, *layer.experts.gate_up, *layer.experts.down]
        return [m for m in found if m is not None]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x [..., n]; mean over the last axis in float32 (np.float32 eps keeps NumPy from promoting), as
    # np.mean computes it but without its Python wrapper: 49 norms run for every decoded token
    mean_square = np.add.reduce(x * x, axis=-1, keepdims=True) / F32(x.shape[-1])
    return x * (1.0 / np.sqrt(mean_square + F32(eps))) * weight


def pre_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """The RMSNorm before attention or the FFN; none where the architecture has none (olmo2)."""
    return x if weight is None else rms_norm(x, weight, eps)


def linear(x: np.ndarray, weight) -> np.ndarray:
    """x [n, in] @ weight[out, in].T → [n, out], weight packed from the GGUF (kernels.py: the kernels
    read each weight once for all rows; past KERNEL_ROWS rows BLAS on dequantized tiles, where this
    machine measured it faster)."""
    return kernels.matmul(x, weight)


def exp_shifted_(x: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """exp(x - max) over the last axis, in place (the scores are large in a long prefill); returns the
    row sums. Softmax without its division: the caller divides the S-times-smaller attention output.
    `sinks` (broadcast to x's rows): a logit more in each row's softmax, one that has no value."""
    top = x.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks)
    x -= top
    np.exp(x, out=x)
    total = x.sum(axis=-1, keepdims=True)
    return total if sinks is None else total + np.exp(sinks - top)


def _join(pieces: list[np.ndarray], axis: int) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)


def attention(q, parts, mask, scale: float, softcap: float, sinks=None) -> np.ndarray:
    """Grouped-query attention. q [n_head, T, hd]; parts: (k, v) pieces of the cache, each [n_kv, S_i, hd],
    in position order; mask [T, S] (0 or -inf) or None; sinks [n_head] or None → [T, n_head·hd]."""
    n_head, T, hd = q.shape
    n_kv = parts[0][0].shape[0]
    group = n_head // n_kv
    # query heads that share a kv head, stacked; scaled here, where there are fewer numbers than scores
    qg = q.reshape(n_kv, group * T, hd) * F32(scale)
    # The cache is read where it lies, not copied. For one new token, keys @ queries is the faster BLAS
    # shape (the long side S as rows, not 2-14 query rows); for many, queries @ keys is (5x at T=512).
    if T == 1:
        pieces = [k @ qg.transpose(0, 2, 1) for k, _ in parts]  # [n_kv, S_i, group]
        scores = _join(pieces, axis=1).transpose(0, 2, 1)
    else:
        scores = _join([qg @ k.transpose(0, 2, 1) for k, _ in parts], axis=2)  # [n_kv, group·T, S]
    # Contiguous rows for the softmax: over a strided view it costs more than the matmul itself
    # (np.concatenate keeps its inputs' memory order, so a joined view needs this too).
    scores = np.ascontiguousarray(scores)
    S = scores.shape[-1]
    scores = scores.reshape(n_kv, group, T, S)
    if softcap:
        scores = np.tanh(scores / F32(softcap)) * F32(softcap)
    if mask is not None:
        scores += mask
    head_sinks = None if sinks is None else sinks.reshape(n_kv, group, 1, 1)
    total = exp_shifted_(scores, head_sinks).reshape(n_kv, group * T, 1)
    weights = scores.reshape(n_kv, group * T, S)
    out, start = None, 0
    for _, v in parts:
        part = weights[:, :, start : start + v.shape[1]] @ v
        out = part if out is None else out + part
        start += v.shape[1]
    out /= total  # softmax's normalisation, on [.., hd] rather than [.., S]
    return out.reshape(n_head, T, hd).transpose(1, 0, 2).reshape(T, n_head * hd)


def one_token_attentions(rows: list, scale: float, sinks=None) -> None:
    """attention() of single query rows by the compiled kernel, every row of a step in one call (each call
    wakes numba's threads): rows of (out [1, n_head·hd], q [n_head, 1, hd], (k, v, runs) of KVViews.runs,
    one layer of the cache and the runs of it that row attends to). Each row gets the bits it gets alone.
    `sinks` [n_head]: the layer's attention sinks (gpt-oss)."""
    q = np.stack([q for _, q, _ in rows])  # [n, n_head, 1, hd]
    n, n_head, _, hd = q.shape
    k, v, _ = rows[0][2]  # (every sequence of a step lies in one pool's arena)
    n_kv = k.shape[0]
    qg = q.reshape(n, n_kv, n_head // n_kv, hd) * F32(scale)  # query heads by their kv head
    sinks = None if sinks is None else sinks.reshape(n_kv, -1)
    found = kernels.tokens_attention(qg, k, v, [runs for *_, (_, _, runs) in rows], sinks)
    for (out, _, _), row in zip(rows, found.reshape(n, 1, n_head * hd), strict=True):
        out[:] = row


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return F32(0.5) * x * (F32(1.0) + np.tanh(F32(0.7978845608028654) * (x + F32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    e = np.negative(x)  # x / (1 + e^-x), in one fresh array: these are the largest activations
    np.exp(e, out=e)
    e += F32(1.0)
    return np.divide(x, e, out=e)


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = F32(1.702), F32(7.0)  # gpt-oss's (llama.cpp's build_moe_ffn)


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's gated unit: the gate clamped above and the up projection both ways at the limit, then
    gate·sigmoid(alpha·gate)·(up + 1)."""
    gate = np.minimum(gate, SWIGLU_OAI_LIMIT)
    up = np.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return gate / (F32(1.0) + np.exp(-SWIGLU_OAI_ALPHA * gate)) * (up + F32(1.0))


def gated_ffn(x: np.ndarray, gate_up, down, act: str, gate_up_bias=None, down_bias=None) -> np.ndarray:
    """x [T, d] → down · (act(gate · x) * (up · x)) [T, d], gate and up fused in gate_up [2·n_ff, d];
    the biases [2·n_ff] and [d] added to the products where given."""
    gate_up = linear(x, gate_up)  # [T, 2·n_ff]
    if gate_up_bias is not None:
        gate_up += gate_up_bias
    out = linear(gated_unit(gate_up, act), down)  # [T, d]
    return out if down_bias is None else out + down_bias


def gated_unit(gate_up: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up [T, n_ff] of the products gate and up side by side [T, 2·n_ff]."""
    n_ff = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n_ff], gate_up[:, n_ff:]
    if act == "swiglu_oai":
        return swiglu_oai(gate, up)
    h = gelu_tanh(gate) if act == "gelu" else silu(gate)
    h *= up
    return h


def feed_forward(x: np.ndarray, lw: LayerWeights, cfg: ModelConfig) -> np.ndarray:
    if lw.experts is None:
        return gated_ffn(x, lw.ffn_gate_up, lw.ffn_down, cfg.ffn_act)
    ffn, unit = partial(gated_ffn, act=cfg.ffn_act), partial(gated_unit, act=cfg.ffn_act)
    k, gating, normalize = cfg.n_expert_used, cfg.expert_gating, cfg.expert_weights_norm
    return experts.mixture(x, lw.experts, k, gating, normalize, ffn, unit)


ATTENTION_ROWS = 128  # query rows per attention call: each group reads keys only up to its last row
# From this many cached positions one token's attention goes to the compiled kernel (kernels.py).
KERNEL_ATTENTION_FROM = PROFILE.kernel_attention_from


def attend(
    q: np.ndarray,
    seg: Segment,
    layer: int,
    window: int,
    scale: float,
    softcap: float,
    out,
    by_kernel: list,
    sinks=None,
) -> None:
    """One sequence's attention over its cached blocks, read as slices of the arena, into out. q holds the
    segment's last rows (all of them, or only the last one). A long prefill goes in groups of rows:
    causal attention lets the early rows skip the later keys, a quarter to a third of the work. Single
    rows that the compiled kernel takes are added to by_kernel instead, for one_token_attentions."""
    T, rows = len(seg.tokens), q.shape[1]
    for lo in range(T - rows, T, seg.attention_rows):
        hi = min(lo + seg.attention_rows, T)
        views, mask = seg.view(window, lo, hi)
        at = lo - (T - rows)
        q_rows = q[:, at : at + hi - lo]
        if hi - lo == 1 and mask is None and not softcap and views.n_positions >= KERNEL_ATTENTION_FROM:
            by_kernel.append((out[at : at + 1], q_rows, views.runs(layer)))
        elif q.shape[2] % TILE_DIMS == 0:
            seen = seg.seen(window, lo, hi)
            out[at : at + hi - lo] = rows_attention(q_rows, views, layer, seen, scale, softcap, sinks)
        else:
            out[at : at + hi - lo] = attention_in_threads(q_rows, views, layer, mask, scale, softcap, sinks)


def rows_attention(q, views: KVViews, layer: int, seen, scale: float, softcap: float, sinks=None):
    """attention() of several rows of one sequence by the compiled kernel: q [n_head, T, hd], what each
    row sees as Segment.seen gives it → [T, n_head·hd]."""
    n_head, T, hd = q.shape
    k, v, runs = views.runs(layer)
    n_kv = k.shape[0]
    qg = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(T, n_kv, n_head // n_kv, hd) * F32(scale)
    found = kernels.rows_attention(qg, k, v, runs, *seen, softcap=softcap, sinks=sinks)
    return found.reshape(T, n_head * hd)


def attention_in_threads(q, views: KVViews, layer: int, mask, scale: float, softcap: float, sinks=None):
    """attention() with the query rows split over the threads where that pays (kernels.attention_threads).
    Where a row's bits matter (a prompt read alone or beside others) the split depends only on its own
    segment's rows, so it is the same either way."""
    # (BLAS has no float16: a float16 cache is read once per call into float32, shared by the threads below)
    parts = [(k.astype(F32, copy=False), v.astype(F32, copy=False)) for k, v in views.layer(layer)]
    T = q.shape[1]
    n = kernels.attention_threads(T, views.n_positions)
    if n == 1:
        return attention(q, parts, mask, scale, softcap, sinks)
    cuts = [T * i // n for i in range(n + 1)]
    tasks = [
        partial(attention, q[:, a:b], parts, None if mask is None else mask[a:b], scale, softcap, sinks)
        for a, b in zip(cuts, cuts[1:])
    ]
    return np.concatenate(kernels.in_parallel(tasks))


def self_attention(
    x: np.ndarray,
    w: Weights,
    layer: int,
    cfg: ModelConfig,
    segments: list[Segment],
    positions: np.ndarray,
    last_layer: bool,
):
    """Writes every row's K and V; returns the attention output of every row, or in the last layer of
    the rows each segment keeps."""
    lw = w.layers[layer]
    T = x.shape[0]
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    qkv = linear(x, lw.attn_qkv)  # [T, q_dim + 2·kv_dim]
    if lw.attn_qkv_bias is not None:
        qkv += lw.attn_qkv_bias
    if cfg.qk_norm_whole:  # olmo2: q and k normed over all their heads at once
        qkv[:, :q_dim] = rms_norm(qkv[:, :q_dim], lw.attn_q_norm, cfg.norm_eps)
        qkv[:, q_dim : q_dim + kv_dim] = rms_norm(
            qkv[:, q_dim : q_dim + kv_dim], lw.attn_k_norm, cfg.norm_eps
        )
    q = qkv[:, :q_dim].reshape(T, cfg.n_head, cfg.head_dim).transpose(1, 0, 2)  # [n_head, T, hd]
    k = qkv[:, q_dim : q_dim + kv_dim].reshape(T, cfg.n_head_kv, cfg.head_dim).transpose(1, 0, 2)
    v = qkv[:, q_dim + kv_dim :].reshape(T, cfg.n_head_kv, cfg.head_dim).transpose(1, 0, 2)
    if cfg.qk_norm and not cfg.qk_norm_whole:
        q = rms_norm(q, lw.attn_q_norm, cfg.norm_eps)
        k = rms_norm(k, lw.attn_k_norm, cfg.norm_eps)
    sliding = cfg.is_sliding(layer)
    base = cfg.rope_base_swa if sliding else cfg.rope_base
    if cfg.rotates(layer):
        q = rope(q, positions, base, cfg.rope_neox, w.rope_freqs, cfg.rope_dim, cfg.rope_scale, cfg.yarn)
        k = rope(k, positions, base, cfg.rope_neox, w.rope_freqs, cfg.rope_dim, cfg.rope_scale, cfg.yarn)
    window = cfg.sliding_window if sliding else 0
    rows = [seg.kept if last_layer else seg.rows for seg in segments]
    out = np.empty((sum(r.stop - r.start for r in rows), q_dim), dtype=F32)
    scale = cfg.attn_scale or 1.0 / np.sqrt(cfg.head_dim)
    at, by_kernel = 0, []
    for seg, r in zip(segments, rows, strict=True):
        seg.seq.write(layer, seg.where, k[:, seg.rows], v[:, seg.rows])
        rows_out = out[at : at + r.stop - r.start]
        attend(q[:, r], seg, layer, window, scale, cfg.attn_logit_softcap, rows_out, by_kernel, lw.attn_sinks)
        at += r.stop - r.start
    if by_kernel:  # the decoded rows of every sequence, in one call
        one_token_attentions(by_kernel, scale, lw.attn_sinks)
    out = linear(out, lw.attn_output)  # [rows, d]
    return out if lw.attn_output_bias is None else out + lw.attn_output_bias


def transformer_block(
    x: np.ndarray,
    w: Weights,
    layer: int,
    cfg: ModelConfig,
    segments: list[Segment],
    positions,
    last_layer: bool = False,
):
    """In the last layer, go on with the rows each segment keeps (Segment.kept: nothing reads the others
    there but their K and V)."""
    lw = w.layers[layer]
    h = self_attention(
        pre_norm(x, lw.attn_norm, cfg.norm_eps), w, layer, cfg, segments, positions, last_layer
    )
    if last_layer and any(seg.kept != seg.rows for seg in segments):
        x = x[np.concatenate([np.arange(seg.kept.start, seg.kept.stop) for seg in segments])]
    if cfg.post_norms:
        h = rms_norm(h, lw.post_attention_norm, cfg.norm_eps)
    if cfg.residual_scale:  # granite
        h *= F32(cfg.residual_scale)
    x = x + h
    h = feed_forward(pre_norm(x, lw.ffn_norm, cfg.norm_eps), lw, cfg)
    if cfg.post_norms:
        h = rms_norm(h, lw.post_ffw_norm, cfg.norm_eps)
    if cfg.residual_scale:
        h *= F32(cfg.residual_scale)
    return x + h


def output_logits(x: np.ndarray, w: Weights, cfg: ModelConfig) -> np.ndarray:
    x = rms_norm(x, w.output_norm, cfg.norm_eps)
    logits = linear(x, w.output)  # [n, n_vocab]
    if cfg.logit_scale:  # granite divides its logits, as llama.cpp: times 1/logit_scale in float32
        logits *= F32(1.0) / F32(cfg.logit_scale)
    if cfg.final_logit_softcap:
        logits = np.tanh(logits / F32(cfg.final_logit_softcap)) * F32(cfg.final_logit_softcap)
    return logits


def run_parts(
    parts: list[tuple[KVSequence, np.ndarray, int, bool, bool]], w: Weights, cfg: ModelConfig
) -> np.ndarray:
    """One forward step over new tokens of one or more sequences, each with its own (tokens,
    attention_rows, all_rows, commit): e.g. a prompt's piece (its last row kept, taken) beside replies'
    rows being verified (all kept; without commit their KV is written but the sequences do not take
    them yet, see verify_draft). Returns the final hidden states of the rows kept, in order."""
    segments, row = [], 0
    for seq, tokens, attention_rows, all_rows, commit in parts:
        segments.append(Segment(seq, slice(row, row + len(tokens)), tokens, attention_rows, all_rows, commit))
        row += len(tokens)
    tokens = np.concatenate([seg.tokens for seg in segments])
    positions = np.concatenate([s.positions for s in segments])
    kernels.use_blas_threads_for(len(tokens), w.activations, w.matrices)
    x = w.token_embd.rows(tokens)  # [T, d]
    if cfg.embed_scale != 1.0:
        x = x * F32(cfg.embed_scale)
    for layer in range(cfg.n_layer):
        x = transformer_block(x, w, layer, cfg, segments, positions, layer == cfg.n_layer - 1)
    for seg in segments:
        if seg.commit:
            seg.seq.commit(seg.tokens)
    return x


def check_room(seq: KVSequence, n_new: int) -> None:
    if seq.n_tokens + n_new > seq.n_ctx:
        raise ContextFullError(
            f"{seq.n_tokens + n_new:,} tokens do not fit in the context window of {seq.n_ctx:,} (raise --ctx)"
        )


def step(
    batch: list[tuple[KVSequence, np.ndarray]],
    w: Weights,
    cfg: ModelConfig,
    all_logits: bool = False,
    commit: bool = True,
    attention_rows: int = ATTENTION_ROWS,
) -> np.ndarray:
    """One forward pass over new tokens of one or more sequences (a prompt's batch, one token of each of
    several replies, or both): logits of every row [T, n_vocab], or of each sequence's last row
    [n_seqs, n_vocab]. A row gets the same bits whatever else is in the step as long as the step has at
    most kernels.KERNEL_ROWS rows (more may go to BLAS, equal within float32 rounding) and its sequence's KV
    lies in the same slots (attention sums the history piece by piece as it lies in the arena)."""
    parts = [(seq, tokens, attention_rows, all_logits, commit) for seq, tokens in batch]
    return step_parts(parts, w, cfg)


def step_parts(parts: list[tuple], w: Weights, cfg: ModelConfig) -> np.ndarray:
    """run_parts, checked (no empty part, every part fits its context window), → logits of the rows kept."""
    parts = [(seq, np.asarray(tokens, dtype=np.int64), *options) for seq, tokens, *options in parts]
    for seq, tokens, *_ in parts:
        if len(tokens) == 0:
            raise ValueError("a forward step needs at least one token per sequence")
        check_room(seq, len(tokens))
    return output_logits(run_parts(parts, w, cfg), w, cfg)


def read_and_verify(
    reads: list[tuple[KVSequence, np.ndarray]],
    checks: list[tuple[KVSequence, np.ndarray]],
    w: Weights,
    cfg: ModelConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """One forward pass over prompts' pieces (`reads`: taken by their sequences, attention in groups of
    ATTENTION_ROWS, the last row's logits) and replies' rows (`checks`: written, not taken, attention row
    by row, every row's logits, as verify_rows computes them): logits [len(reads), n_vocab] and
    [Σ len(checks_i), n_vocab]. Each row has the bits of its own pass where the kernels take this one
    (kernels.kernels_take of all its rows): a piece's as read alone, a reply's row as decoded alone."""
    parts = [(seq, t, ATTENTION_ROWS, False, True) for seq, t in reads]
    logits = step_parts(parts + [(seq, t, 1, True, False) for seq, t in checks], w, cfg)
    return logits[: len(reads)], logits[len(reads) :]


def context_shift(seq: KVSequence, keep: int, drop: int, w: Weights, cfg: ModelConfig) -> None:
    """Forget positions keep..keep+drop-1 and move the later ones back by `drop`, re-rotating their keys
    (RoPE is a rotation: one more rotation by -drop) instead of recomputing them, as llama.cpp's
    seq_rm + seq_add do (see KVSequence.shift)."""

    def rerotate(layer: int, k: np.ndarray) -> np.ndarray:  # k [kv_head, m, hd]
        if not cfg.rotates(layer):
            return k
        base = cfg.rope_base_swa if cfg.is_sliding(layer) else cfg.rope_base
        shift = np.full(k.shape[1], -drop)  # a rotation only: no scale (the keys have theirs)
        return rope(k, shift, base, cfg.rope_neox, w.rope_freqs, cfg.rope_dim, yarn=cfg.yarn)

    seq.shift(keep, drop, rerotate)
