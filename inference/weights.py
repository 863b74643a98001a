"""GGUF file → hyperparameters and weights as the kernels read them, still quantized as the GGUF has them.

Reading a GGUF's metadata with gguf.GGUFReader costs seconds for a 150k-token vocabulary, so the first
load writes it, with the table of tensors (type, shape, where the bytes lie), as JSON into
`$XDG_CACHE_HOME/llama-chat/prepared/<key>/` (keyed by the file's path, size and mtime; a few MB).
The weights are packed for the kernels (quants.py) once per GGUF and machine profile into a file
there too, which later loads map (packed_file.py); norms, biases and the embedding table are read from
the GGUF itself at every load.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from . import k_quants, kernels, packed_file, quants
from .activations import inputs_of
from .catalog import cache_dir
from .config import ModelConfig
from .errors import ModelError
from .forward import LayerWeights, Weights
from .gguf_file import open_gguf, read_metadata, read_tensors
from .k_quants import StackedMatrix

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
    activations: str = "f32"  # what the products take their inputs as (kernels.ACTIVATIONS)

    @property
    def matrix_formats(self) -> list[tuple[gguf.GGMLQuantizationType, ...]]:
        """The GGUF types of each matrix the kernels multiply (q/k/v and gate/up each one matrix of
        their parts' types): what the kernels must be compiled for."""
        return sorted({formats for formats, _ in self.matrix_kinds})

    @property
    def matrix_kinds(self) -> list[tuple[tuple[gguf.GGMLQuantizationType, ...], str]]:
        """matrix_formats, each with what its matrix's products take as inputs ("f32" or "q8") under the
        model's activations (activations.inputs_of): the kernels a first start compiles."""
        matrices: dict[str, set] = {}
        for name, t in self.tensors.items():
            if len(t.shape) == 2:
                prefix, _, part = name.removesuffix(".weight").rpartition(".")
                if name == "token_embd.weight" and "output.weight" not in self.tensors:
                    part = "output"  # the output matrix is the embedding table
                matrices.setdefault(f"{prefix}.{FUSED.get(part, part)}", set()).add(t.type_name)
        return sorted({
            (tuple(gguf.GGMLQuantizationType[n] for n in sorted(names)), inputs_of(self.activations, name))
            for name, names in matrices.items()
        })

    @property
    def fingerprint(self) -> str:
        """Stable hash of architecture, hyperparameters and tensor names/types/shapes, and of the
        activations where they are not float32: what KV depends on (KV computed from bytes is not taken
        for exact KV, nor the other way)."""
        described = [asdict(self.config), sorted(self.tensor_types.items())]
        if self.activations != "f32":
            described.append(self.activations)
        blob = json.dumps(described, sort_keys=True)
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


def prepare(path: Path, progress: Progress | None = None, use_cache: bool = True, activations: str = "f32") -> Prepared:
    """Metadata and weights, their products taking `activations` (kernels.ACTIVATIONS): everything a
    Model needs."""
    if activations not in kernels.ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(kernels.ACTIVATIONS)}, not {activations!r}")
    info = model_info(path, progress, use_cache)
    info.activations = activations
    info.weights = load_weights(info, progress, use_cache)
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


def load_weights(info: Prepared, progress: Progress | None = None, use_cache: bool = True) -> Weights:
    """The weights as the kernels read them: matrices stay in their integer formats (Q4_K in its own
    bits, the others int8 with their scales), mapped from their packed file in the cache (packed into it
    on a first start: packed_file.py; in memory without the cache); small tensors (norms, biases) become
    float32, the embedding table stays in the GGUF. Fused matrices (FUSED): one kernel call for q/k/v
    and one for gate/up."""
    path, cfg = info.path, info.config
    kinds = info.matrix_kinds
    quants.compile_kernels(progress, [f for f, _ in kinds], info.activations, [i for _, i in kinds])
    gguf_file = GGUFTensors(info)
    plan = matrix_plan(info)
    for _, parts, shapes in plan:  # every tensor there, of its shape and a known type, before any is packed
        for name, shape in zip(parts, shapes, strict=True):
            gguf_file.need(name, shape)
            gguf_file.qtype(name)
    output_norm = gguf_file.vector("output_norm.weight", (cfg.n_embd,))
    rope_freqs = None
    if "rope_freqs.weight" in info.tensors:
        rope_freqs = gguf_file.vector("rope_freqs.weight", (cfg.head_dim // 2,))
    vectors = [_layer_vectors(gguf_file, cfg, i) for i in range(cfg.n_layer)]
    tied = "output.weight" not in info.tensors
    table = None if tied else gguf_file.table("token_embd.weight", (cfg.n_vocab, cfg.n_embd))

    def pack_all():
        return _pack(gguf_file, plan, progress)

    if use_cache:
        matrices = packed_file.load_or_pack(path, pack_all, _packed_layout(info, plan), progress)
    else:
        matrices = dict(pack_all())
    if info.activations != "f32":
        matrices = {
            name: replace(m, activations=inputs_of(info.activations, name)) for name, m in matrices.items()
        }
    if progress:
        progress(f"loading {path.name}", 1, 1)
    layers = tuple(
        LayerWeights(**vectors[i], **{name: _stacked(matrices, f"blk.{i}.{name}") for name in LAYER_MATRICES})
        for i in range(cfg.n_layer)
    )
    if tied:  # the output matrix is the embedding table
        token_embd = TokenEmbeddings(None, tied=matrices["output"])
    else:
        token_embd = TokenEmbeddings(table, info.tensors["token_embd.weight"].type_name)
    return Weights(token_embd, output_norm, matrices["output"], layers, rope_freqs, info.activations)


LAYER_MATRICES = ("attn_qkv", "ffn_gate_up", "attn_output", "ffn_down")


def matrix_plan(info: Prepared) -> list[tuple[str, list[str], list[tuple[int, int]]]]:
    """The matrices the kernels multiply, in the order they are packed: (name, the GGUF tensors stacked
    into it, their shapes)."""
    cfg = info.config
    emb_shape = (cfg.n_vocab, cfg.n_embd)
    output = "output.weight" if "output.weight" in info.tensors else "token_embd.weight"
    plan = [("output", [output], [emb_shape])]
    for i in range(cfg.n_layer):
        p, shapes = f"blk.{i}.", expected_shapes(cfg, i)
        for name in LAYER_MATRICES:
            parts = [f"{p}{part}.weight" for part, into in FUSED.items() if into == name] or [f"{p}{name}.weight"]
            plan += _runs(info, p + name, parts, [shapes[n] for n in parts])
    return plan


def _runs(info: Prepared, name: str, parts: list[str], shapes: list[tuple[int, int]]) -> list:
    """A matrix of the plan; or where Q4_K meets other formats (q/k beside a Q6_K v), its runs, each
    packed (and kept in the packed file) on its own as name#0, name#1…, multiplied as one StackedMatrix."""
    types = [info.tensors[n].type_name if n in info.tensors else None for n in parts]
    if None in types or not all(t in gguf.GGMLQuantizationType.__members__ for t in types):
        return [(name, parts, shapes)]  # load_weights' check names the missing tensor or its type
    typed = [(n, gguf.GGMLQuantizationType[t], s) for n, t, s in zip(parts, types, shapes, strict=True)]
    if len(quants.kinds_of({qtype for _, qtype, _ in typed})) == 1:
        return [(name, parts, shapes)]
    runs = k_quants.runs_of_q4_k(typed)
    return [(f"{name}#{j}", [n for n, _, _ in run], [s for _, _, s in run]) for j, run in enumerate(runs)]


def _stacked(matrices: dict, name: str) -> quants.PackedMatrix | StackedMatrix:
    """The plan's matrix `name`, whole or joined from its runs (_runs)."""
    if name in matrices:
        return matrices[name]
    runs = []
    while f"{name}#{len(runs)}" in matrices:
        runs.append(matrices[f"{name}#{len(runs)}"])
    return StackedMatrix(runs)


def _packed_layout(info: Prepared, plan) -> dict[str, packed_file.Layout]:
    """Each matrix of the plan: its rows, and the arrays (shape, dtype) it packs into."""
    expected = {}
    for name, parts, shapes in plan:
        formats = {gguf.GGMLQuantizationType[info.tensors[n].type_name] for n in parts}
        n_rows = sum(s[0] for s in shapes)
        expected[name] = (n_rows, quants.layout(formats, n_rows, shapes[0][1]))
    return expected


def _pack(gguf_file: GGUFTensors, plan, progress: Progress | None):
    """(name, PackedMatrix) for each matrix of the plan, the GGUF's pages of each let go once it is packed."""
    label = f"packing {gguf_file.path.name}"
    for i, (name, parts, shapes) in enumerate(plan):
        if progress:
            progress(label, i, len(plan))
        yield name, gguf_file.matrix(parts, shapes)
    if progress:
        progress(label, len(plan), len(plan))


def _layer_vectors(gguf_file: GGUFTensors, cfg: ModelConfig, i: int) -> dict[str, np.ndarray]:
    """A layer's norms (attn_norm, ffn_norm, attn_q_norm, post_ffw_norm...) and q/k/v biases as float32."""
    p = f"blk.{i}."
    vectors = {
        name[len(p) :].removesuffix(".weight"): gguf_file.vector(name, shape)
        for name, shape in expected_shapes(cfg, i).items()
        if len(shape) == 1
    }
    biases = [p + b for b in OPTIONAL_BIASES]
    if any(b in gguf_file.info.tensors for b in biases):
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        vectors["attn_qkv_bias"] = np.concatenate(
            [gguf_file.vector(b, (d,)) for b, d in zip(biases, (q_dim, kv_dim, kv_dim), strict=True)]
        )
    return vectors


class GGUFTensors:
    """A GGUF's tensors, read through a memory map: packing unpacks straight from the page cache, with
    no copy of the file's bytes in between (np.fromfile took a tenth of a warm load). Copy-on-write
    keeps the arrays writable (the kernels' compiled signatures) without any write reaching the file;
    the pages of each tensor leave this process once it is packed (peak RSS)."""

    def __init__(self, info: Prepared):
        self.info, self.path = info, info.path
        with open(self.path, "rb") as f:
            self.mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def need(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        t = self.info.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ModelError(f"{self.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def qtype(self, name: str) -> gguf.GGMLQuantizationType:
        t = self.info.tensors[name]
        try:
            qt = gguf.GGMLQuantizationType[t.type_name]
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qt][1]), np.uint8), qt)  # one block
            return qt
        except (NotImplementedError, KeyError, ValueError) as e:
            raise ModelError(
                f"{self.path}: tensor {name} has unsupported quantization type {t.type_name} ({e})"
            ) from None

    def raw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.need(name, shape)
        if t.offset + t.nbytes > len(self.mapped):
            raise ModelError(f"{self.path}: truncated GGUF file (tensor {name} is cut short)")
        data = np.frombuffer(self.mapped, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return data.reshape(shape[0] if len(shape) > 1 else 1, -1)

    def release(self, *names: str) -> None:
        for name in names:
            t = self.info.tensors[name]
            start = t.offset - t.offset % mmap.PAGESIZE
            self.mapped.madvise(mmap.MADV_DONTNEED, start, t.offset + t.nbytes - start)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        raw = self.raw(name, shape)
        return np.ascontiguousarray(gguf.quants.dequantize(raw, self.qtype(name)), dtype=np.float32).reshape(shape)

    def matrix(self, names: list[str], shapes: list[tuple[int, int]]) -> quants.PackedMatrix:
        packed = quants.pack([(self.raw(n, s), self.qtype(n), s) for n, s in zip(names, shapes, strict=True)])
        self.release(*names)
        return packed

    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """The embedding table's rows as bytes, mapped read-only: only the rows used are paged in."""
        t = self.need(name, shape)
        self.qtype(name)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(shape[0], t.nbytes // shape[0]))


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
