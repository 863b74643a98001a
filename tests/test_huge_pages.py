"""Packed weights on 2 MB pages: the page cache holds a packed file in huge-page folios, which every
process that maps it maps with one entry each, and a mapping asks for them (huge_pages.py)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from llama_chat.inference import load_model, packed_file
from llama_chat.inference.huge_pages import huge_page_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage")
pytestmark = pytest.mark.skipif(
    not (THP.is_dir() and Path("/proc/self/smaps").exists()), reason="a kernel without transparent huge pages"
)


def mappings_of(path: Path) -> list[dict[str, str]]:
    """This process's mappings of `path`: each its /proc/self/smaps fields."""
    found, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and fields[0][0] in "0123456789abcdef" and "-" in fields[0] and ":" not in fields[0]:
            current = {} if fields[-1] == str(path) else None
            if current is not None:
                found.append(current)
        elif current is not None and fields:
            current[fields[0].rstrip(":")] = " ".join(fields[1:])
    return found


def huge_mapped(path: Path) -> int:
    """The bytes of `path` a mapping of it, every page read, maps with huge-page entries."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with memoryview(mapped) as data:
        sum(data[i] for i in range(0, len(data), mmap.PAGESIZE))
        kb = sum(int(m["FilePmdMapped"].split()[0]) for m in mappings_of(path))
    mapped.close()
    return kb * 1024


def test_a_packed_file_is_held_in_huge_pages_whatever_its_arrays_sizes(tmp_path):
    block = huge_page_bytes()
    probe = tmp_path / "probe"
    with open(probe, "wb", buffering=0) as f:
        f.write(np.ones(2 * block, np.uint8))  # one write of whole huge pages from memory in RAM
    if huge_mapped(probe) != 2 * block:
        pytest.skip("this kernel or file system keeps no file's page cache in huge-page folios")
    sizes = [3 * block // 2 + 1, 2 * block + 12345, block // 3, 3 * block + 7]  # ends inside blocks
    arrays = [(f"a{k}", np.full(n, k + 1, np.uint8)) for k, n in enumerate(sizes)]
    path = tmp_path / "model.packed"
    for _ in range(3):  # (a machine short of free 2 MB pages at that moment gives small folios instead)
        packed_file.write_packed(path, {}, iter(arrays), 0)
        if huge_mapped(path) == os.path.getsize(path) // block * block:
            break
    else:
        pytest.fail(f"{huge_mapped(path)} of {os.path.getsize(path)} bytes on huge pages")
    header = packed_file.header_of(path)
    with open(path, "rb") as f:
        for name, a in arrays:
            dtype, shape, offset, _ = header["arrays"][name]
            f.seek(offset)
            assert f.read(a.nbytes) == a.tobytes()


def test_a_loaded_models_weights_are_mapped_asking_for_huge_pages(qwen2):
    model = load_model(qwen2)
    mappings = mappings_of(packed_file.packed_path(qwen2))
    assert mappings and all("hg" in m["VmFlags"].split() for m in mappings)
    assert model.logits(model.tokenizer.encode("hello")).shape[-1] == model.config.n_vocab
