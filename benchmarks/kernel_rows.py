"""Milliseconds and GFLOP/s of the kernels' matrix product for 1…64 input rows, on the default model's
matrix shapes and formats, under this machine's own profile and under AVX2 (`NUMBA_CPU_NAME=haswell`).

    python benchmarks/kernel_rows.py                      # both profiles, one child process each
    python benchmarks/kernel_rows.py --profile native     # this process's profile only
    python benchmarks/kernel_rows.py --json               # one JSON object per profile

Each profile compiles into a numba cache folder of its own (inference/jit.py), so the first run of a
profile includes its compile time; the figures do not.
Zeros as weights and inputs: the speed of a product does not depend on its values.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from isa import compiles_for, our_env

# The default model's (Qwen2.5-Coder-0.5B Q4_K_M) matrices as the forward pass multiplies them (fused
# q/k/v and gate/up), each in the format most of its layers have: rows, columns, GGUF type.
MATRICES = {
    "attn_qkv": (1152, 896, "Q5_0"),
    "attn_output": (896, 896, "Q5_0"),
    "ffn_gate_up": (9728, 896, "Q5_0"),
    "ffn_down": (896, 4864, "Q4_K"),
    "output": (151936, 896, "Q8_0"),
    # a 7B's (Qwen2-7B Q4_K_M): larger than the L2, as decode reads them
    "7b_ffn_gate_up": (37888, 3584, "Q4_K"),
    "7b_ffn_down": (3584, 18944, "Q6_K"),
}
DEFAULT_MATRICES = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down", "output")
ROWS = (1, 2, 4, 8, 32, 64)


def time_product(product, x, w, clock=time.perf_counter, budget_s: float = 0.4, most: int = 30) -> float:
    """The fastest of repeated runs (a busy machine only ever makes a run slower), in seconds."""
    product(x, w)  # compiled, pages touched
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or (spent < budget_s and runs < most):
        t = clock()
        product(x, w)
        t = clock() - t
        best, spent, runs = min(best, t), spent + t, runs + 1
    return best


def measure(
    rows: tuple[int, ...], names: list[str], clock=time.perf_counter, activations: str = "f32"
) -> dict:
    from dataclasses import replace

    import gguf
    import numba
    import numpy as np

    from llama_chat.inference import kernels, quants

    kernels.blas_on_one_thread(True)  # as in a step of the kernels
    profile = f"{numba.config.CPU_NAME or 'host'} LANES={kernels.LANES} ROWS={kernels.ROWS}"
    profile += f", inputs {activations}"
    results = {"profile": profile, "matrices": {}}
    for name in names:
        n_rows, n_cols, type_name = MATRICES[name]
        qtype = gguf.GGMLQuantizationType[type_name]
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((n_rows, n_cols // block_len * block_bytes), np.uint8)
        w = replace(quants.pack([(raw, qtype, (n_rows, n_cols))]), activations=activations)
        table = {}
        for n in rows:
            x = np.zeros((n, n_cols), np.float32)
            seconds = time_product(kernels.kernel_product, x, w, clock)
            gflops = 2 * n * n_rows * n_cols / seconds / 1e9
            table[n] = {"ms": round(seconds * 1000, 3), "gflops": round(gflops, 1)}
        results["matrices"][name] = table
    return results


def print_table(results: dict) -> None:
    print(results["profile"])
    rows = list(next(iter(results["matrices"].values())))
    print(f"{'matrix':14}" + "".join(f"{f'{n} rows':>18}" for n in rows))
    for name, table in results["matrices"].items():
        cells = "".join(f"{table[n]['ms']:9.2f} ms {table[n]['gflops']:4.0f} GF" for n in rows)
        print(f"{name:14}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("both", "native", "avx2"), default="both")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="input row counts, comma-separated")
    parser.add_argument("--matrices", default=",".join(DEFAULT_MATRICES), help="of: " + ", ".join(MATRICES))
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the process's CPU time (all threads together): on a busy machine, with "
        "NUMBA_NUM_THREADS=1, what a product costs without the time other processes take the core",
    )
    parser.add_argument("--activations", choices=("f32", "q8"), default="f32", help="the products' inputs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = tuple(int(n) for n in args.rows.split(","))
    names = args.matrices.split(",")
    if args.profile != "both" and compiles_for(args.profile):
        clock = time.process_time if args.cpu_time else time.perf_counter
        results = measure(rows, names, clock, args.activations)
        print(json.dumps(results) if args.json else print_table(results) or "", flush=True)
        return
    for profile in ("native", "avx2") if args.profile == "both" else (args.profile,):
        argv = [sys.executable, __file__, "--profile", profile, "--rows", args.rows]
        argv += ["--matrices", args.matrices, "--activations", args.activations]
        argv += ["--cpu-time"] if args.cpu_time else []
        subprocess.run([*argv, *(["--json"] if args.json else [])], env=our_env(profile), check=True)


if __name__ == "__main__":
    main()
