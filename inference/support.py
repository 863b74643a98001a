"""What a GGUF file needs of this build (its architecture, tokenizer and tensor formats) and whether it
runs here: `llama-chat models PATH` lists it, without loading the weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import quants
from .config import ARCHITECTURES
from .errors import ModelError
from .formats import OWN_BITS, own_bits
from .gguf_file import open_gguf, read_metadata
from .gguf_tensors import UNREADABLE, GGUFTensors, readable_format
from .tokenizer import Tokenizer
from .weights import check_tensors, model_info

# How the kernels keep a matrix of each kind of format (quants.kind_of)
KEPT = {
    **{kind: "kept in its own bits" for kind in OWN_BITS.values()},
    "integer weights": "int8 with a scale per 16 or 32 weights",
    "integer weights with offsets": "int8 with a scale and offset per 32 weights",
    "float weights": "float32",
}


def gguf_needs(path: Path) -> dict:
    """The file's architecture, tokenizer and matrix formats (each with how many tensors are in it and
    how it is kept here), and whether it runs: `problem` is None, or the one line loading it would stop
    with. ModelError where the file is no GGUF at all."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    own = own_bits(t.tensor_type.name for t in reader.tensors)
    arch = meta.get("general.architecture")
    tokenizer = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    return {
        "path": str(path),
        "architecture": arch,
        "architecture_supported": arch in ARCHITECTURES,
        "tokenizer": f"{tokenizer} ({pre})" if pre else tokenizer,
        "formats": {name: {"tensors": n, "kept": _kept(name, own)} for name, n in sorted(counts.items())},
        "problem": _problem(path, meta),
    }


def _kept(type_name: str, own: dict) -> str:
    try:
        kind = quants.kind_of({readable_format(type_name)}, own)
    except UNREADABLE:
        return "not read here"
    return KEPT.get(kind, kind)


def _problem(path: Path, meta: dict) -> str | None:
    try:
        info = model_info(path)
        Tokenizer.from_metadata(meta)
        check_tensors(GGUFTensors(info))
    except ModelError as e:
        return str(e)
    return None
