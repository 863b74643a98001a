"""GGUF file → hyperparameters and weights as the kernels read them, still quantized as the GGUF has them.

Reading a GGUF's metadata with gguf.GGUFReader costs seconds for a 150k-token vocabulary, so the first
load writes it, with the table of tensors (type, shape, where the bytes lie), as JSON into
`$XDG_CACHE_HOME/llama-chat/prepared/<key>/` (keyed by the file's path, size and mtime; a few MB).
Weights are read from the GGUF itself at every load and packed for the kernels (quants.py) in well
under a second: no copy of them is kept on disk.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from . import kernels, quants
from .catalog import cache_dir
from .config import ModelConfig
from .errors import ModelError
from .forward import LayerWeights, Weights
from .gguf_file import open_gguf, read_metadata, read_tensors

# The GGUF's matrices that the forward pass multiplies as one (one kernel call for q/k/v, one for gate/up).
FUSED = {
    "attn_q": "attn_qkv",
    "attn_k": "attn_qkv",
    "attn_v": "attn_qkv",
    "ffn_gate": "ffn_gate_up",
    "ffn_up": "ffn_gate_up",
}
PREPARED_FORMAT = 2  # format 1 held 2.4 GB of float32 weights per model: removed when seen
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's bytes lie in the GGUF file."""

    type_name: str
    shape: tuple[int, ...]  # rows first
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class Prepared:
    """Everything a model needs from its GGUF file, independent of how it was obtained."""

    path: Path
    metadata: dict
    config: ModelConfig
    tensor_types: dict[str, list]  # name → [type name, shape] of the GGUF's tensors (for the fingerprint)
    tensors: dict[str, TensorEntry] = field(repr=False)
    weights: Weights | None = field(default=None, repr=False)  # filled by load_weights

    @property
    def matrix_formats(self) -> list[tuple[gguf.GGMLQuantizationType, ...]]:
        """The GGUF types of each matrix the kernels multiply (q/k/v and gate/up each one matrix of
        their parts' types): what the kernels must be compiled for."""
        matrices: dict[str, set] = {}
        for name, t in self.tensors.items():
            if len(t.shape) == 2:
                prefix, _, part = name.removesuffix(".weight").rpartition(".")
                matrices.setdefault(f"{prefix}.{FUSED.get(part, part)}", set()).add(t.type_name)
        return sorted({tuple(gguf.GGMLQuantizationType[n] for n in sorted(names)) for names in matrices.values()})

    @property
    def fingerprint(self) -> str:
        """Stable hash of architecture, hyperparameters and tensor names/types/shapes: what KV depends on."""
        blob = json.dumps([asdict(self.config), sorted(self.tensor_types.items())], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_config(meta: dict, path: Path) -> ModelConfig:
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
    return ModelConfig(**common)


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
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


class TokenEmbeddings:
    """The embedding table, dequantized one row at a time as tokens need it: read from the GGUF through a
    memory map (only the rows used are ever paged in), or from the packed output matrix it is tied to."""

    def __init__(self, raw: np.ndarray | None, type_name: str = "F32", tied=None):
        self.raw, self.qtype, self.tied = raw, gguf.GGMLQuantizationType[type_name], tied

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), n_embd]"""
        if self.tied is not None:
            return kernels.rows(self.tied, ids)
        return np.asarray(gguf.quants.dequantize(self.raw[ids], self.qtype), dtype=np.float32)


def model_info(path: Path, progress: Progress | None = None, use_cache: bool = True) -> Prepared:
    """A GGUF's metadata, hyperparameters and tensor table, without its weights (from the cache if there)."""
    path = Path(path)
    target = _prepared_dir(path) if use_cache else None
    if target is not None:
        _remove_old_entries(target.parent)
        if (target / "complete").exists():
            try:
                return _load_prepared(path, target)
            except (OSError, ValueError, KeyError, TypeError):
                shutil.rmtree(target, ignore_errors=True)  # a damaged cache entry is rebuilt from the GGUF
    info = _read_gguf(path, progress)
    if target is not None:
        _save_prepared(info, target)
    return info


def prepare(path: Path, progress: Progress | None = None, use_cache: bool = True) -> Prepared:
    """Metadata and weights: everything a Model needs."""
    info = model_info(path, progress, use_cache)
    info.weights = load_weights(info, progress)
    return info


def _read_gguf(path: Path, progress: Progress | None) -> Prepared:
    if progress:
        progress(f"reading {path.name}", 0, 1)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    cfg = read_config(meta, path)
    tensors = read_tensors(reader)
    entries = {
        t.name: TensorEntry(t.type_name, t.shape, int(r.data_offset), int(r.n_bytes))
        for t, r in zip(tensors.values(), reader.tensors, strict=True)
    }
    tensor_types = {t.name: [t.type_name, list(t.shape)] for t in tensors.values()}
    if progress:
        progress(f"reading {path.name}", 1, 1)
    return Prepared(path, meta, cfg, tensor_types, entries)


def load_weights(info: Prepared, progress: Progress | None = None) -> Weights:
    """Read the weights from the GGUF and pack them for the kernels: matrices stay in their integer
    formats (Q4_K in its own bits, the others int8 with their scales), small tensors (norms, biases)
    become float32, the embedding table stays in the file. Fused matrices (FUSED): one kernel call for
    q/k/v and one for gate/up."""
    path, cfg = info.path, info.config
    quants.compile_kernels(progress, info.matrix_formats)

    def need(name: str, shape: tuple[int, ...]) -> TensorEntry:
        t = info.tensors.get(name)
        if t is None:
            raise ModelError(f"{path}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ModelError(f"{path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def qtype(name: str, t: TensorEntry) -> gguf.GGMLQuantizationType:
        try:
            qt = gguf.GGMLQuantizationType[t.type_name]
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qt][1]), np.uint8), qt)  # one block
            return qt
        except (NotImplementedError, KeyError, ValueError) as e:
            raise ModelError(
                f"{path}: tensor {name} has unsupported quantization type {t.type_name} ({e})"
            ) from None

    with open(path, "rb") as f:
        # Read through a memory map: the kernels unpack straight from the page cache, with no copy
        # of the file's bytes in between (np.fromfile took a tenth of a warm load). Copy-on-write
        # keeps the arrays writable (the kernels' compiled signatures) without any write reaching
        # the file; the pages of each tensor leave this process once it is packed (peak RSS).
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

        def raw(name: str, shape: tuple[int, ...]) -> np.ndarray:
            t = need(name, shape)
            if t.offset + t.nbytes > len(mapped):
                raise ModelError(f"{path}: truncated GGUF file (tensor {name} is cut short)")
            data = np.frombuffer(mapped, dtype=np.uint8, count=t.nbytes, offset=t.offset)
            return data.reshape(shape[0] if len(shape) > 1 else 1, -1)

        def release(*names: str) -> None:
            for name in names:
                t = info.tensors[name]
                start = t.offset - t.offset % mmap.PAGESIZE
                mapped.madvise(mmap.MADV_DONTNEED, start, t.offset + t.nbytes - start)

        def vector(name: str, shape: tuple[int, ...]) -> np.ndarray:
            t = need(name, shape)
            return np.ascontiguousarray(
                gguf.quants.dequantize(raw(name, shape), qtype(name, t)), dtype=np.float32
            ).reshape(shape)

        def matrix(*names: str, shapes: list[tuple[int, int]]) -> quants.PackedMatrix | quants.StackedMatrix:
            packed = quants.pack(
                [(raw(n, s), qtype(n, info.tensors[n]), s) for n, s in zip(names, shapes, strict=True)]
            )
            release(*names)
            return packed

        total = cfg.n_layer + 1
        output_norm = vector("output_norm.weight", (cfg.n_embd,))
        emb_shape = (cfg.n_vocab, cfg.n_embd)
        emb = need("token_embd.weight", emb_shape)
        if "output.weight" in info.tensors:
            output = matrix("output.weight", shapes=[emb_shape])
            row_bytes = emb.nbytes // cfg.n_vocab
            table = np.memmap(
                path, dtype=np.uint8, mode="r", offset=emb.offset, shape=(cfg.n_vocab, row_bytes)
            )
            qtype("token_embd.weight", emb)
            token_embd = TokenEmbeddings(table, emb.type_name)
        else:  # tied: the output matrix is the embedding table
            output = matrix("token_embd.weight", shapes=[emb_shape])
            token_embd = TokenEmbeddings(None, tied=output)
        rope_freqs = None
        if "rope_freqs.weight" in info.tensors:
            rope_freqs = vector("rope_freqs.weight", (cfg.head_dim // 2,))
        if progress:
            progress(f"loading {path.name}", 1, total)
        layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            shapes = expected_shapes(cfg, i)
            layer = {}
            for whole in dict.fromkeys(FUSED.values()):  # attn_qkv, ffn_gate_up
                names = [f"{p}{part}.weight" for part, into in FUSED.items() if into == whole]
                layer[whole] = matrix(*names, shapes=[shapes[n] for n in names])
            for n in ("attn_output", "ffn_down"):
                layer[n] = matrix(p + n + ".weight", shapes=[shapes[p + n + ".weight"]])
            for name, shape in shapes.items():
                if len(shape) == 1:  # the norms: attn_norm, ffn_norm, attn_q_norm, post_ffw_norm...
                    layer[name[len(p) :].removesuffix(".weight")] = vector(name, shape)
            biases = [p + b for b in OPTIONAL_BIASES]
            if any(b in info.tensors for b in biases):
                q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
                layer["attn_qkv_bias"] = np.concatenate(
                    [vector(b, (d,)) for b, d in zip(biases, (q_dim, kv_dim, kv_dim), strict=True)]
                )
            layers.append(LayerWeights(**layer))
            if progress:
                progress(f"loading {path.name}", i + 2, total)
    return Weights(token_embd, output_norm, output, tuple(layers), rope_freqs)


def _prepared_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{PREPARED_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return cache_dir() / "prepared" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _remove_old_entries(folder: Path) -> None:
    """Entries of older formats (2.4 GB of float32 weights each) are of no use any more."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        info = entry / "info.json"
        try:
            stale = entry.is_dir() and json.loads(info.read_text()).get("format") != PREPARED_FORMAT
        except (OSError, ValueError):
            stale = entry.is_dir() and not entry.name.startswith(".")
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def _save_prepared(info: Prepared, target: Path) -> None:
    """Write the cache entry into a temporary folder and rename it, so a crash leaves no half entry."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        table = {
            "format": PREPARED_FORMAT,
            "config": asdict(info.config),
            "tensor_types": info.tensor_types,
            "tensors": {name: asdict(t) for name, t in info.tensors.items()},
        }
        (tmp / "metadata.json").write_text(json.dumps(info.metadata, ensure_ascii=False))
        (tmp / "info.json").write_text(json.dumps(table))
        (tmp / "complete").write_text("ok")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # no cache is only slower, never wrong


def _load_prepared(path: Path, target: Path) -> Prepared:
    table = json.loads((target / "info.json").read_text())
    meta = json.loads((target / "metadata.json").read_text())
    tensors = {
        name: TensorEntry(t["type_name"], tuple(t["shape"]), t["offset"], t["nbytes"])
        for name, t in table["tensors"].items()
    }
    return Prepared(path, meta, ModelConfig(**table["config"]), table["tensor_types"], tensors)
