"""Which of a GGUF's tensors make each matrix the kernels multiply, by architecture, with llama.cpp's
tensor names (gguf-py's MODEL_TENSORS): q, k and v fused into one matrix, and gate and up into one
(phi3's GGUFs hold both fused already), and a mixture of experts' 3-D tensors cut into a matrix per
expert, so that the kernels take an expert as they take any matrix (experts.py)."""

from __future__ import annotations

import gguf

from . import formats, quants
from .config import ModelConfig
from .k_quants import StackedMatrix

# name → (rows, cols) or (experts, rows, cols); vectors (rows,)
Shapes = dict[str, tuple[int, ...]]
# The plan's matrices: (name, the GGUF tensors (or experts of them) stacked into it, their shapes)
Plan = list[tuple[str, list[str], list[tuple[int, int]]]]


def expert_part(name: str, expert: int) -> str:
    """A part of a matrix that is one expert's matrix of a 3-D tensor."""
    return f"{name}[{expert}]"


def tensor_of(part: str) -> tuple[str, int | None]:
    """The GGUF tensor a part is, or is one expert of: (name, expert or None)."""
    name, _, expert = part.partition("[")
    return (name, int(expert[:-1])) if expert else (name, None)


def fused_qkv(names, layer: int) -> bool:
    """Whether the GGUF holds the layer's q, k and v as one tensor (phi3; any architecture, as llama.cpp's
    create_tensor_qkv reads it)."""
    return f"blk.{layer}.attn_qkv.weight" in names


def layer_tensors(cfg: ModelConfig, layer: int, names) -> Shapes:
    """The GGUF tensors of one layer and their shapes, rows first (`names`: the GGUF's tensor names, for
    whether q/k/v are fused); optional ones are marked by the loader."""
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    d, p = cfg.n_embd, f"blk.{layer}."
    norms = {p + "attn_norm.weight": (d,), f"{p}{cfg.ffn_norm_tensor}.weight": (d,)}
    shapes: Shapes = norms if cfg.pre_norms else {}
    if fused_qkv(names, layer):
        shapes[p + "attn_qkv.weight"] = (q_dim + 2 * kv_dim, d)
    else:
        shapes |= {p + "attn_q.weight": (q_dim, d), p + "attn_k.weight": (kv_dim, d)}
        shapes[p + "attn_v.weight"] = (kv_dim, d)
    shapes[p + "attn_output.weight"] = (d, q_dim)
    if cfg.attn_sinks:
        shapes[p + "attn_sinks.weight"] = (cfg.n_head,)
    if cfg.n_expert:
        e, n_ff = cfg.n_expert, cfg.n_ff_exp
        shapes[p + "ffn_gate_inp.weight"] = (e, d)
        shapes |= {p + "ffn_gate_exps.weight": (e, n_ff, d), p + "ffn_up_exps.weight": (e, n_ff, d)}
        shapes[p + "ffn_down_exps.weight"] = (e, d, n_ff)
    elif cfg.fused_gate_up:
        shapes |= {p + "ffn_up.weight": (2 * cfg.n_ff, d), p + "ffn_down.weight": (d, cfg.n_ff)}
    else:
        shapes |= {p + "ffn_gate.weight": (cfg.n_ff, d), p + "ffn_up.weight": (cfg.n_ff, d)}
        shapes[p + "ffn_down.weight"] = (d, cfg.n_ff)
    if cfg.qk_norm:  # over each head, or over the whole projection (olmo2)
        shapes[p + "attn_q_norm.weight"] = (q_dim,) if cfg.qk_norm_whole else (cfg.head_dim,)
        shapes[p + "attn_k_norm.weight"] = (kv_dim,) if cfg.qk_norm_whole else (cfg.head_dim,)
    if cfg.post_norms:
        shapes[p + "post_attention_norm.weight"] = (d,)
        shapes[p + "post_ffw_norm.weight"] = (d,)
    return shapes


def expert_biases(cfg: ModelConfig, layer: int) -> Shapes:
    """The router's and the experts' biases of one layer (gpt-oss), rows first: one row an expert."""
    if not cfg.expert_biases:
        return {}
    e, n_ff, p = cfg.n_expert, cfg.n_ff_exp, f"blk.{layer}."
    shapes: Shapes = {p + "ffn_gate_inp.bias": (e,), p + "ffn_gate_exps.bias": (e, n_ff)}
    return shapes | {p + "ffn_up_exps.bias": (e, n_ff), p + "ffn_down_exps.bias": (e, cfg.n_embd)}


def layer_matrices(cfg: ModelConfig, layer: int, names) -> list[tuple[str, list[str]]]:
    """The matrices of one layer in the order they are packed: (name, the parts stacked into it)."""
    p = f"blk.{layer}."
    qkv = ["attn_qkv"] if fused_qkv(names, layer) else ["attn_q", "attn_k", "attn_v"]
    matrices = [(p + "attn_qkv", [f"{p}{t}.weight" for t in qkv])]
    if cfg.n_expert:
        matrices += [(p + name, [f"{p}{name}.weight"]) for name in ("attn_output", "ffn_gate_inp")]
        for e in range(cfg.n_expert):
            gate_up = [expert_part(f"{p}{t}.weight", e) for t in ("ffn_gate_exps", "ffn_up_exps")]
            matrices += [(expert_matrix(layer, e, "ffn_gate_up"), gate_up)]
            matrices += [(expert_matrix(layer, e, "ffn_down"), [expert_part(p + "ffn_down_exps.weight", e)])]
        return matrices
    gate_up = ["ffn_up"] if cfg.fused_gate_up else ["ffn_gate", "ffn_up"]
    matrices += [(p + "ffn_gate_up", [f"{p}{t}.weight" for t in gate_up])]
    return matrices + [(p + name, [f"{p}{name}.weight"]) for name in ("attn_output", "ffn_down")]


def expert_matrix(layer: int, expert: int, name: str) -> str:
    return f"blk.{layer}.experts.{expert}.{name}"


def part_shape(shapes: Shapes, part: str) -> tuple[int, ...]:
    name, expert = tensor_of(part)
    return shapes[name] if expert is None else shapes[name][1:]


def matrix_plan(cfg: ModelConfig, tensors: dict) -> Plan:
    """The matrices the kernels multiply, in the order they are packed (`tensors`: the GGUF's, name →
    an entry with its type_name)."""
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    plan = [("output", [output], [(cfg.n_vocab, cfg.n_embd)])]
    own = formats.own_bits(t.type_name for t in tensors.values())
    for i in range(cfg.n_layer):
        shapes = layer_tensors(cfg, i, tensors)
        for name, parts in layer_matrices(cfg, i, tensors):
            plan += _runs(tensors, name, parts, [part_shape(shapes, n) for n in parts], own)
    return plan


def _runs(tensors: dict, name: str, parts: list[str], shapes: list[tuple[int, int]], own: dict) -> Plan:
    """A matrix of the plan; or where a format kept in its own bits meets others (q/k in Q4_K beside a
    Q6_K v: formats.py), its runs, each packed (and kept in the packed file) on its own as name#0,
    name#1…, multiplied as one StackedMatrix."""
    types = [tensors[n].type_name if n in tensors else None for n in (tensor_of(p)[0] for p in parts)]
    if None in types or not all(t in gguf.GGMLQuantizationType.__members__ for t in types):
        return [(name, parts, shapes)]  # load_weights' check names the missing tensor or its type
    typed = [(n, gguf.GGMLQuantizationType[t], s) for n, t, s in zip(parts, types, shapes, strict=True)]
    if len(quants.kinds_of({qtype for _, qtype, _ in typed}, own)) == 1:
        return [(name, parts, shapes)]
    runs = formats.runs_of(typed, own)
    return [(f"{name}#{j}", [n for n, _, _ in run], [s for _, _, s in run]) for j, run in enumerate(runs)]


def stacked(matrices: dict, name: str) -> quants.PackedMatrix | StackedMatrix:
    """The plan's matrix `name`, whole or joined from its runs (_runs)."""
    if name in matrices:
        return matrices[name]
    runs = []
    while f"{name}#{len(runs)}" in matrices:
        runs.append(matrices[f"{name}#{len(runs)}"])
    return StackedMatrix(runs)
