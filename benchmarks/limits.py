"""This machine's limits: how fast it reads memory, and how fast it runs the kernels' instructions.

    python benchmarks/limits.py [--threads 2] [--gb 2.1] [--repeats 5] [--no-bandwidth]

Read bandwidth: a streaming sum over a float32 array of --gb GB in RAM (far past every cache), each
thread over its own contiguous part (numba `prange`), with 1 thread and with --threads; the best of
--repeats passes. Decode reads every weight once a token, so this is its limit.

Peak rates, for the profile numba compiles for here (inference/cpu.py: the host, or NUMBA_CPU_NAME;
`NUMBA_CPU_NAME=haswell` gives the AVX2 profile): the float32 fused multiply-add on the profile's vectors,
and the 8-bit dot product the kernels use for `--activations q8` (cpu.byte_dot: AVX-512 VNNI's
`vpdpbusd`, else `vpmaddubsw` + `vpmaddwd` + add), emitted by the kernels' own builder
(vectors._byte_dot). Each runs as CHAINS independent sums held in registers, on every thread: nothing
but the instruction under test is in the loop (the dot products' unsigned side changes each turn by
one shared xor, so that LLVM cannot lift a product that takes no sum out of the loop). Prefill does
several rows a weight read, so its limit is this rate. An operation is a multiply or an add (a
multiply-add is 2), so float32 and 8-bit rates compare in one unit.

One JSON object on the last line (GB/s: 10⁹ bytes a second; GOP/s: 10⁹ operations a second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import llama_chat.inference.jit  # noqa: F401  numba compiles for the profile cpu.py read, as the kernels do
from llama_chat.inference.cpu import PROFILE
from llama_chat.inference.vectors import _byte_dot, _data, _splat

# Independent sums in flight per thread: more than latency × issue rate of a multiply-add (4 × 2) or
# of vpmaddubsw + vpmaddwd + add (11 × 1 per chain) on the cores we know, and few enough to stay in
# registers on AVX2's 16 (the two inputs take two more).
CHAINS = 12


@intrinsic
def _fma_chains(typingctx, count, x, out):
    """CHAINS sums of `count` fused multiply-adds each on vectors of the profile's floats (x · x + sum),
    added into out[:floats]."""
    n, f32 = PROFILE.vector_floats, ir.FloatType()

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(f32, n)
        a = _splat(builder, vector, args[1])
        b = _splat(builder, vector, builder.fmul(args[1], ir.Constant(f32, 0.5)))
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{n}f32"
        )
        sums = [
            cgutils.alloca_once_value(builder, ir.Constant(vector, [float(k)] * n)) for k in range(CHAINS)
        ]
        with cgutils.for_range(builder, args[0]):
            for slot in sums:  # a stack slot, which LLVM keeps in a register
                builder.store(builder.call(fma, [a, b, builder.load(slot)]), slot)
        _add_into(builder, _data(context, builder, signature.args[2], args[2]), sums)
        return context.get_dummy_value()

    return types.void(count, x, out), codegen


@intrinsic
def _byte_dot_chains(typingctx, count, seed, out):
    """CHAINS sums of `count` 8-bit dot products each (4 byte products into each 32-bit lane of the
    profile's vectors), as the kernels form them, added into out[:floats] (int32)."""
    n, i32, how = PROFILE.vector_floats, ir.IntType(32), PROFILE.byte_dot

    def codegen(context, builder, signature, args):
        words = ir.VectorType(i32, n)
        unsigned = _splat(builder, words, args[1])
        signed = [ir.Constant(words, [0x01020304 * (k + 1) & 0x7F7F7F7F] * n) for k in range(CHAINS)]
        sums = [cgutils.alloca_once_value(builder, ir.Constant(words, [k] * n)) for k in range(CHAINS)]
        with cgutils.for_range(builder, args[0]) as loop:
            turn = builder.xor(unsigned, _splat(builder, words, builder.trunc(loop.index, i32)))
            for slot, w in zip(sums, signed, strict=True):
                builder.store(_byte_dot(builder, how, builder.load(slot), turn, w), slot)
        _add_into(builder, _data(context, builder, signature.args[2], args[2]), sums)
        return context.get_dummy_value()

    return types.void(count, seed, out), codegen


def _add_into(builder, pointer, sums):
    """pointer[:n] += the sum of the vectors in the stack slots `sums`: every chain's result is used."""
    total = builder.load(sums[0])
    add = builder.fadd if isinstance(total.type.element, ir.FloatType) else builder.add
    for slot in sums[1:]:
        total = add(total, builder.load(slot))
    at = builder.bitcast(pointer, total.type.as_pointer())
    builder.store(add(builder.load(at, align=4), total), at, align=4)


@njit(parallel=True)
def _fma_on_threads(count, out):
    for t in prange(out.shape[0]):
        _fma_chains(count, np.float32(1e-3), out[t])


@njit(parallel=True)
def _byte_dots_on_threads(count, out):
    for t in prange(out.shape[0]):
        _byte_dot_chains(count, np.int32(0x05060708 + t), out[t])


@njit(parallel=True, fastmath=True)
def _stream_sum(parts):
    """Σ of every element, each thread over its own row (a contiguous part of the array)."""
    sums = np.zeros(parts.shape[0], dtype=np.float32)
    for t in prange(parts.shape[0]):
        total = np.float32(0.0)
        for i in range(parts.shape[1]):  # by index: contiguous vector loads (an iterator gathers)
            total += parts[t, i]
        sums[t] = total
    return sums.sum()


def best_seconds(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(data: np.ndarray, threads: int, repeats: int) -> float:
    """GB/s of the best streaming pass over `data` (1-D float32) on `threads` threads."""
    numba.set_num_threads(threads)
    parts = data[: data.size // threads * threads].reshape(threads, -1)
    _stream_sum(parts[:, :1024])  # compiles outside the timing
    return parts.nbytes / best_seconds(lambda: _stream_sum(parts), repeats) / 1e9


def peak_rate(
    on_threads, dtype, ops_per_turn: int, threads: int, repeats: int, turns: int = 20_000_000
) -> float:
    """GOP/s of `on_threads` on `threads` threads, CHAINS instructions a turn, `ops_per_turn` each."""
    numba.set_num_threads(threads)
    out = np.zeros((threads, PROFILE.vector_floats), dtype=dtype)
    on_threads(10, out)  # compiles outside the timing
    seconds = best_seconds(lambda: on_threads(turns, out), repeats)
    return threads * turns * CHAINS * ops_per_turn / seconds / 1e9


def instruction_peaks(threads: int, repeats: int) -> dict:
    """The peak rates of the profile's float32 multiply-add and 8-bit dot product, on 1 thread and on
    `threads` (the bare names: on `threads`)."""
    n = PROFILE.vector_floats
    result = {"profile": PROFILE.key, "isa": PROFILE.isa, "byte_dot": PROFILE.byte_dot}
    for count in sorted({1, threads}, reverse=True):
        suffix = "" if count == threads else f"_{count}_thread"
        fma = peak_rate(_fma_on_threads, np.float32, 2 * n, count, repeats)
        dots = peak_rate(_byte_dots_on_threads, np.int32, 2 * 4 * n, count, repeats)
        result |= {f"fma_gflop_s{suffix}": round(fma, 1), f"int8_gop_s{suffix}": round(dots, 1)}
    return result


def measure(threads: int, gb: float, repeats: int, bandwidth: bool = True) -> dict:
    result = {"threads": threads, **instruction_peaks(threads, repeats)}
    if bandwidth:
        data = np.ones(int(gb * 1e9) // 4, dtype=np.float32)  # every page touched before the timing
        speeds = {n: read_bandwidth(data, n, repeats) for n in sorted({1, threads})}
        result |= {f"bandwidth_{n}_thread{'s' * (n > 1)}_gb_s": round(v, 2) for n, v in speeds.items()}
        result["bandwidth_gb_s"] = round(speeds[threads], 2)
        result["bandwidth_array_gb"] = round(data.nbytes / 1e9, 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gb", type=float, default=2.1, help="the array read for the bandwidth (≥ 2 GB)")
    parser.add_argument("--repeats", type=int, default=5, help="passes timed; the best is kept")
    parser.add_argument("--no-bandwidth", action="store_true", help="only the instructions' peak rates")
    args = parser.parse_args()
    if args.threads < 1 or args.threads > numba.config.NUMBA_NUM_THREADS:
        parser.error(f"--threads must be between 1 and {numba.config.NUMBA_NUM_THREADS}, not {args.threads}")
    result = measure(args.threads, args.gb, args.repeats, not args.no_bandwidth)
    for key, value in result.items():
        print(f"{key:28}{value}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
