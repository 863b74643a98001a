"""How near the machine's read bandwidth one row's product gets, per format: a 7B's matrix multiplied by
one input row with its weights in RAM, against a plain streaming read of as many bytes (limits.py's),
the two timed in turn in one process, so that whatever else the host runs at that moment slows both.

    python benchmarks/read_rate.py                        # both profiles, Q4_K and Q6_K, inputs q8
    python benchmarks/read_rate.py --formats Q4_K --profile native --activations f32

Decode is one row's products over every weight, so a format's fraction here bounds its share of
decode's fraction of the bandwidth (roofline.py), which compares a decode with a limit measured at
another moment. Enough copies of the matrix to pass the last-level cache are read round in turn, so
every read comes from RAM. Zeros as weights and inputs: the speed of a product does not depend on its
values. JSON on the last line.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import time
from pathlib import Path

from isa import compiles_for, our_env

SHAPE = (37888, 3584)  # a Qwen2-7B's ffn_gate_up (rows, columns), 79 MB in Q4_K


def largest_cache(fallback: int = 512 << 20) -> int:
    """Bytes of the processor's largest cache (sysfs), or `fallback` where it does not say."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = Path(path).read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=fallback)


def measure(formats: list[str], activations: str, rounds: int) -> dict:
    from dataclasses import replace

    import gguf
    import numpy as np
    from limits import _stream_sum

    from llama_chat.inference import kernels, quants
    from llama_chat.inference.cpu import PROFILE

    kernels.blas_on_one_thread(True)  # as in a step of the kernels
    last_cache = largest_cache()
    n_rows, n_cols = SHAPE
    x = np.zeros((1, n_cols), np.float32)
    result: dict = {"profile": PROFILE.key, "activations": activations, "formats": {}}
    for name in formats:
        qtype = gguf.GGMLQuantizationType[name]
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        # packed, not quants.zero_matrix: pages never written would all read the kernel's one zero page
        raw = np.zeros((n_rows, n_cols // block_len * block_bytes), np.uint8)
        first = replace(quants.pack([(raw, qtype, (n_rows, n_cols))]), activations=activations)
        copies = max(2, -(-2 * last_cache // first.nbytes))  # twice the cache, at least
        matrices = [first] + [
            replace(quants.pack([(raw, qtype, (n_rows, n_cols))]), activations=activations)
            for _ in range(copies - 1)
        ]
        streams = [np.ones((2, first.nbytes // 8), np.float32) for _ in matrices]  # as many bytes
        for w, s in zip(matrices, streams, strict=True):  # compiled, pages touched
            kernels.kernel_product(x, w)
            _stream_sum(s)
        ours, plain = [], []
        for _ in range(rounds):
            for w, s in zip(matrices, streams, strict=True):
                t = time.perf_counter()
                kernels.kernel_product(x, w)
                ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                _stream_sum(s)
                plain.append(time.perf_counter() - t)
        ours_gb_s = first.nbytes / np.array(ours) / 1e9
        plain_gb_s = streams[0].nbytes / np.array(plain) / 1e9
        result["formats"][name] = {
            "packed_mb": round(first.nbytes / 1e6, 1),
            "copies": copies,
            "product_gb_s": round(float(np.median(ours_gb_s)), 1),
            "stream_gb_s": round(float(np.median(plain_gb_s)), 1),
            "fraction": round(float(np.median(ours_gb_s / plain_gb_s)), 2),
        }
        del matrices, streams
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("both", "native", "avx2"), default="both")
    parser.add_argument("--formats", default="Q4_K,Q6_K", help="GGUF types, comma-separated")
    parser.add_argument("--activations", choices=("f32", "q8"), default="q8", help="the products' inputs")
    parser.add_argument("--rounds", type=int, default=6, help="passes over the copies")
    args = parser.parse_args()
    if args.profile != "both" and compiles_for(args.profile):
        result = measure(args.formats.split(","), args.activations, args.rounds)
        for name, f in result["formats"].items():
            print(
                f"{result['profile']} {name}: one row's product {f['product_gb_s']} GB/s, a plain read "
                f"{f['stream_gb_s']} GB/s, fraction {f['fraction']} (median of pairs; {f['copies']} copies "
                f"of {f['packed_mb']} MB)",
                file=sys.stderr,
            )
        print(json.dumps(result), flush=True)
        return 0
    out = []
    for profile in ("native", "avx2") if args.profile == "both" else (args.profile,):
        argv = [sys.executable, __file__, "--profile", profile, "--formats", args.formats]
        argv += ["--activations", args.activations, "--rounds", str(args.rounds)]
        done = subprocess.run(argv, env=our_env(profile), stdout=subprocess.PIPE, text=True, check=True)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps(out if args.profile == "both" else out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
