"""Write a GGUF with a real model's published shapes and llama.cpp's Q4_K_M tensor types, random weights.

    python benchmarks/synthetic_model.py qwen2-7b [--layers N] [--out FILE] [--tokenizer-from NAME|PATH]
        [--check]

For timing and memory at real sizes without downloading gigabytes: the bytes per token that decode
reads, the matrix shapes prefill multiplies and the file's size are those of the real Q4_K_M file
(qwen2-7b: 4.68 GB). The weights are random but valid blocks (no float is quantized, so writing takes
seconds): Q4_K with its d/dmin as f16 and random nibbles and 6-bit scales, Q6_K with random 6-bit
values and int8 scales, each tensor's d set so that its weights have a trained model's spread (std
0.02), which keeps activations finite through every layer. The replies are noise; the speed is real.

The tokenizer (and so the vocabulary size) is copied from another GGUF, the default model's unless
--tokenizer-from says otherwise: llama-3.1-8b then has Qwen's 151,936 tokens instead of its 128,256
(its embedding and output 18 % larger: 5.05 GB instead of 4.92). The file goes to
~/.cache/llama-chat-bench/ unless --out says where; one already there is kept. --check loads it with
llama-chat and checks that a few tokens give finite logits. --layers N keeps the first N layers of the
real model's (each layer as the real one, the quantization's choice of Q6_K layers made for N): a
mixture of experts too large for the machine (qwen3-30b-a3b: 17.7 GB) then fits both engines' files
and RAM, and the time a token takes per layer stays the real model's.

gpt-oss-20b is written as ggml-org's gpt-oss-20b-mxfp4.gguf lays it out, not as Q4_K_M: its experts
in MXFP4 (random 4-bit values, each block's power-of-two scale giving the same spread), the other
matrices in Q8_0 (its width, 2880, is no multiple of Q4_K's 256 weights a block), norms, biases and
sinks in float32; the file is named -mxfp4.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

Q4_K, Q6_K, Q8_0, MXFP4, F32 = (
    gguf.GGMLQuantizationType.Q4_K,
    gguf.GGMLQuantizationType.Q6_K,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.MXFP4,
    gguf.GGMLQuantizationType.F32,
)
# llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M and LLAMA_FTYPE_MOSTLY_MXFP4_MOE, by the file names' suffix
FILE_TYPES = {"q4_k_m": 15, "mxfp4": 38}
WEIGHT_STD = 0.02  # the spread of a trained transformer's weights (and of their initialisation)


@dataclass(frozen=True)
class Shape:
    """A model's published hyperparameters (the GGUF keys llama.cpp reads for its architecture)."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    n_ctx_train: int = 32768
    qkv_bias: bool = False  # qwen2 has biases on q, k and v
    llama3_rope: bool = False  # llama 3.1's long-context RoPE frequency factors (rope_freqs.weight)
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k
    n_expert: int = 0  # a mixture of experts in every layer (qwen3moe), of this many
    n_expert_used: int = 0
    n_ff_exp: int = 0  # each expert's FFN width
    sliding_window: int = 0  # gpt-oss: a window of this many positions on the even layers
    yarn: tuple[float, int] | None = None  # gpt-oss: YaRN's (factor, original context)

    @property
    def layout(self) -> str:
        """How its tensors are quantized, as the file's name says: "mxfp4" for gpt-oss, else "q4_k_m"."""
        return "mxfp4" if self.arch == "gpt-oss" else "q4_k_m"


SHAPES = {
    # Qwen2-7B / Qwen2.5-7B (config.json): 28 layers, 3584 wide, FFN 18944, 28 heads, 4 KV heads.
    "qwen2-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, rope_base=1e6, norm_eps=1e-6, qkv_bias=True),
    # Llama-3.1-8B: 32 layers, 4096 wide, FFN 14336, 32 heads, 8 KV heads, RoPE base 500000.
    "llama-3.1-8b": Shape(
        "llama", 32, 4096, 14336, 32, 8, rope_base=5e5, norm_eps=1e-5, n_ctx_train=131072, llama3_rope=True
    ),
    # Qwen3-30B-A3B (config.json): 48 layers, 2048 wide, 32 heads of 128, 4 KV heads, 128 experts of
    # FFN 768, 8 a token, RoPE base 1e6.
    "qwen3-30b-a3b": Shape(
        "qwen3moe", 48, 2048, 6144, 32, 4, rope_base=1e6, n_ctx_train=40960, qk_norm=True,
        n_expert=128, n_expert_used=8, n_ff_exp=768,
    ),
    # gpt-oss-20b (config.json): 24 layers, 2880 wide, 64 heads of 64, 8 KV heads, 32 experts of FFN
    # 2880, 4 a token, RoPE base 150000 with YaRN (factor 32 over 4096), a 128-token window.
    "gpt-oss-20b": Shape(
        "gpt-oss", 24, 2880, 2880, 64, 8, head_dim=64, rope_base=150000.0, norm_eps=1e-5, n_ctx_train=131072,
        qkv_bias=True, n_expert=32, n_expert_used=4, n_ff_exp=2880, sliding_window=128, yarn=(32.0, 4096),
    ),
}


def more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers whose attn_v and ffn_down Q4_K_M keeps
    in Q6_K — the first and last eighth, and every third one between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_plan(shape: Shape, n_vocab: int) -> list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...]]]:
    """(name, type, numpy shape [rows, columns]) of every tensor, as llama.cpp's Q4_K_M writes them."""
    q_dim, kv_dim = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    if shape.arch == "gpt-oss":
        return gpt_oss_plan(shape, n_vocab)
    plan = [
        ("token_embd.weight", Q4_K, (n_vocab, shape.n_embd)),
        ("output_norm.weight", F32, (shape.n_embd,)),
        ("output.weight", Q6_K, (n_vocab, shape.n_embd)),
    ]
    if shape.llama3_rope:
        plan.append(("rope_freqs.weight", F32, (shape.head_dim // 2,)))
    for i in range(shape.n_layer):
        p, wide = f"blk.{i}.", Q6_K if more_bits(i, shape.n_layer) else Q4_K
        plan += [
            (p + "attn_norm.weight", F32, (shape.n_embd,)),
            (p + "attn_q.weight", Q4_K, (q_dim, shape.n_embd)),
            (p + "attn_k.weight", Q4_K, (kv_dim, shape.n_embd)),
            (p + "attn_v.weight", wide, (kv_dim, shape.n_embd)),
            (p + "attn_output.weight", Q4_K, (shape.n_embd, q_dim)),
        ]
        if shape.qkv_bias:
            plan += [
                (p + "attn_q.bias", F32, (q_dim,)),
                (p + "attn_k.bias", F32, (kv_dim,)),
                (p + "attn_v.bias", F32, (kv_dim,)),
            ]
        if shape.qk_norm:
            plan += [(f"{p}{name}.weight", F32, (shape.head_dim,)) for name in ("attn_q_norm", "attn_k_norm")]
        plan.append((p + "ffn_norm.weight", F32, (shape.n_embd,)))
        plan += expert_tensors(shape, p, wide) if shape.n_expert else [
            (p + "ffn_gate.weight", Q4_K, (shape.n_ff, shape.n_embd)),
            (p + "ffn_up.weight", Q4_K, (shape.n_ff, shape.n_embd)),
            (p + "ffn_down.weight", wide, (shape.n_embd, shape.n_ff)),
        ]
    return plan


def expert_tensors(shape: Shape, p: str, wide) -> list:
    """A mixture of experts' layer as Q4_K_M writes it: the router in float32, the experts' 3-D tensors
    (ffn_down_exps in Q6_K on the layers of more_bits, as llama.cpp matches it by name)."""
    e, n_ff, d = shape.n_expert, shape.n_ff_exp, shape.n_embd
    return [
        (p + "ffn_gate_inp.weight", F32, (e, d)),
        (p + "ffn_gate_exps.weight", Q4_K, (e, n_ff, d)),
        (p + "ffn_up_exps.weight", Q4_K, (e, n_ff, d)),
        (p + "ffn_down_exps.weight", wide, (e, d, n_ff)),
    ]


def gpt_oss_plan(shape: Shape, n_vocab: int) -> list:
    """gpt-oss as ggml-org's MXFP4 GGUF holds it: experts in MXFP4, the other matrices in Q8_0, biases on
    q, k, v, the output, the router and the experts, a sink per head, post_attention_norm before the
    experts."""
    d, q_dim, kv_dim = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    e, n_ff = shape.n_expert, shape.n_ff_exp
    plan = [("token_embd.weight", Q8_0, (n_vocab, d)), ("output_norm.weight", F32, (d,))]
    plan.append(("output.weight", Q8_0, (n_vocab, d)))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", F32, (d,)))
        attention = {"attn_q": (q_dim, d), "attn_k": (kv_dim, d), "attn_v": (kv_dim, d)}
        attention["attn_output"] = (d, q_dim)
        for name, (rows, cols) in attention.items():
            plan += [(f"{p}{name}.weight", Q8_0, (rows, cols)), (f"{p}{name}.bias", F32, (rows,))]
        plan += [(p + "attn_sinks.weight", F32, (shape.n_head,))]
        plan += [(p + "post_attention_norm.weight", F32, (d,))]
        plan += [(p + "ffn_gate_inp.weight", F32, (e, d)), (p + "ffn_gate_inp.bias", F32, (e,))]
        experts = {"ffn_gate_exps": (n_ff, d), "ffn_up_exps": (n_ff, d), "ffn_down_exps": (d, n_ff)}
        for name, (rows, cols) in experts.items():
            plan += [(f"{p}{name}.weight", MXFP4, (e, rows, cols)), (f"{p}{name}.bias", F32, (e, rows))]
    return plan


def f16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q4_K blocks (ggml's block_q4_K: d, dmin as f16, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) whose weights d·sc·q − dmin·m are centred: every sub-block's min equals its scale and
    dmin = 7.5·d, so a weight is d·sc·(q − 7.5) with q a random nibble and sc a random 6-bit scale."""
    blocks = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    scales = blocks[:, 4:16]
    scales[:, 4:8] = scales[:, 0:4]  # sub-blocks 0-3: the min's 6 bits are the scale's
    scales[:, 8:12] = (scales[:, 8:12] & 0x0F) * 0x11  # 4-7: low nibble (scale) = high nibble (min)
    # E[sc²] = 1333.5 for sc uniform in 0..63 and E[(q − 7.5)²] = 21.25 for q uniform in 0..15.
    d = WEIGHT_STD / math.sqrt(1333.5 * 21.25)
    blocks[:, 0:2] = f16_bytes(d)
    blocks[:, 2:4] = f16_bytes(7.5 * d)
    return blocks


def q6_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q6_K blocks (ggml's block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    d as f16): a weight is d·sc·(q − 32) with q a random 6-bit value and sc a random int8."""
    blocks = rng.integers(0, 256, (n_blocks, 210), dtype=np.uint8)
    # E[sc²] = 5461.5 for sc uniform in −128..127 and E[(q − 32)²] = 341.5 for q uniform in 0..63.
    blocks[:, 208:210] = f16_bytes(WEIGHT_STD / math.sqrt(5461.5 * 341.5))
    return blocks


def q8_0_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Q8_0 blocks (ggml's block_q8_0: d as f16, 32 int8): a weight is d·q with q a random int8."""
    blocks = rng.integers(0, 256, (n_blocks, 34), dtype=np.uint8)
    blocks[:, 0:2] = f16_bytes(WEIGHT_STD / math.sqrt(5461.5))  # E[q²] = 5461.5 for q in −128..127
    return blocks


def mxfp4_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """MXFP4 blocks (ggml's block_mxfp4: an e8m0 exponent, 16 bytes of e2m1 nibbles): a weight is
    2^(e − 128)·k, k a random one of ggml's doubled e2m1 values, whose E[k²] is 34.25; e = 120 gives
    std 0.023."""
    blocks = rng.integers(0, 256, (n_blocks, 17), dtype=np.uint8)
    blocks[:, 0] = 120
    return blocks


QUANT_BLOCKS = {Q4_K: q4_k_blocks, Q6_K: q6_k_blocks, Q8_0: q8_0_blocks, MXFP4: mxfp4_blocks}


def tensor_data(
    rng: np.random.Generator, name: str, kind, shape: tuple[int, ...], head_dim: int, rope_base: float
):
    """The tensor's bytes: [rows, bytes per row] for quantized types, float32 values for F32 ones."""
    if kind == F32:
        if name == "rope_freqs.weight":
            return llama3_rope_factors(head_dim, rope_base)
        if name.endswith(".bias"):
            return rng.normal(0.0, 0.1, shape).astype(np.float32)
        if name.endswith("ffn_gate_inp.weight"):  # a router
            return rng.normal(0.0, WEIGHT_STD, shape).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # a norm's weight
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = QUANT_BLOCKS[kind](rng, math.prod(shape) // block)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def llama3_rope_factors(head_dim: int, base: float) -> np.ndarray:
    """Llama 3.1's RoPE frequency factors (factor 8, low 1, high 4, original context 8192), computed
    as llama.cpp's convert_hf_to_gguf.py does."""
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Every tokenizer.* key of `source` (vocabulary, merges, special ids, chat template); returns the
    vocabulary size."""
    reader = gguf.GGUFReader(source)
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(field.data)
    return n_vocab


def write_synthetic(path: Path, name: str, shape: Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the model tensor by tensor (only one tensor's bytes in memory at a time)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(partial), shape.arch)
    w.add_name(f"synthetic {name} {shape.layout.upper()} (random weights)")
    w.add_file_type(FILE_TYPES[shape.layout])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    if shape.arch == "llama":
        w.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim != shape.n_embd // shape.n_head:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn[0])
        w.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    n_vocab = copy_tokenizer(w, tokenizer_from)
    plan = tensor_plan(shape, n_vocab)
    for tensor_name, kind, dims in plan:
        if kind == F32:
            w.add_tensor_info(tensor_name, dims, np.dtype(np.float32), 4 * math.prod(dims))
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            byte_shape = (*dims[:-1], dims[-1] // block * size)
            w.add_tensor_info(
                tensor_name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=kind
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (tensor_name, kind, dims) in enumerate(plan, 1):
        w.write_tensor_data(tensor_data(rng, tensor_name, kind, dims, shape.head_dim, shape.rope_base))
        if "ffn_down" in tensor_name or i == len(plan):
            print(f"\r{name}: {i}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
    w.close()
    print(file=sys.stderr)
    partial.replace(path)
    return path


def check_finite(path: Path, n_tokens: int = 4) -> np.ndarray:
    """Logits of the first few tokens of a sample text, with llama-chat; raises if any is not finite."""
    from llama_chat.app.bench.samples import sample_tokens
    from llama_chat.inference import load_model

    model = load_model(path)
    logits = model.logits(sample_tokens(model.tokenizer, n_tokens))
    if not np.isfinite(logits).all():
        raise SystemExit(f"{path}: logits not finite")
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="the first N layers only (default: all the real model's)")
    parser.add_argument("--out", type=Path, help="the GGUF to write (default: in ~/.cache/llama-chat-bench/)")
    parser.add_argument(
        "--tokenizer-from", default=None, help="a model name or GGUF path (default: the default model)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="write it again even if it is there")
    parser.add_argument(
        "--check", action="store_true", help="load it with llama-chat: finite logits for 4 tokens"
    )
    args = parser.parse_args()
    from llama_chat.inference import resolve_model

    shape, name = SHAPES[args.model], args.model
    if args.layers:
        shape, name = replace(shape, n_layer=args.layers), f"{args.model}-{args.layers}layers"
    path = args.out or Path.home() / ".cache" / "llama-chat-bench" / f"synthetic-{name}-{shape.layout}.gguf"
    if args.force or not path.exists():
        write_synthetic(path, name, shape, resolve_model(args.tokenizer_from), args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB", file=sys.stderr)
    if args.check:
        logits = check_finite(path)
        print(
            f"logits finite: {logits.shape}, std {logits.std():.2f}, max |x| {np.abs(logits).max():.2f}",
            file=sys.stderr,
        )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
