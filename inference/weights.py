"""GGUF file → hyperparameters and float32 weights, prepared once and cached for fast later starts.

Reading a GGUF's metadata with gguf.GGUFReader costs seconds for a 150k-token vocabulary, and
dequantizing every tensor costs more, so the first load writes what it computed (metadata as JSON,
fused float32 weights as .npy) into `$XDG_CACHE_HOME/llama-chat/prepared/<key>/`, keyed by the file's
path, size and mtime. Later loads memory-map those arrays and start in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from .catalog import cache_dir
from .errors import ModelError
from .gguf_file import open_gguf, read_metadata, read_tensors

PREPARED_FORMAT = 1
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Config:
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


@dataclass
class Prepared:
    """Everything a model needs from its GGUF file, independent of how it was obtained."""

    path: Path
    metadata: dict
    config: Config
    tensor_types: dict[str, list]  # name → [type name, shape] of the GGUF's tensors (for the fingerprint)
    weights: dict[str, np.ndarray] = field(repr=False)  # fused float32 weights, often memory-mapped

    @property
    def fingerprint(self) -> str:
        """Stable hash of architecture, hyperparameters and tensor names/types/shapes: what KV depends on."""
        blob = json.dumps([asdict(self.config), sorted(self.tensor_types.items())], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_config(meta: dict, path: Path) -> Config:
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
    head_dim = int(get("attention.key_length", n_embd // n_head))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    common = dict(
        arch=arch,
        n_layer=int(get("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(get("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(get("feed_forward_length")),
        n_vocab=int(meta.get(f"{arch}.vocab_size", len(tokens))),
        n_ctx_train=int(get("context_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_neox=arch != "llama",
        final_logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0)),
        attn_logit_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", 0.0)),
    )
    if arch == "qwen3":
        common.update(qk_norm=True)
    if arch == "gemma3":
        # llama.cpp hard-codes these for gemma3 (llama-model.cpp): every 6th layer is global, the
        # others use a 10k RoPE base, and q is scaled by 1/sqrt(head_dim) except on the 27B model.
        scale = 1.0 / np.sqrt(n_embd / n_head) if int(get("block_count")) == 62 else 1.0 / np.sqrt(head_dim)
        common.update(
            sliding_window=int(get("attention.sliding_window")),
            swa_pattern=6,
            rope_base_swa=10000.0,
            qk_norm=True,
            post_norms=True,
            embed_scale=float(np.sqrt(n_embd)),
            ffn_act="gelu",
            attn_scale=float(scale),
        )
    return Config(**common)


def expected_shapes(cfg: Config, layer: int) -> dict[str, tuple[int, ...]]:
    """The GGUF tensors of one layer and their (rows, cols) shapes; optional ones are marked by the loader."""
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    p = f"blk.{layer}."
    shapes = {
        p + "attn_norm.weight": (cfg.n_embd,),
        p + "attn_q.weight": (q_dim, cfg.n_embd),
        p + "attn_k.weight": (kv_dim, cfg.n_embd),
        p + "attn_v.weight": (kv_dim, cfg.n_embd),
        p + "attn_output.weight": (cfg.n_embd, q_dim),
        p + "ffn_norm.weight": (cfg.n_embd,),
        p + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd),
        p + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
        p + "ffn_down.weight": (cfg.n_embd, cfg.n_ff),
    }
    if cfg.qk_norm:
        shapes[p + "attn_q_norm.weight"] = (cfg.head_dim,)
        shapes[p + "attn_k_norm.weight"] = (cfg.head_dim,)
    if cfg.post_norms:
        shapes[p + "post_attention_norm.weight"] = (cfg.n_embd,)
        shapes[p + "post_ffw_norm.weight"] = (cfg.n_embd,)
    return shapes


OPTIONAL_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def prepare(path: Path, progress: Progress | None = None, use_cache: bool = True) -> Prepared:
    """Load a GGUF's metadata and weights, from the prepared cache when it is there."""
    path = Path(path)
    target = _prepared_dir(path) if use_cache else None
    if target is not None and (target / "complete").exists():
        try:
            return _load_prepared(path, target)
        except (OSError, ValueError, KeyError):
            shutil.rmtree(target, ignore_errors=True)  # a damaged cache entry is rebuilt from the GGUF
    prepared = _prepare_from_gguf(path, progress)
    if target is not None:
        _save_prepared(prepared, target)
    return prepared


def _prepare_from_gguf(path: Path, progress: Progress | None) -> Prepared:
    if progress:
        progress(f"reading {path.name}", 0, 1)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    cfg = read_config(meta, path)
    tensors = read_tensors(reader)

    def need(name: str, shape: tuple[int, ...]):
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"{path}: missing tensor {name}")
        if t.shape != shape:
            raise ModelError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def dequantize(t) -> np.ndarray:
        try:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            return np.ascontiguousarray(gguf.quants.dequantize(t.data, qtype), dtype=np.float32).reshape(
                t.shape
            )
        except (NotImplementedError, KeyError, ValueError) as e:
            raise ModelError(
                f"{path}: tensor {t.name} has unsupported quantization type {t.type_name} ({e})"
            ) from None

    weights: dict[str, np.ndarray] = {}
    total = cfg.n_layer + 2
    emb = need("token_embd.weight", (cfg.n_vocab, cfg.n_embd))
    weights["token_embd"] = dequantize(emb)
    if "output.weight" in tensors:
        weights["output"] = dequantize(need("output.weight", (cfg.n_vocab, cfg.n_embd)))
    weights["output_norm"] = dequantize(need("output_norm.weight", (cfg.n_embd,)))
    if "rope_freqs.weight" in tensors:
        weights["rope_freqs"] = dequantize(need("rope_freqs.weight", (cfg.head_dim // 2,)))
    if progress:
        progress(f"dequantizing {path.name}", 1, total)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        w = {name[len(p) :]: dequantize(need(name, shape)) for name, shape in expected_shapes(cfg, i).items()}
        # Fused matrices: one GEMM for q/k/v and one for gate/up instead of three and two.
        weights[p + "attn_qkv"] = np.concatenate(
            [w.pop("attn_q.weight"), w.pop("attn_k.weight"), w.pop("attn_v.weight")]
        )
        weights[p + "ffn_gate_up"] = np.concatenate([w.pop("ffn_gate.weight"), w.pop("ffn_up.weight")])
        biases = [p + b for b in OPTIONAL_BIASES]
        if any(b in tensors for b in biases):
            q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            dims = (q_dim, kv_dim, kv_dim)
            weights[p + "attn_qkv_bias"] = np.concatenate(
                [dequantize(need(b, (d,))) for b, d in zip(biases, dims)]
            )
        for name, value in w.items():
            weights[p + name.removesuffix(".weight")] = value
        if progress:
            progress(f"dequantizing {path.name}", i + 2, total)
    tensor_types = {t.name: [t.type_name, list(t.shape)] for t in tensors.values()}
    return Prepared(path, meta, cfg, tensor_types, weights)


def _prepared_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{PREPARED_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return cache_dir() / "prepared" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save_prepared(prepared: Prepared, target: Path) -> None:
    """Write the cache entry into a temporary folder and rename it, so a crash leaves no half entry."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        info = {
            "config": asdict(prepared.config),
            "tensor_types": prepared.tensor_types,
            "weights": sorted(prepared.weights),
        }
        (tmp / "metadata.json").write_text(json.dumps(prepared.metadata, ensure_ascii=False))
        (tmp / "info.json").write_text(json.dumps(info))
        for name, array in prepared.weights.items():
            np.save(tmp / f"{name}.npy", array)
        (tmp / "complete").write_text("ok")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # no cache is only slower, never wrong


def _load_prepared(path: Path, target: Path) -> Prepared:
    info = json.loads((target / "info.json").read_text())
    meta = json.loads((target / "metadata.json").read_text())
    # plain ndarray views of the mapped files: np.memmap's subclass hooks cost on every slice, per token
    weights = {name: np.asarray(np.load(target / f"{name}.npy", mmap_mode="r")) for name in info["weights"]}
    return Prepared(path, meta, Config(**info["config"]), info["tensor_types"], weights)
