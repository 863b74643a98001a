"""What a model takes on disk (not CI): each kind of tensor's bytes in the GGUF and in its packed file
(the kernels' layout, and the tensors kept beside the matrices), and what is under the cache folder,
with a catalog model's pip packages.

    .venv/bin/python benchmarks/model_disk.py [--model NAME|PATH] [--json]

The model is loaded first (packed, where it is not yet, as a start would), so the packed file is this
machine's. The GGUF's table of tensors comes from the metadata entry a start keeps: the GGUF itself
need not be there.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from llama_chat.inference import load_model, locate_model, packed_file
from llama_chat.inference.catalog import cache_dir, chunk_files, known_model_at
from llama_chat.inference.errors import ModelError
from llama_chat.inference.tensor_plan import matrix_plan, tensor_of
from llama_chat.inference.weights import model_info


def kind(name: str) -> str:
    """A tensor's or packed matrix's kind: its name without the layer, the expert and the run."""
    return re.sub(r"^blk\.\d+\.|experts\.\d+\.|#\d+$", "", name)


def by_kind(gguf: Path) -> dict[str, dict]:
    """Per kind (a GGUF tensor under the packed matrix it goes into: q, k and v under attn_qkv): its GGUF
    types and bytes, and its bytes in the packed file (page padding aside)."""
    info = model_info(gguf)
    plan = matrix_plan(info.config, info.tensors)
    into = {tensor_of(part)[0]: name for name, parts, _ in plan for part in parts}
    kinds = defaultdict(lambda: {"types": set(), "gguf": 0, "packed": 0})
    for name, t in info.tensors.items():
        kinds[kind(into.get(name, name))]["types"].add(t.type_name)
        kinds[kind(into.get(name, name))]["gguf"] += t.nbytes
    header = packed_file.header_of(packed_file.packed_path(gguf))
    specs = [(name, s) for name, m in header["matrices"].items() for s in m["arrays"] if s]
    specs += list(header["arrays"].items())
    for name, (dtype, shape, _, _) in specs:
        kinds[kind(name)]["packed"] += int(np.prod(shape)) * np.dtype(dtype).itemsize
    order = sorted(kinds.items(), key=lambda kv: -kv[1]["gguf"])
    return {k: v | {"types": sorted(v["types"])} for k, v in order}


def cache_files() -> dict[str, int]:
    """Bytes under the cache folder, by what they are."""
    root, sizes = cache_dir(), defaultdict(int)
    for path in root.rglob("*"):
        if path.is_file():
            part = path.relative_to(root).parts[0]
            what = "packed files" if path.suffix == ".packed" else f"{part}/"
            sizes[what] += path.stat().st_size
    return dict(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a catalog name or a GGUF's path (default model)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_model(args.model)
    gguf = locate_model(args.model)
    result = {"kinds": by_kind(gguf), "cache": cache_files(), "packed_file": 0, "pip_packages": None}
    result["packed_file"] = packed_file.packed_path(gguf).stat().st_size
    known = known_model_at(gguf)
    try:
        result["pip_packages"] = known and sum(p.stat().st_size for p in chunk_files(known))
    except ModelError:
        pass  # not installed
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'kind':24} {'GGUF types':16} {'GGUF MB':>10} {'packed MB':>10}")
    for name, k in result["kinds"].items():
        print(f"{name:24} {','.join(k['types']):16} {k['gguf'] / 1e6:10.1f} {k['packed'] / 1e6:10.1f}")
    gguf_total = sum(k["gguf"] for k in result["kinds"].values())
    packed_total = sum(k["packed"] for k in result["kinds"].values())
    print(f"{'all tensors':41} {gguf_total / 1e6:10.1f} {packed_total / 1e6:10.1f}")
    print(f"packed file: {result['packed_file'] / 1e6:.1f} MB (with its page padding and header)")
    for what, size in sorted(result["cache"].items()):
        print(f"cache {what:14} {size / 1e6:10.1f} MB")
    if result["pip_packages"]:
        print(f"pip packages   {result['pip_packages'] / 1e6:10.1f} MB")


if __name__ == "__main__":
    main()
