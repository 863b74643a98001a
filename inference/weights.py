"""GGUF file → hyperparameters and weights as the kernels read them, still quantized as the GGUF has them.

Reading a GGUF's metadata with gguf.GGUFReader costs seconds for a 150k-token vocabulary, so the first
load writes it, with the table of tensors (type, shape, where the bytes lie), as JSON into
`$XDG_CACHE_HOME/llama-chat/prepared/<key>/` (keyed by the file's path, size and mtime; a few MB).
The weights are packed for the kernels (quants.py) once per GGUF and machine profile into a file
there too, which later loads map (packed_file.py), with the norms and biases beside them as float32; the
embedding table is read from the GGUF itself at every load, except for a model of the catalog, whose
packed file holds its table's bytes too: a start of one reads nothing of its GGUF (catalog.py), and its
metadata entry is keyed by the sha256 its assembly verified, not by the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from . import formats, ggml_quants, kernels, packed_file, quants, warmup
from .activation_modes import DEFAULT_ACTIVATIONS
from .activations import BYTES_REVISION, inputs_of
from .catalog import assembled_model_at, cache_dir, ensure_model
from .config import ModelConfig, read_config, with_context
from .experts import Experts
from .forward import LayerWeights, Weights
from .gguf_file import open_gguf, read_metadata, read_tensors
from .gguf_tensors import GGUFTensors, TensorEntry
from .tensor_plan import Plan, expert_biases, expert_matrix, layer_tensors, matrix_plan, stacked, tensor_of

PREPARED_FORMAT = 2  # format 1 held 2.4 GB of float32 weights per model: removed when seen

Progress = Callable[[str, int, int], None]
log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything a model needs from its GGUF file, independent of how it was obtained."""

    path: Path
    metadata: dict
    config: ModelConfig
    tensor_types: dict[str, list]  # name → [type name, shape] of the GGUF's tensors (for the fingerprint)
    tensors: dict[str, TensorEntry] = field(repr=False)
    weights: Weights | None = field(default=None, repr=False)  # filled by load_weights
    activations: str = DEFAULT_ACTIVATIONS  # what the products take their inputs as (kernels.ACTIVATIONS)

    @property
    def matrix_formats(self) -> list[tuple[gguf.GGMLQuantizationType, ...]]:
        """The GGUF types of each matrix the kernels multiply (q/k/v and gate/up each one matrix of
        their parts' types): what the kernels must be compiled for."""
        return sorted({types for types, _ in self.matrix_kinds})

    @property
    def own_bits(self) -> dict:
        """The formats this model keeps in their own bits (formats.own_bits)."""
        return formats.own_bits(t.type_name for t in self.tensors.values())

    @property
    def matrix_kinds(self) -> list[tuple[tuple[gguf.GGMLQuantizationType, ...], str]]:
        """matrix_formats, each with what its matrix's products take as inputs ("f32" or "q8") under the
        model's activations (activations.inputs_of): the kernels a first start compiles."""
        kinds = set()
        for name, parts, _ in matrix_plan(self.config, self.tensors):
            names = {self.tensors[n].type_name for n in (tensor_of(p)[0] for p in parts) if n in self.tensors}
            known = sorted(n for n in names if n in gguf.GGMLQuantizationType.__members__)
            if known:
                types = tuple(gguf.GGMLQuantizationType[n] for n in known)
                kinds.add((types, inputs_of(self.activations, name)))
        return sorted(kinds)

    @property
    def fingerprint(self) -> str:
        """Stable hash of architecture, hyperparameters and tensor names/types/shapes, and of the
        activations where they are not float32: what KV depends on (KV computed from bytes is not taken
        for exact KV, nor the other way)."""
        described = [self.config.description(), sorted(self.tensor_types.items())]
        if self.activations != "f32":
            described += [self.activations, BYTES_REVISION]
        blob = json.dumps(described, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


OPTIONAL_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
TABLE = "token_embd.weight"


class TokenEmbeddings:
    """The embedding table, dequantized one row at a time as tokens need it: read from the GGUF through a
    memory map (only the rows used are ever paged in), or from the packed output matrix it is tied to."""

    def __init__(self, raw: np.ndarray | None, type_name: str = "F32", tied=None):
        self.raw, self.qtype, self.tied = raw, gguf.GGMLQuantizationType[type_name], tied

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), n_embd]"""
        if self.tied is not None:
            return kernels.rows(self.tied, ids)
        return np.asarray(ggml_quants.dequantize(self.raw[ids], self.qtype), dtype=np.float32)


def model_info(path: Path, progress: Progress | None = None, use_cache: bool = True) -> Prepared:
    """A GGUF's metadata, hyperparameters and tensor table, without its weights (from the cache if there)."""
    path = Path(path)
    target = _prepared_dir(path) if use_cache else None
    if target is not None:
        _remove_old_entries(target.parent)
        if (target / "complete").exists():
            try:
                return _load_prepared(path, target)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning(f"{target}: damaged ({e}); reading {path.name} again")
                shutil.rmtree(target, ignore_errors=True)  # a damaged cache entry is rebuilt from the GGUF
    ensure_gguf(path, progress)
    info = _read_gguf(path, progress)
    if target is not None:
        _save_prepared(info, target)
    return info


def prepare(
    path: Path,
    progress: Progress | None = None,
    use_cache: bool = True,
    activations: str = DEFAULT_ACTIVATIONS,
    n_ctx: int | None = None,
    use_mmap: bool = True,
) -> Prepared:
    """Metadata and weights, their products taking `activations` (kernels.ACTIVATIONS), for a context of
    n_ctx tokens per sequence (config.with_context; None: the model's own), the matrices mapped from
    their packed file or (not `use_mmap`) read into memory: everything a Model needs."""
    if activations not in kernels.ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(kernels.ACTIVATIONS)}, not {activations!r}")
    info = model_info(path, progress, use_cache)
    info.config = with_context(info.config, info.metadata, n_ctx)
    info.activations = activations
    info.weights = load_weights(info, progress, use_cache, use_mmap)
    return info


def ensure_gguf(path: Path, progress: Progress | None = None) -> None:
    """Before a GGUF's bytes are read: a catalog model's file assembled and verified (catalog.py), as it
    is not kept once packed."""
    model = assembled_model_at(path)
    if model is not None:
        ensure_model(model, progress)


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


def compile_kernels_for(info: Prepared, progress: Progress | None = None) -> float:
    """warmup.compile_kernels for the model's kinds of matrix and what each takes as inputs: what its
    first reply runs. Returns the seconds it took."""
    kinds = info.matrix_kinds
    matrices, inputs = [f for f, _ in kinds], [i for _, i in kinds]
    return warmup.compile_kernels(progress, matrices, info.activations, inputs, info.own_bits)


def load_weights(
    info: Prepared, progress: Progress | None = None, use_cache: bool = True, use_mmap: bool = True
) -> Weights:
    """The weights as the kernels read them: matrices stay in their integer formats (Q4_K in its own
    bits, the others int8 with their scales), mapped from their packed file in the cache (packed into it
    on a first start: packed_file.py; read from it into memory without `use_mmap`; packed in memory
    without the cache); small tensors (norms, biases) become float32, the embedding table stays in the
    GGUF. Fused matrices (FUSED): one kernel call for q/k/v and one for gate/up."""
    path, cfg = info.path, info.config
    compile_kernels_for(info, progress)
    gguf_file = GGUFTensors(info)
    check_tensors(gguf_file)  # before any is packed
    plan = matrix_plan(cfg, info.tensors)
    small = small_tensors(info)
    tied = "output.weight" not in info.tensors
    table_shape = (cfg.n_vocab, cfg.n_embd)
    kept = {name: (shape, np.float32) for name, shape in small.items()}
    if not tied and assembled_model_at(path) is not None:  # its GGUF is not kept once packed
        kept[TABLE] = (gguf_file.table_bytes(TABLE, table_shape), np.uint8)

    def pack_all():
        ensure_gguf(path, progress)
        yield from _pack(gguf_file, plan, progress)
        yield from ((name, gguf_file.vector(name, shape)) for name, shape in small.items())
        if TABLE in kept:
            yield TABLE, gguf_file.table(TABLE, table_shape)

    if use_cache:
        layout = _packed_layout(info, plan)
        stored = packed_file.load_or_pack(path, pack_all, layout, progress, kept, use_mmap)
    else:
        stored = dict(pack_all())
    matrices = {name: m for name, m in stored.items() if name not in kept}
    output_norm = stored["output_norm.weight"]
    rope_freqs = next((stored[name] for name in rope_factors(cfg) if name in stored), None)
    vectors = [_layer_vectors(stored, cfg, i, info.tensors) for i in range(cfg.n_layer)]
    biases = [_expert_biases(stored, cfg, i) for i in range(cfg.n_layer)]
    table = None if tied else stored.get(TABLE)
    if not tied and table is None:
        table = gguf_file.table(TABLE, table_shape)
    matrices = {name: quants.for_inputs(m, inputs_of(info.activations, name)) for name, m in matrices.items()}
    if progress:
        progress(f"loading {path.name}", 1, 1)
    layers = tuple(
        LayerWeights(**vectors[i], **_layer_matrices(matrices, cfg, i, biases[i]))
        for i in range(cfg.n_layer)
    )
    if tied:  # the output matrix is the embedding table
        token_embd = TokenEmbeddings(None, tied=matrices["output"])
    else:
        token_embd = TokenEmbeddings(table, info.tensors["token_embd.weight"].type_name)
    return Weights(token_embd, output_norm, matrices["output"], layers, rope_freqs, info.activations)


def rope_factors(cfg: ModelConfig) -> tuple[str, str]:
    """The per-frequency RoPE factors a GGUF may hold: llama 3's, or phi3's LongRoPE factors, the long
    ones past the original context, else the short ones (config.with_context)."""
    return "rope_freqs.weight", f"rope_factors_{'long' if cfg.rope_long else 'short'}.weight"


def check_tensors(gguf_file: GGUFTensors) -> None:
    """Every tensor the model reads is in the GGUF, of its shape and in a format read here; else
    ModelError, one line naming the first that is not (nothing but their table is read)."""
    info, cfg = gguf_file.info, gguf_file.info.config
    needed = list(small_tensors(info).items())
    for _, parts, shapes in matrix_plan(cfg, info.tensors):
        needed += zip(parts, shapes, strict=True)
    for name, shape in needed:
        gguf_file.need(name, shape)
        gguf_file.qtype(name)


def small_tensors(info: Prepared) -> dict[str, tuple[int, ...]]:
    """The GGUF's small tensors the model reads, as float32, and their shapes: norms, biases (q/k/v's all
    three where it has any), RoPE factors."""
    cfg, tensors = info.config, info.tensors
    shapes = {"output_norm.weight": (cfg.n_embd,)}
    factors = [name for name in rope_factors(cfg) if name in tensors][:1]
    shapes |= {name: ((cfg.rope_dim or cfg.head_dim) // 2,) for name in factors}
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        shapes |= {name: shape for name, shape in layer_tensors(cfg, i, tensors).items() if len(shape) == 1}
        if p + "attn_output.bias" in tensors:
            shapes[p + "attn_output.bias"] = (cfg.n_embd,)
        if p + "attn_qkv.bias" in tensors:
            shapes[p + "attn_qkv.bias"] = (q_dim + 2 * kv_dim,)
        elif any(p + b in tensors for b in OPTIONAL_BIASES):
            shapes |= {p + b: (d,) for b, d in zip(OPTIONAL_BIASES, (q_dim, kv_dim, kv_dim), strict=True)}
        shapes |= expert_biases(cfg, i)
    return shapes


def _layer_matrices(matrices: dict, cfg: ModelConfig, i: int, biases: dict) -> dict:
    """A layer's packed matrices, as LayerWeights takes them (a mixture's with its `biases`)."""
    p = f"blk.{i}."
    layer = {name: stacked(matrices, p + name) for name in ("attn_qkv", "attn_output")}
    if not cfg.n_expert:
        return layer | {name: stacked(matrices, p + name) for name in ("ffn_gate_up", "ffn_down")}
    experts = range(cfg.n_expert)
    layer["experts"] = Experts(
        stacked(matrices, p + "ffn_gate_inp"),
        tuple(stacked(matrices, expert_matrix(i, e, "ffn_gate_up")) for e in experts),
        tuple(stacked(matrices, expert_matrix(i, e, "ffn_down")) for e in experts),
        **biases,
    )
    return layer


def _expert_biases(small: dict[str, np.ndarray], cfg: ModelConfig, i: int) -> dict[str, np.ndarray]:
    """A layer's router and expert biases as Experts takes them (gate's and up's side by side), from the
    small tensors read (small_tensors)."""
    read = {name.split(".")[2]: small[name] for name in expert_biases(cfg, i)}
    if not read:
        return {}
    gate_up = np.concatenate([read["ffn_gate_exps"], read["ffn_up_exps"]], axis=1)
    return {"router_bias": read["ffn_gate_inp"], "gate_up_bias": gate_up, "down_bias": read["ffn_down_exps"]}


def _packed_layout(info: Prepared, plan: Plan) -> dict[str, packed_file.Layout]:
    """Each matrix of the plan: its rows, and the arrays (shape, dtype) it packs into."""
    expected, own = {}, info.own_bits
    for name, parts, shapes in plan:
        types = {gguf.GGMLQuantizationType[info.tensors[tensor_of(n)[0]].type_name] for n in parts}
        n_rows = sum(s[0] for s in shapes)
        expected[name] = (n_rows, quants.layout(types, n_rows, shapes[0][1], own))
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


def _layer_vectors(small: dict[str, np.ndarray], cfg: ModelConfig, i: int, tensors) -> dict[str, np.ndarray]:
    """A layer's norms (attn_norm, ffn_norm, attn_q_norm, post_ffw_norm...) and q/k/v biases as float32,
    from the small tensors read (small_tensors)."""
    p = f"blk.{i}."
    vectors = {"attn_norm": None, "ffn_norm": None}  # (olmo2 has no norms before attention and the FFN)
    vectors |= {
        name[len(p) :].removesuffix(".weight"): small[name]
        for name, shape in layer_tensors(cfg, i, tensors).items()
        if len(shape) == 1
    }
    if cfg.ffn_norm_tensor != "ffn_norm":
        vectors["ffn_norm"] = vectors.pop(cfg.ffn_norm_tensor)
    if p + "attn_output.bias" in small:
        vectors["attn_output_bias"] = small[p + "attn_output.bias"]
    if p + "attn_qkv.bias" in small:
        vectors["attn_qkv_bias"] = small[p + "attn_qkv.bias"]
    elif p + OPTIONAL_BIASES[0] in small:
        vectors["attn_qkv_bias"] = np.concatenate([small[p + b] for b in OPTIONAL_BIASES])
    return vectors


def _prepared_dir(path: Path) -> Path:
    """A GGUF's metadata entry: keyed by its path, size and mtime; a catalog model's by its sha256 (the
    file is not kept once packed: catalog.py)."""
    model = assembled_model_at(path)
    if model is not None:
        key = f"{PREPARED_FORMAT}:{path.resolve()}:sha256:{model.sha256}"
    else:
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
        files = {
            "metadata.json": json.dumps(info.metadata, ensure_ascii=False).encode(),
            "info.json": json.dumps(table).encode(),
        }
        for name, blob in files.items():
            (tmp / name).write_bytes(blob)
        (tmp / "complete").write_text(_digest(files.values()))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # no cache is only slower, never wrong


def _digest(blobs) -> str:
    """What an entry's `complete` holds: the SHA-256 of its files, so that one changed is not trusted (a
    catalog model's metadata is kept only here once its GGUF is removed)."""
    digest = hashlib.sha256()
    for blob in blobs:
        digest.update(hashlib.sha256(blob).digest())
    return digest.hexdigest()


def _load_prepared(path: Path, target: Path) -> Prepared:
    """Raises ValueError where its files are not those written."""
    blobs = [(target / name).read_bytes() for name in ("metadata.json", "info.json")]
    if (target / "complete").read_text() != _digest(blobs):
        raise ValueError("its files are not those written")
    meta, table = (json.loads(blob) for blob in blobs)
    tensors = {
        name: TensorEntry(t["type_name"], tuple(t["shape"]), t["offset"], t["nbytes"])
        for name, t in table["tensors"].items()
    }
    return Prepared(path, meta, ModelConfig(**table["config"]), table["tensor_types"], tensors)
