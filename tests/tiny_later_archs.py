"""The layers and keys of the tiny models of the architectures added later (qwen3moe, gemma2, phi3,
granite, olmo2, smollm3), as llama.cpp's converter writes them (gguf-py's MODEL_TENSORS), with the
switches that set each apart set so that they show: experts chosen per token, soft-capping that bites,
partial RoPE with LongRoPE factors and an attention factor, a sliding window that phi3 must ignore,
granite's scales (Granite 3.3 2B's embedding and residual ones; the attention's off 1/sqrt(head_dim);
logits divided by 1.25, not its 8, so that the tiny model's replies still repeat the prompt, as the
prompt-lookup tests need), olmo2's norms after
and over whole projections; smollm3's layers without RoPE need no key; gpt-oss's biases, sinks and YaRN
stretching the low frequencies 4 times over a 64-token original context, its experts in MXFP4 where
the model is quantized (tests/tiny_models.py writes the rest)."""

from __future__ import annotations

import gguf
import numpy as np

LATER_ARCHS = ("qwen3moe", "gemma2", "phi3", "olmo2", "gpt-oss")  # (granite's and smollm3's are llama's)
N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 32
PHI3_ROPE_DIM = 12  # of 16 channels a head, as Phi-4-mini turns 96 of 128
# references of a model run past its original context (name: (architecture, context)): phi3 with the
# long LongRoPE factors, its original context being 256 of its 512
LONG_CONTEXT = {"phi3-long": ("phi3", 512)}
Q8_0, MXFP4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
YARN_FACTOR, YARN_ORIGINAL_CONTEXT = 4.0, 64
# o200k_harmony's special tokens (gpt-oss), in their order there
HARMONY_SPECIALS = (
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|call|>",
)  # fmt: skip


def later_metadata(w: gguf.GGUFWriter, arch: str, context_length: int) -> None:
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(N_FF_EXP)
    elif arch == "gemma2":  # (Gemma 2's own are 50 and 30: far above a tiny model's logits)
        w.add_attn_logit_softcapping(2.0)
        w.add_final_logit_softcapping(8.0)
    elif arch == "phi3":
        w.add_rope_dimension_count(PHI3_ROPE_DIM)
        w.add_rope_scaling_attn_factors(1.19)  # Phi-3.5-mini's: sqrt(1 + ln 32 / ln 4096)
        w.add_rope_scaling_orig_ctx_len(context_length)
    elif arch == "granite":
        w.add_embedding_scale(12.0)
        w.add_residual_scale(0.22)
        w.add_attention_scale(0.3)
        w.add_logit_scale(1.25)
    if arch == "gpt-oss":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(YARN_FACTOR)
        w.add_rope_scaling_orig_ctx_len(YARN_ORIGINAL_CONTEXT)


def later_layers(arch: str, w: gguf.GGUFWriter, rng, tensor, norm, attention, dims) -> None:
    """The layers, with tiny_models' writers: `attention(prefix)` writes a layer's norm, q, k, v and
    output as every architecture before these has them."""
    n_layer, n_embd, q_dim, kv_dim, head_dim, n_ff = dims
    if arch == "phi3":
        half = PHI3_ROPE_DIM // 2
        w.add_tensor("rope_factors_short.weight", (1.0 + rng.random(half)).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", (4.0 + 8.0 * rng.random(half)).astype(np.float32))
    if arch == "gpt-oss":
        for i in range(n_layer):
            gpt_oss_layer(f"blk.{i}.", tensor, norm, attention, dims)
        return
    for i in range(n_layer):
        p = f"blk.{i}."
        if arch == "phi3":  # q, k and v in one tensor
            norm(p + "attn_norm.weight", n_embd)
            tensor(p + "attn_qkv.weight", (q_dim + 2 * kv_dim, n_embd))
            tensor(p + "attn_output.weight", (n_embd, q_dim))
        elif arch == "olmo2":  # no norm before attention; q/k norms over the whole projections
            tensor(p + "attn_q.weight", (q_dim, n_embd))
            tensor(p + "attn_k.weight", (kv_dim, n_embd))
            tensor(p + "attn_v.weight", (kv_dim, n_embd))
            tensor(p + "attn_output.weight", (n_embd, q_dim))
            norm(p + "attn_q_norm.weight", q_dim)
            norm(p + "attn_k_norm.weight", kv_dim)
        else:
            attention(p)
        if arch == "qwen3moe":
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        if arch in ("gemma2", "olmo2"):
            norm(p + "post_attention_norm.weight", n_embd)
        if arch != "olmo2":
            norm(p + "ffn_norm.weight", n_embd)
        if arch == "qwen3moe":
            tensor(p + "ffn_gate_inp.weight", (N_EXPERT, n_embd))
            tensor(p + "ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, n_embd), quant=Q8_0)
            tensor(p + "ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, n_embd))
            tensor(p + "ffn_down_exps.weight", (N_EXPERT, n_embd, N_FF_EXP), quant=Q8_0)
        elif arch == "phi3":  # gate and up in one tensor, gate first
            tensor(p + "ffn_up.weight", (2 * n_ff, n_embd), quant=Q8_0)
            tensor(p + "ffn_down.weight", (n_embd, n_ff))
        else:
            tensor(p + "ffn_gate.weight", (n_ff, n_embd), quant=Q8_0)
            tensor(p + "ffn_up.weight", (n_ff, n_embd))
            tensor(p + "ffn_down.weight", (n_embd, n_ff))
            norm(p + "post_ffw_norm.weight", n_embd)


def gpt_oss_layer(p: str, tensor, norm, attention, dims) -> None:
    """gpt-oss's layer: biases on q, k, v and the output, a sink logit per head, post_attention_norm
    before the experts (there is no ffn_norm), a router and experts with biases."""
    _, n_embd, q_dim, kv_dim, head_dim, _ = dims
    attention(p)
    for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim), ("attn_output", n_embd)):
        tensor(f"{p}{name}.bias", (n,))
    tensor(p + "attn_sinks.weight", (q_dim // head_dim,), scale=1.0)
    norm(p + "post_attention_norm.weight", n_embd)
    tensor(p + "ffn_gate_inp.weight", (N_EXPERT, n_embd))
    tensor(p + "ffn_gate_inp.bias", (N_EXPERT,))
    shapes = {"gate": (N_FF_EXP, n_embd), "up": (N_FF_EXP, n_embd), "down": (n_embd, N_FF_EXP)}
    for name, shape in shapes.items():
        tensor(f"{p}ffn_{name}_exps.weight", (N_EXPERT, *shape), quant=MXFP4)
        tensor(f"{p}ffn_{name}_exps.bias", (N_EXPERT, shape[0]))
