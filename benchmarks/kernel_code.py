"""What the compiler made of a product kernel: its instructions, how many of them move vector registers
to and from the stack (spills and their reloads), and what `llvm-mca` (Debian's `llvm` package; left out
when it is missing) says one pass of its hottest loop costs on a processor model. Counts, not timings:
the same on a busy machine, where a timing moves by a fifth from one run to the next.

    python benchmarks/kernel_code.py [--format Q6_K] [--rows 1] [--in-bits] [--mcpu znver3]
    NUMBA_CPU_NAME=haswell python benchmarks/kernel_code.py ...   # the AVX2 profile's code

--rows 1 and 2 are the one- and two-row kernels (a decoded token, two replies), more the passes of a
prompt's rows. --in-bits packs Q6_K in its own bits whatever the profile keeps (formats.Q6_K_IN_BITS).
The hottest loop is the basic block with the most byte products (`vpmaddubsw`, `vpdpbusd`); the
weights times rows a pass multiplies are those products' bytes (32 each on AVX2, 64 on AVX-512). LLVM
14's models stop at Zen 3 (`znver3`) and Ice Lake (`icelake-server` for AVX-512 code): compare versions
on one model, not models.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import replace

import gguf
import numpy as np

BYTE_PRODUCTS = ("vpmaddubsw", "vpdpbusd")


def compiled(qtype, rows: int, in_bits: bool):
    """(the assembly of the group kernel that products of `rows` rows run for a zero matrix of qtype,
    its register width in bytes)."""
    from llama_chat.inference import k_quants, kernels, products, quants

    n_rows, n_cols = 4 * kernels.LANES, 1024
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((n_rows, n_cols // block_len * block_bytes), np.uint8)
    if in_bits and qtype == gguf.GGMLQuantizationType.Q6_K:
        arrays = [np.zeros(*a) for a in k_quants.q6_k_layout(n_rows // kernels.LANES, n_cols)]
        quants._in_parallel_over_groups(k_quants.pack_q6_k_blocks, raw, qtype, (n_rows, n_cols), 0, arrays)
        w = quants.PackedMatrix(*arrays, n_rows=n_rows, activations="q8", small=True)
    else:
        w = replace(quants.pack([(raw, qtype, (n_rows, n_cols))]), activations="q8")
    kernels.kernel_product(np.zeros((rows, n_cols), np.float32), w)
    kernel = {1: products._one_row_group_product, 2: products._two_row_group_product}.get(
        rows, products._group_product
    )
    asm = "\n".join(kernel.inspect_asm(signature) for signature in kernel.signatures)
    return asm, 64 if "zmm" in asm else 32


def hottest_block(asm: str) -> list[str]:
    """The instructions of the basic block with the most byte products, less its jumps and calls."""
    blocks, block = [], []
    for line in asm.splitlines():
        if re.match(r"^\.?[\w$.]+:", line):
            blocks.append(block)
            block = []
        elif line.startswith("\t") and not line.startswith(("\t.", "\t#")):
            block.append(line)
    blocks.append(block)
    best = max(blocks, key=lambda b: sum(i.split()[0] in BYTE_PRODUCTS for i in b))
    return [i for i in best if not re.match(r"\t(j[a-z]+|call)", i)]


def mca_cycles(block: list[str], mcpu: str, iterations: int = 50) -> float | None:
    """llvm-mca's cycles for one pass of the block on the model `mcpu`; None without llvm-mca."""
    if shutil.which("llvm-mca") is None:
        return None
    run = subprocess.run(
        ["llvm-mca", f"-mcpu={mcpu}", f"-iterations={iterations}"],
        input="\n".join(block) + "\n", capture_output=True, text=True, check=True,
    )
    return int(re.search(r"Total Cycles:\s+(\d+)", run.stdout).group(1)) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="Q6_K", choices=[t.name for t in gguf.GGMLQuantizationType])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--in-bits", action="store_true")
    parser.add_argument("--mcpu", default="znver3", help="llvm-mca's processor model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:  # compiled now, not loaded: a loaded kernel has no assembly
        os.environ["NUMBA_CACHE_DIR"] = cache  # (read when llama_chat.inference is first imported)
        asm, vector_bytes = compiled(gguf.GGMLQuantizationType[args.format], args.rows, args.in_bits)
    instructions = [i for i in asm.splitlines() if i.startswith("\t") and not i.startswith(("\t.", "\t#"))]
    spills = [i for i in instructions if "(%rsp)" in i and re.search(r"[yz]mm", i)]
    block = hottest_block(asm)
    weight_rows = sum(i.split()[0] in BYTE_PRODUCTS for i in block) * vector_bytes
    cycles = mca_cycles(block, args.mcpu)
    result = {
        "format": args.format, "rows": args.rows, "instructions": len(instructions),
        "vector_spills_and_reloads": len(spills), "hottest_loop_instructions": len(block),
        "hottest_loop_weight_rows": weight_rows, "mcpu": args.mcpu, "mca_cycles": cycles,
        "mca_weight_rows_a_cycle": round(weight_rows / cycles, 2) if cycles else None,
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
