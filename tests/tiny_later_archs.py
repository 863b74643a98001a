"""The layers and keys of the tiny models of the architectures added later (qwen3moe, gemma2), as
llama.cpp's converter writes them (gguf-py's MODEL_TENSORS), with the switches that set each apart set
so that they show: experts chosen per token, soft-capping that bites (tests/tiny_models.py writes the
rest)."""

from __future__ import annotations

import gguf

LATER_ARCHS = ("qwen3moe", "gemma2")
N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 32
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def later_metadata(w: gguf.GGUFWriter, arch: str, context_length: int) -> None:
    if arch == "qwen3moe":
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(N_FF_EXP)
    elif arch == "gemma2":  # (Gemma 2's own are 50 and 30: far above a tiny model's logits)
        w.add_attn_logit_softcapping(2.0)
        w.add_final_logit_softcapping(8.0)


def later_layers(arch: str, tensor, norm, attention, dims) -> None:
    """The layers, with tiny_models' writers: `attention(prefix)` writes a layer's norm, q, k, v and
    output as every architecture before these has them."""
    n_layer, n_embd, q_dim, kv_dim, head_dim, n_ff = dims
    for i in range(n_layer):
        p = f"blk.{i}."
        attention(p)
        if arch == "qwen3moe":
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma2":
            norm(p + "post_attention_norm.weight", n_embd)
        norm(p + "ffn_norm.weight", n_embd)
        if arch == "qwen3moe":
            tensor(p + "ffn_gate_inp.weight", (N_EXPERT, n_embd))
            tensor(p + "ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, n_embd), quant=Q8_0)
            tensor(p + "ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, n_embd))
            tensor(p + "ffn_down_exps.weight", (N_EXPERT, n_embd, N_FF_EXP), quant=Q8_0)
        else:
            tensor(p + "ffn_gate.weight", (n_ff, n_embd), quant=Q8_0)
            tensor(p + "ffn_up.weight", (n_ff, n_embd))
            tensor(p + "ffn_down.weight", (n_embd, n_ff))
            norm(p + "post_ffw_norm.weight", n_embd)
