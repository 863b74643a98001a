"""Tiny random GGUF models written with gguf.GGUFWriter: one per architecture, loading in milliseconds.

Each has a small working vocabulary: byte-level BPE (every byte, a few merges, ChatML specials, the
family's control tokens) for llama/qwen2/qwen3/qwen3moe/granite/olmo2/smollm3 (gpt-oss: harmony's
specials in place of ChatML's, the gpt-4o pre-tokenizer), and SentencePiece (pieces with scores, byte
fallback, the family's turn markers) for the gemmas and phi3. The weights are random but fixed by a
seed, so every test sees the same model; the architectures added later (qwen3moe, gemma2, phi3,
granite, olmo2, smollm3, gpt-oss) also carry their family's real chat template and the switches that
make them differ (experts, soft-capping, LongRoPE, scales, norms, layers without RoPE, sinks, YaRN), so
that their logits from llama.cpp (tests/fixtures/llamacpp/tiny.json) check ours.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import gguf
import numpy as np

from tiny_later_archs import HARMONY_SPECIALS, LATER_ARCHS, later_layers, later_metadata


class FixtureDay(datetime):
    """A datetime whose now() is one fixed day: a real template that writes the current date (gpt-oss's)
    renders the prompt the llama.cpp fixtures recorded, on any day (patched in as chat_template.datetime)."""

    @classmethod
    def now(cls, tz=None):
        return cls(2025, 8, 5)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gemma2", "phi3")
ARCHS += ("granite", "olmo2", "smollm3", "gpt-oss")
TEMPLATES = Path(__file__).parent / "fixtures" / "chat-templates"
# each later architecture's family template, from llama.cpp's models/templates/, and Qwen3's (its
# replies' thinking: tests/test_thinking.py)
FAMILY_TEMPLATES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3moe": "Qwen-Qwen3-0.6B.jinja",
    "gemma2": "google-gemma-2-2b-it.jinja",
    "phi3": "microsoft-Phi-3.5-mini-instruct.jinja",
    "granite": "ibm-granite-granite-4.0.jinja",  # Granite-4.0-micro: a granite (its 3.3 one writes the date)
    "olmo2": "allenai-OLMo-2-0425-1B-SFT.jinja",  # (the tokenizer_config of OLMo 2 SFT and Instruct)
    "smollm3": "HuggingFaceTB-SmolLM3-3B.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
}
# the BPE vocabularies' pre-tokenizers and control tokens as the families' GGUFs name them (ChatML's
# besides), the last of them the end of text; olmo2 begins and ends a text with <|endoftext|>
BPE_PRE = {"llama": "llama-bpe", "granite": "refact", "olmo2": "dbrx", "smollm3": "smaug-bpe"}
BPE_PRE["gpt-oss"] = "gpt-4o"
FAMILY_SPECIALS = {"granite": ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")}
SPM_ARCHS = ("gemma3", "gemma2", "phi3")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BPE_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "Ġ a",
    "i n",
    "e r",
    "o n",
    "Ġ s",
    "r e",
    "Ġ w",
    "a n",
    "Ġ h",
    "e l",
    "el l",
    "ell o",
]


def bpe_vocab():
    chars = list(bytes_to_unicode().values())
    tokens = chars + ["".join(m.split()) for m in BPE_MERGES]
    types = [1] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [3] * len(specials)
    return tokens, types, BPE_MERGES, len(tokens) - 3, len(tokens) - 1


SPM_PIECES = ["▁", "▁the", "▁a", "th", "he", "in", "er", "on", "▁hello", "▁world", "▁is", "▁it"]


# SentencePiece specials: (first tokens, their types, bos, eos, unk, added control tokens at the end)
GEMMA_SPECIALS = (
    ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], [3, 3, 3, 2, 3, 3], 2, 1, 3, []
)
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
PHI3_SPECIALS = (["<unk>", "<s>", "</s>"], [2, 3, 3], 1, 2, 0, PHI3_ADDED)


def spm_vocab(specials=GEMMA_SPECIALS):
    tokens, types = list(specials[0]), list(specials[1])
    scores = [0.0] * len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        chr(c) for c in range(ord("A"), ord("Z") + 1)
    ]
    for i, piece in enumerate(SPM_PIECES + letters + list(" .,!?\n")):
        if piece in tokens:
            continue
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    tokens += specials[5]
    types += [3] * len(specials[5])
    scores += [0.0] * len(specials[5])
    return tokens, types, scores


def write_tiny_model(
    path: Path,
    arch: str,
    seed: int = 0,
    n_layer: int | None = None,
    *,
    drop: str | None = None,
    shapes: dict | None = None,
    arch_name: str | None = None,
    raw_types: dict | None = None,
    chat_template: str | None = None,
    metadata: dict | None = None,
    specials: tuple[str, ...] = (),
    context_length: int | None = None,
    space_prefix: bool = False,
    quantized: bool = True,
    dims: tuple[int, int, int, int, int] | None = None,
    matrix_bytes=None,
    embedding_bytes=None,
) -> Path:
    """Write a tiny model; `drop`, `shapes`, `arch_name`, `raw_types` (name → GGML type, data left
    unreadable) and `chat_template` make broken or hostile variants for the error tests; `metadata`
    adds keys (an int as uint32, a float as float32); `specials` adds control tokens to a BPE vocab
    (a real template's markers, e.g. Llama 3's), the last of them its end of text; `context_length`:
    room for a real template's long prompts; `space_prefix`: a SentencePiece vocabulary (gemma3)
    that puts a space before the text, as Llama 2's does. `chat_template`: ChatML, or the family's
    real one for the later architectures. `quantized=False`: every matrix in float32 (the models
    checked against llama.cpp's float32 logits). `dims`: (n_embd, n_head, n_head_kv, head_dim, n_ff)
    for wider models; `matrix_bytes(name, data)` → (array, GGML type): each layer matrix (and 3-D expert
    tensor) and the output written in another format (test_formats.py); `embedding_bytes` the same for
    the token embeddings (tiny_formats.py)."""
    # gpt-oss draws from seed + 1: from seed 0 its greedy reply to test_generate's prompt ends after 9
    # tokens, before prompt lookup has a run to guess
    rng = np.random.default_rng(seed + (arch == "gpt-oss"))
    # (SmolLM3's system prompt is long, gpt-oss's 300 tokens of the tiny vocabulary)
    context_length = context_length or {"smollm3": 2048, "gpt-oss": 1024}.get(arch, 256)
    shapes, raw_types = shapes or {}, raw_types or {}
    n_embd, n_head, n_head_kv, head_dim, n_ff = dims or (64, 4, 2, 16, 96)
    # (smollm3: layer 3 has no RoPE)
    n_layer = n_layer or {"gemma3": 6, "gemma2": 4, "smollm3": 4}.get(arch, 2)
    if chat_template is None:
        family = FAMILY_TEMPLATES.get(arch)
        chat_template = (TEMPLATES / family).read_text() if family else CHATML
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(context_length * (2 if arch == "phi3" else 1))  # phi3: LongRoPE's longer one
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    later_metadata(w, arch, context_length)
    for key, value in (metadata or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    if arch in ("gemma3", "gemma2", "phi3", "gpt-oss"):
        w.add_sliding_window(8)  # (phi3's is read by no one: llama.cpp turns it off)
    if arch in SPM_ARCHS:
        vocab = PHI3_SPECIALS if arch == "phi3" else GEMMA_SPECIALS
        tokens, types, scores = spm_vocab(vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(vocab[2])
        w.add_eos_token_id(tokens.index("<|endoftext|>") if arch == "phi3" else vocab[3])
        w.add_unk_token_id(vocab[4])
        w.add_add_bos_token(arch != "phi3")  # (Phi-3.5's GGUF adds none: its template writes no <s>)
        w.add_add_space_prefix(space_prefix or arch == "phi3")
        if arch != "gemma3":
            w.add_chat_template(chat_template)
    else:
        tokens, types, merges, bos, eos = bpe_vocab()
        specials = specials or FAMILY_SPECIALS.get(arch, ())
        if specials:
            tokens, types, eos = (
                tokens + list(specials),
                types + [3] * len(specials),
                len(tokens) + len(specials) - 1,
            )
        if arch == "olmo2":
            eos = bos
        if arch in ("qwen3moe", "smollm3"):  # the thinking markers: user-defined tokens, matched in any text
            tokens, types = tokens + ["<think>", "</think>"], types + [4, 4]
        if arch == "gpt-oss":  # o200k_harmony's specials in place of ChatML's
            tokens, types = tokens[:-3] + list(HARMONY_SPECIALS), types[:-3] + [3] * len(HARMONY_SPECIALS)
            bos, eos = tokens.index("<|startoftext|>"), tokens.index("<|return|>")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(BPE_PRE.get(arch, "qwen2"))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_add_bos_token(arch == "llama")
        w.add_chat_template(chat_template)
    n_vocab = len(tokens)

    def tensor(name, shape, scale=0.2, quant=None):
        shape = shapes.get(name, shape)
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == drop:
            return
        if name in raw_types:
            block, size = gguf.GGML_QUANT_SIZES[raw_types[name]]
            raw = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=raw_types[name])
        elif matrix_bytes is not None and len(shape) > 1 and name != "token_embd.weight":
            raw, qtype = matrix_bytes(name, data)
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif embedding_bytes is not None and name == "token_embd.weight":
            raw, qtype = embedding_bytes(name, data)
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif quant is not None and quantized:
            w.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, data)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    tensor("token_embd.weight", (n_vocab, n_embd), 0.5, gguf.GGMLQuantizationType.Q8_0)
    norm("output_norm.weight", n_embd)
    if arch not in ("gemma3", "gemma2"):  # the gemmas tie the output to the embeddings
        tensor("output.weight", (n_vocab, n_embd))
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim

    def attention(p):
        norm(p + "attn_norm.weight", n_embd)
        tensor(p + "attn_q.weight", (q_dim, n_embd))
        tensor(p + "attn_k.weight", (kv_dim, n_embd))
        tensor(p + "attn_v.weight", (kv_dim, n_embd))
        tensor(p + "attn_output.weight", (n_embd, q_dim))

    if arch in LATER_ARCHS:
        later_layers(arch, w, rng, tensor, norm, attention, (n_layer, n_embd, q_dim, kv_dim, head_dim, n_ff))
    else:
        for i in range(n_layer):
            p = f"blk.{i}."
            attention(p)
            if arch == "qwen2":
                tensor(p + "attn_q.bias", (q_dim,))
                tensor(p + "attn_k.bias", (kv_dim,))
                tensor(p + "attn_v.bias", (kv_dim,))
            if arch in ("qwen3", "gemma3"):
                norm(p + "attn_q_norm.weight", head_dim)
                norm(p + "attn_k_norm.weight", head_dim)
            if arch == "gemma3":
                norm(p + "post_attention_norm.weight", n_embd)
                norm(p + "post_ffw_norm.weight", n_embd)
            norm(p + "ffn_norm.weight", n_embd)
            tensor(p + "ffn_gate.weight", (n_ff, n_embd), quant=gguf.GGMLQuantizationType.Q8_0)
            tensor(p + "ffn_up.weight", (n_ff, n_embd))
            tensor(p + "ffn_down.weight", (n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
