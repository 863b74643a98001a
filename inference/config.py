"""A model's hyperparameters, with the differences between architectures as data (read by weights.py)."""

from __future__ import annotations

from dataclasses import dataclass


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
    swa_pattern: int = 0  # gemma3: in every run of this many layers, all but the last use the window
    qk_norm: bool = False  # RMSNorm over each head of q and k (qwen3, gemma3)
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before the residual (gemma3)
    embed_scale: float = 1.0  # gemma3 multiplies embeddings by sqrt(n_embd)
    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu" (GELU-tanh gated, gemma)
    attn_scale: float = 0.0  # scale of q·k; 0 means 1/sqrt(head_dim)
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and (
            self.swa_pattern == 0 or layer % self.swa_pattern < self.swa_pattern - 1
        )
