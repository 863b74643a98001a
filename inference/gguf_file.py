"""Reading GGUF files: metadata as plain Python values and tensor descriptions, with one-line errors."""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import ModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGML type, e.g. "Q4_K"
    shape: tuple[int, ...]  # NumPy order (rows first), as dequantize returns it
    data: np.ndarray  # the raw, still quantized bytes (a view into the memory-mapped file)


def check_gguf_path(path: str | os.PathLike) -> Path:
    """The path, if it names a file that starts like a GGUF file; else a ModelError naming it."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (wrong magic {magic!r})")
    return path


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file, turning every way it can be unusable into a ModelError naming the file."""
    path = check_gguf_path(path)
    try:
        with _plain_arrays():
            reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises many kinds of errors on a damaged file
        raise ModelError(f"{path}: damaged or truncated GGUF file ({_reason(e)})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelError(f"{path}: truncated GGUF file (tensor {t.name} is cut short)")
    return reader


@contextlib.contextmanager
def _plain_arrays():
    """GGUFReader slices its np.memmap once per field part (~3 million times for a 150k-token
    vocabulary), and every slice of a memmap runs its Python-level hooks: 8 s of a 10 s first load.
    A plain ndarray view of the same mapped memory reads the same bytes without them."""
    module = gguf.gguf_reader
    numpy = module.np
    module.np = types.SimpleNamespace(
        **{k: getattr(numpy, k) for k in dir(numpy) if not k.startswith("__") and k != "memmap"},
        memmap=lambda path, mode="r": np.asarray(np.memmap(path, mode=mode)),
    )
    try:
        yield
    finally:
        module.np = numpy


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key/value field of the file as a plain Python value (str, int, float, bool or list)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        meta[key] = value
    return meta


def read_tensors(reader: gguf.GGUFReader) -> dict[str, TensorInfo]:
    tensors = {}
    for t in reader.tensors:
        # GGUF lists dimensions innermost first; dequantize returns the reversed (row-major) shape.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorInfo(t.name, t.tensor_type.name, shape, t.data)
    return tensors


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
