"""A GGUF's tensors, read through a memory map of the file: what packing unpacks and the small tensors
read beside the matrices, found by the table of tensors weights.py keeps."""

from __future__ import annotations

import functools
import mmap
import os
import threading
from dataclasses import dataclass

import gguf
import numpy as np

from . import ggml_quants, quants
from .errors import ModelError
from .tensor_plan import tensor_of


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's bytes lie in the GGUF file."""

    type_name: str
    shape: tuple[int, ...]  # rows first
    offset: int  # from the start of the file
    nbytes: int


UNREADABLE = (NotImplementedError, KeyError, ValueError)  # what readable_format raises
# A request to read ahead is cut to the device's readahead window (read_ahead_kb, 128 KB by default on
# Linux), the rest silently dropped: so the requests go a window at a time.
READ_AHEAD_STEP = 128 << 10


def readable_format(type_name: str) -> gguf.GGMLQuantizationType:
    """The GGUF format of that name, where ggml_quants reads it (one block of zeros tried); else one of
    UNREADABLE."""
    qtype = gguf.GGMLQuantizationType[type_name]
    ggml_quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    return qtype


class GGUFTensors:
    """A GGUF's tensors, read through a memory map: packing unpacks straight from the page cache, with
    no copy of the file's bytes in between (np.fromfile took a tenth of a warm load). Copy-on-write
    keeps the arrays writable (the kernels' compiled signatures) without any write reaching the file;
    the pages of each tensor leave this process once it is packed (peak RSS)."""

    def __init__(self, info):  # a weights.Prepared: its path, config and table of tensors
        self.info, self.path = info, info.path
        self.own_bits = info.own_bits  # (formats.own_bits: once, not for each matrix packed)

    @functools.cached_property
    def mapped(self) -> mmap.mmap:
        """The file, mapped only where its bytes are read (its table of tensors is in `info`)."""
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def need(self, part: str, shape: tuple[int, ...]) -> TensorEntry:
        """The tensor a part is (or is an expert of: then `shape` is one expert's), checked."""
        name, expert = tensor_of(part)
        t = self.info.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: missing tensor {name}")
        if expert is not None:
            shape = (self.info.config.n_expert, *shape)
        if tuple(t.shape) != shape:
            raise ModelError(f"{self.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def _span(self, part: str, t: TensorEntry) -> tuple[int, int]:
        """Where a part's bytes lie in the file: (offset, length); an expert's, of a 3-D tensor."""
        expert = tensor_of(part)[1]
        if expert is None:
            return t.offset, t.nbytes
        each = t.nbytes // t.shape[0]
        return t.offset + expert * each, each

    def qtype(self, part: str) -> gguf.GGMLQuantizationType:
        name = tensor_of(part)[0]
        t = self.info.tensors[name]
        try:
            return readable_format(t.type_name)
        except UNREADABLE as e:
            raise ModelError(
                f"{self.path}: tensor {name} has unsupported quantization type {t.type_name} ({e})"
            ) from None

    def raw(self, part: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.need(part, shape)
        if t.offset + t.nbytes > len(self.mapped):
            raise ModelError(f"{self.path}: truncated GGUF file (tensor {tensor_of(part)[0]} is cut short)")
        offset, nbytes = self._span(part, t)
        data = np.frombuffer(self.mapped, dtype=np.uint8, count=nbytes, offset=offset)
        return data.reshape(shape[0] if len(shape) > 1 else 1, -1)

    def release(self, *parts: str) -> None:
        for part in parts:
            offset, nbytes = self._span(part, self.info.tensors[tensor_of(part)[0]])
            start = offset - offset % mmap.PAGESIZE
            self.mapped.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)

    def vector(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        raw = self.raw(name, shape)
        return np.ascontiguousarray(ggml_quants.dequantize(raw, self.qtype(name)), dtype=np.float32).reshape(
            shape
        )

    def matrix(self, names: list[str], shapes: list[tuple[int, int]]) -> quants.PackedMatrix:
        parts = [(self.raw(n, s), self.qtype(n), s) for n, s in zip(names, shapes, strict=True)]
        packed = quants.pack(parts, self.own_bits)
        self.release(*names)
        return packed

    def table_bytes(self, name: str, shape: tuple[int, int]) -> tuple[int, int]:
        """The embedding table's shape as bytes: a row of bytes a token."""
        t = self.need(name, shape)
        self.qtype(name)
        return shape[0], t.nbytes // shape[0]

    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """The embedding table's rows as bytes, mapped read-only: only the rows used are mapped in, from
        the page cache, which reads the whole table in the background (read_ahead)."""
        rows, offset = self.table_bytes(name, shape), self.need(name, shape).offset
        read_ahead(self.path, offset, rows[0] * rows[1])
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=rows)


def read_ahead(path, offset: int, length: int) -> threading.Thread | None:
    """Have the kernel read bytes offset… of a file into the page cache, on a thread of its own: a prompt's
    rows of a table the disk has not read yet would each wait on a read of their own (a 32-token prompt
    to the synthetic 7B 14-20 % slower: benchmarks/cold_prompt.py, docs/performance.md, "A start maps the
    packed weights"). The thread, where one was started: it ends once the requests are made, before the
    reads."""
    if not hasattr(os, "posix_fadvise"):  # (not on macOS or Windows)
        return None

    def advise() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        end = offset + length
        try:
            for start in range(offset, end, READ_AHEAD_STEP):
                os.posix_fadvise(fd, start, min(READ_AHEAD_STEP, end - start), os.POSIX_FADV_WILLNEED)
        except OSError:  # advice only: a read that fails here fails again, and says so, where the row is used
            pass
        finally:
            os.close(fd)

    thread = threading.Thread(target=advise, name="read-ahead", daemon=True)
    thread.start()
    return thread
