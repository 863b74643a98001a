"""A model's hyperparameters, with the differences between architectures as data: read_config turns a
GGUF's metadata into them, with llama.cpp's keys and its defaults for each architecture
(src/models/<arch>.cpp); forward.py and weights.py read the switches."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .errors import ModelError
from .rope import yarn_scale

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gemma2", "phi3")
ARCHITECTURES += ("granite", "olmo2", "smollm3", "gpt-oss")
ROPE_ADJACENT = ("llama", "granite", "smollm3")  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters, with architecture differences as data."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_neox: bool  # rotate split halves (qwen2/qwen3/gemma3) rather than adjacent pairs (llama)
    rope_base_swa: float = 0.0  # RoPE base of the sliding-window layers (gemma3)
    sliding_window: int = 0  # 0: every layer attends to the whole context
    swa_pattern: int = 0  # in every run of this many layers, all but the last use the window (gemma2, gemma3)
    qk_norm: bool = False  # RMSNorm over each head of q and k (qwen3, gemma3)
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before the residual (gemma2, gemma3)
    embed_scale: float = 1.0  # gemma multiplies embeddings by sqrt(n_embd)
    ffn_act: str = "silu"  # "silu" (SwiGLU), "gelu" (GELU-tanh gated, gemma) or "swiglu_oai" (gpt-oss)
    attn_scale: float = 0.0  # scale of q·k; 0 means 1/sqrt(head_dim)
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0
    # Switches added later (ADDED): the fingerprint describes them only where they are set
    n_expert: int = 0  # experts of each FFN, a mixture of experts (qwen3moe); 0: one dense FFN
    n_expert_used: int = 0  # experts each token is routed to
    n_ff_exp: int = 0  # the FFN width of each expert
    expert_weights_norm: bool = False  # the chosen experts' weights divided by their sum (qwen3moe)
    rope_dim: int = 0  # channels of each head that RoPE turns, the first ones (phi-4-mini); 0: all
    rope_attn_factor: float = 1.0  # LongRoPE (phi3): RoPE's cos and sin times this
    fused_gate_up: bool = False  # phi3: ffn_up holds the gate's rows, then the up projection's
    rope_long: bool = False  # phi3's LongRoPE with its long factors: a context past the original length
    residual_scale: float = 0.0  # granite: attention and FFN outputs times this before the residual; 0: 1
    logit_scale: float = 0.0  # granite: final logits divided by this; 0: 1
    pre_norms: bool = True  # RMSNorm before attention and the FFN (olmo2 has only the norms after)
    qk_norm_whole: bool = False  # olmo2: q/k norm over the whole projection, not over each head
    nope_step: int = 0  # smollm3: every nope_step-th layer turns no RoPE (NoPE); 0: every layer turns
    # "softmax": the k most probable experts of a softmax over all (qwen3moe); "softmax_weight": the k
    # highest router logits, weighted by a softmax over those k (gpt-oss)
    expert_gating: str = "softmax"
    expert_biases: bool = False  # the router and each expert's matrices add a bias (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head joins each softmax of attention, no value (gpt-oss)
    ffn_norm_tensor: str = "ffn_norm"  # the FFN's norm (gpt-oss's GGUF names it post_attention_norm)
    rope_yarn_factor: float = 0.0  # YaRN: how many times the trained context it stretches; 0: no YaRN
    rope_yarn_orig_ctx: int = 0  # YaRN: the context the model was trained at before the stretch

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and (
            self.swa_pattern == 0 or layer % self.swa_pattern < self.swa_pattern - 1
        )

    @property
    def yarn(self) -> tuple[float, int] | None:
        """YaRN's (factor, original context), as rope.rope takes it, or None."""
        return (self.rope_yarn_factor, self.rope_yarn_orig_ctx) if self.rope_yarn_factor else None

    @property
    def rope_scale(self) -> float:
        """What RoPE's cos and sin are multiplied by: LongRoPE's attention factor, YaRN's temperature."""
        return self.rope_attn_factor * yarn_scale(self.rope_yarn_factor)

    def rotates(self, layer: int) -> bool:
        """Whether the layer turns q and k by RoPE (llama.cpp: (il + 1) % n_no_rope_layer_step != 0)."""
        return not self.nope_step or (layer + 1) % self.nope_step != 0

    def description(self) -> dict:
        """What the KV depends on, as the model's fingerprint describes it: a switch of ADDED only where
        it is set, so that adding one keeps what older models stored."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in asdict(self).items() if k not in ADDED or v != defaults[k]}


_NAMES = [f.name for f in fields(ModelConfig)]
ADDED = frozenset(_NAMES[_NAMES.index("n_expert") :])  # n_expert and every switch after it


def read_config(meta: dict, path: Path) -> ModelConfig:
    """The GGUF's hyperparameters, as llama.cpp reads them for its architecture."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelError(f"{path}: missing metadata {arch}.{key}")
        return value

    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_layer = int(get("block_count"))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    n_expert = int(meta.get(f"{arch}.expert_count", 0))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    rope_dim = int(get("rope.dimension_count", head_dim))
    common = dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(get("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(get("feed_forward_length", 0 if n_expert else None)),
        n_vocab=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        n_ctx_train=int(get("context_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_neox=arch not in ROPE_ADJACENT,
        final_logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0)),
        attn_logit_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", 0.0)),
        rope_dim=rope_dim if rope_dim != head_dim else 0,
    )
    # llama.cpp scales q by 1/sqrt(head_dim) for the gemmas, but by 1/sqrt(n_embd/n_head) on the 27B
    # models (gemma2: 46 layers, gemma3: 62), as Google's reference does.
    gemma_scale = float(1.0 / np.sqrt(n_embd / n_head if n_layer in (46, 62) else head_dim))
    if arch == "qwen3":
        common.update(qk_norm=True)
    common.update(yarn_switches(meta, arch, common["n_ctx_train"]))
    if arch in ("qwen3moe", "gpt-oss"):
        n_used = int(get("expert_used_count"))
        if n_expert < 1 or not 0 < n_used <= n_expert:
            raise ModelError(
                f"{path}: {arch} needs 0 < expert_used_count ≤ expert_count, not {n_used} of {n_expert}"
            )
        n_ff_exp = get("expert_feed_forward_length", None if arch == "gpt-oss" else common["n_ff"] // n_used)
        common.update(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=int(n_ff_exp))
    if arch == "qwen3moe":
        # llama.cpp always divides the chosen weights by their sum here
        common.update(qk_norm=True, expert_weights_norm=True)
    if arch == "gpt-oss":
        # llama.cpp's openai-moe: a window on every other layer (the even ones), biases on the attention
        # and the experts, sinks, the clamped SwiGLU and a softmax over the chosen experts' logits
        common.update(
            sliding_window=int(get("attention.sliding_window")),
            swa_pattern=int(get("attention.sliding_window_pattern", 2)),
            rope_base_swa=float(get("rope.freq_base_swa", common["rope_base"])),
            ffn_act="swiglu_oai",
            expert_gating="softmax_weight",
            expert_biases=True,
            attn_sinks=True,
            ffn_norm_tensor="post_attention_norm",
        )
    if arch == "gemma2":
        # llama.cpp: a 4096-token window on every other layer (the even ones), soft-capping always on
        # (50 and 30 where the GGUF says nothing)
        common.update(
            sliding_window=int(get("attention.sliding_window", 4096)),
            swa_pattern=int(get("attention.sliding_window_pattern", 2)),
            rope_base_swa=float(get("rope.freq_base_swa", common["rope_base"])),
            post_norms=True,
            embed_scale=float(np.sqrt(n_embd)),
            ffn_act="gelu",
            attn_scale=gemma_scale,
            attn_logit_softcap=float(get("attn_logit_softcapping", 50.0)),
            final_logit_softcap=float(get("final_logit_softcapping", 30.0)),
        )
    if arch == "gemma3":
        # llama.cpp hard-codes these for gemma3 (llama-model.cpp): every 6th layer is global, the
        # others use a 10k RoPE base
        common.update(
            sliding_window=int(get("attention.sliding_window")),
            swa_pattern=6,
            rope_base_swa=10000.0,
            qk_norm=True,
            post_norms=True,
            embed_scale=float(np.sqrt(n_embd)),
            ffn_act="gelu",
            attn_scale=gemma_scale,
        )
    if arch == "phi3":
        common.update(phi3_switches(meta, common["n_ctx_train"]))
    if arch == "granite":
        common.update(granite_switches(meta, path))
    if arch == "olmo2":  # llama.cpp: norms after attention and the FFN only; q/k norms over all heads at once
        if int(meta.get("olmo2.attention.sliding_window", 0)):  # OLMo 3's windows, beside YaRN
            raise ModelError(f"{path}: olmo2 with a sliding window (OLMo 3) is not supported")
        common.update(post_norms=True, pre_norms=False, qk_norm=True, qk_norm_whole=True)
    if arch == "smollm3":  # llama.cpp hard-codes it (n_no_rope_layer_step): layers 3, 7, 11… turn no RoPE
        common.update(nope_step=4)
    return ModelConfig(**common)


def yarn_switches(meta: dict, arch: str, n_ctx_train: int) -> dict:
    """YaRN, where the GGUF's rope.scaling.type says so (llama.cpp applies it at every position):
    its factor and the original context (the trained one where the GGUF names none)."""
    if meta.get(f"{arch}.rope.scaling.type") != "yarn":
        return {}
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 0)) or n_ctx_train
    return {"rope_yarn_factor": factor, "rope_yarn_orig_ctx": original} if factor > 0 else {}


def phi3_switches(meta: dict, n_ctx_train: int) -> dict:
    """phi3's fused gate/up and its LongRoPE. llama.cpp turns a GGUF's sliding window off for phi3
    ("Phi SWA is currently disabled"), so none is read. LongRoPE: llama.cpp takes the short factors
    (rope_factors_short.weight) for a context of at most the original length, the long ones past it,
    and RoPE's cos and sin times rope.scaling.attn_factor either way. Read so, the context stops at the
    original length, where the short factors apply; with_context takes the long ones past it."""
    attn_factor = float(meta.get("phi3.rope.scaling.attn_factor", 1.0))
    switches: dict = {"fused_gate_up": True, "rope_attn_factor": attn_factor}
    original = int(meta.get("phi3.rope.scaling.original_context_length", 0))
    if 0 < original < n_ctx_train:
        switches["n_ctx_train"] = original
    return switches


def with_context(cfg: ModelConfig, meta: dict, n_ctx: int | None) -> ModelConfig:
    """The config for a context of n_ctx tokens per sequence (None: as read). A phi3 whose LongRoPE
    stops its context at the original length takes its long factors past it, with its whole trained
    context, as llama.cpp picks the factors by its context (llama_model::get_rope_factors); the
    fingerprint tells the two apart, so their KV never mixes."""
    full = int(meta.get(f"{cfg.arch}.context_length", 0))
    if cfg.arch != "phi3" or n_ctx is None or n_ctx <= cfg.n_ctx_train or full <= cfg.n_ctx_train:
        return cfg
    return replace(cfg, n_ctx_train=full, rope_long=True)


def granite_switches(meta: dict, path: Path) -> dict:
    """granite's scales, as llama.cpp reads them (src/models/granite.cpp): embeddings times
    embedding_scale, attention and FFN outputs times residual_scale before each residual, q·k times
    attention.scale, the final logits divided by logit_scale (the one that must be there)."""
    if "granite.logit_scale" not in meta:
        raise ModelError(f"{path}: missing metadata granite.logit_scale")
    return {
        "embed_scale": float(meta.get("granite.embedding_scale", 0.0)) or 1.0,
        "residual_scale": float(meta.get("granite.residual_scale", 0.0)),
        "attn_scale": float(meta.get("granite.attention.scale", 0.0)),
        "logit_scale": float(meta["granite.logit_scale"]),
    }
