"""The machine the kernels are compiled for: its vector registers, and from them the kernels' shape and
the thresholds tuned for it. One profile per process, read before anything compiles (jit.py).

What numba targets is the host's processor, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES where they are
set: `NUMBA_CPU_NAME=haswell` alone gives AVX2 code on any x86 machine (the features are then the
named processor's own, not the host's), which is how AVX2 is checked on an AVX-512 machine. The
vector width is what LLVM makes of a 16-float vector for that target, so no table of processor names
is needed.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from llvmlite import binding as llvm

# Floats per register and how many registers, by the register LLVM picks for a 16-float vector:
# AVX-512 32 × zmm, AVX2 16 × ymm, SSE 16 × xmm, NEON 32 × v (128 bits).
REGISTER_FILES = {
    "zmm": ("AVX-512", 16, 32),
    "ymm": ("AVX2", 8, 16),
    "xmm": ("SSE", 4, 16),
    "v": ("NEON", 4, 32),
}

# The kernels' shapes, (LANES, ROWS, PASS_LANES): LANES rows of the matrix interleaved in the packed
# layout, across which one or two input rows run; past two, passes of ROWS input rows across PASS_LANES
# of them (a part of LANES). A shape fits a register file when the partial sums of a pass (rows ×
# lanes / width vectors), a vector of weights per lane vector and a broadcast input fit (kernel_shape).
# Among those that fit, the first of this list is taken: measured best first (benchmarks/kernel_rows.py;
# the figures in docs/performance.md, "Kernel shapes"). One input row needs LANES / width ≥ 4 sums in
# flight to hide a fused multiply-add's latency, several rows want passes whose sums leave registers
# for the weights: so AVX2 interleaves 32 rows and multiplies 4 input rows across 16 of them at a time.
SHAPES = ((64, 4, 64), (32, 4, 16), (16, 4, 8), (8, 4, 4))

# From this many cached positions one token's attention goes to the compiled kernel (forward.py), which
# reads the float16 cache where BLAS needs it copied into float32 first; each call of the kernel wakes
# numba's threads, so on a short history BLAS is the faster (docs/performance.md, "Decode over a long
# history").
KERNEL_ATTENTION_FROM = 256
# From this many query rows × cached positions a step of the kernels splits its attention over the
# threads (kernels.attention_threads): below it, handing work to a thread costs more than it saves.
PARALLEL_ATTENTION_FROM = 8192
# From this many bytes of weights a product of one row splits over numba's threads. Those sleep between
# kernels (docs/performance.md, "Threads"), and waking one takes ~0.1 ms on a virtual machine's vCPU,
# longer than the calling thread alone takes to read a smaller matrix (a 0.5B's attention matrices,
# 0.9 MB; a 7B's keys, 1.06 MB, were slower alone).
PARALLEL_PRODUCT_FROM = 1 << 20
# From this many multiply-adds of scores (query heads × head size × cached positions, all of a step's
# new tokens together) their attention splits over numba's threads, for the same reason: with fewer the
# calling thread alone is done sooner (the default model's 2,048 positions, a 7B's 512: docs/
# performance.md, "Threads").
PARALLEL_TOKEN_ATTENTION_FROM = 1 << 21
# From this many input numbers quantize_rows runs on numba's threads: waking them costs more than
# quantizing a few rows takes.
QUANTIZE_IN_PARALLEL_FROM = 1 << 16
# How far ahead of their reading the kernels ask for weights (vectors._prefetch): the processor's own
# prefetcher follows a stream only within a 4 KB page and starts over at the next one; half a page
# ahead covers the memory's latency at the rate a kernel reads (nearer and farther measured no better).
PREFETCH_BYTES = 2048
# Into which caches the kernels ask for weights (llvm.prefetch's locality: 3 every level, prefetcht0; 1
# the L2 and beyond, prefetcht2), by the processor's maker. On an AMD EPYC (Zen 4) asks into L1 took the
# load buffers a kernel's own reads wait on: Q6_K's one-row product read 7–9 GB/s from RAM on one thread
# with them, 20 asking into L2 (Q4_K, int8 alike either way); the Intel Xeons were tuned asking into L1
# (docs/performance.md, "Weights asked for ahead").
ASK_INTO = {"AuthenticAMD": 1}


@dataclass(frozen=True)
class Profile:
    cpu_name: str  # what numba compiles for
    features: str = field(repr=False)  # LLVM's "+avx2,-avx512f,..." ("": the named processor's own)
    isa: str  # "AVX-512", "AVX2", "SSE", "NEON"
    vector_floats: int  # float32 numbers per vector register
    vector_registers: int
    lanes: int  # rows interleaved in the packed layout: the kernels' vector lanes run across them
    rows: int  # input rows whose partial sums stay in registers for a pass over the weights
    pass_lanes: int  # the lanes of such a pass (LANES in passes of PASS_LANES)
    tile_bytes: int  # float32 tile dequantized for BLAS: half the core's L2, so sgemm reads it from there
    kernel_attention_from: int
    parallel_attention_from: int
    byte_dot: str = "generic"  # how 8-bit inputs meet weights (byte_dot(); byte_vectors.py)
    quantize_in_parallel_from: int = QUANTIZE_IN_PARALLEL_FROM
    prefetch_bytes: int = PREFETCH_BYTES  # how far ahead the kernels ask for weights
    ask_into: int = 3  # the caches they ask into (ASK_INTO)

    @property
    def ahead_in_passes(self) -> bool:
        """Whether passes of more than two input rows ask for their weights ahead (in the first pass over
        a group only): where a pass covers the whole group. In passes over part of a group the requests
        cost more than they save (docs/performance.md, "Weights asked for ahead"); one or two rows
        always ask."""
        return self.pass_lanes == self.lanes

    @property
    def key(self) -> str:
        """Names what compiled code and packed weights depend on: a cache folder of its own."""
        isa = self.isa.lower().replace("-", "")
        return f"{self.cpu_name}-{isa}-{self.lanes}-{self.rows}x{self.pass_lanes}"

    def describe(self) -> str:
        return (
            f"{self.isa} ({self.cpu_name}: {self.vector_registers} registers of {self.vector_floats} floats),"
            " "
            f"kernels of {self.lanes} lanes, passes of {self.rows} rows × {self.pass_lanes} lanes"
        )


def target() -> tuple[str, str]:
    """The processor name and features numba compiles for (jit.py hands the features to numba)."""
    name = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features is None:
        # A named processor brings its own features; the host's, with AVX-512, would undo the name.
        features = "" if os.environ.get("NUMBA_CPU_NAME") else llvm.get_host_cpu_features().flatten()
        if platform.machine().lower() in ("x86_64", "amd64"):
            # LLVM tunes recent Intel cores to prefer 256-bit vectors even where AVX-512 exists: the
            # kernels' partial sums, sized for 32 512-bit registers, then spilled (a third of the speed).
            features = ",".join(f for f in (features, "-prefer-256-bit") if f)
    return name, features


def register_file(name: str, features: str) -> tuple[str, int, int]:
    """(ISA, floats per vector, vector registers) of a target, from the register LLVM gives a 16-float
    vector in the target's own code."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly(
        "define <16 x float> @f(<16 x float> %a) {\n %b = fadd <16 x float> %a, %a\n ret <16 x float> %b\n}"
    )
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=name, features=features)
    code = machine.emit_assembly(module)
    for register in REGISTER_FILES:
        if re.search(rf"\b%?{register}\d+\b" if register != "v" else r"\bv\d+\.4s\b", code):
            return REGISTER_FILES[register]
    return REGISTER_FILES["xmm"]


def kernel_shape(vector_floats: int, vector_registers: int) -> tuple[int, int, int]:
    """(LANES, ROWS, PASS_LANES): the first of SHAPES whose passes fit the registers, two input rows
    across LANES and ROWS across PASS_LANES: their partial sums, a vector of weights per lane vector
    and a broadcast input, which LLVM keeps live across the innermost loop without spilling."""
    override = os.environ.get("LLAMA_CHAT_KERNEL_SHAPE")  # "LANESxROWSxPASS_LANES": to measure others
    if override:
        lanes, rows, *pass_lanes = (int(n) for n in override.lower().split("x"))
        return lanes, rows, (pass_lanes or [lanes])[0]

    def fits(rows: int, lanes: int) -> bool:
        vectors = lanes // vector_floats
        return lanes % vector_floats == 0 and rows * vectors + vectors + 1 <= vector_registers

    for lanes, rows, pass_lanes in SHAPES:
        if fits(2, lanes) and fits(rows, pass_lanes):
            return lanes, rows, pass_lanes
    return SHAPES[-1]


def byte_dot(isa: str, features: str) -> str:
    """The instructions that multiply bytes of weights by bytes of activations, 4 to a 32-bit lane, into
    32-bit sums: "vnni" (AVX-512 VNNI's vpdpbusd, 64 products an instruction), "bw" (AVX-512 BW's
    vpmaddubsw and vpmaddwd), "avx2" (the same on 256 bits), else "generic" (shifts and multiplies
    LLVM vectorizes as it can). A named processor without features (NUMBA_CPU_NAME alone) gets the
    ISA's baseline."""
    if isa == "AVX-512":
        return "vnni" if "+avx512vnni" in features.split(",") else "bw"
    return "avx2" if isa == "AVX2" else "generic"


def vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The processor's maker as the kernel names it ("GenuineIntel", "AuthenticAMD"; "" where unknown)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    found = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.MULTILINE)
    return found.group(1) if found else ""


def l2_bytes() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        return 1 << 20


def read_profile() -> Profile:
    name, features = target()
    isa, floats, registers = register_file(name, features)
    lanes, rows, pass_lanes = kernel_shape(floats, registers)
    return Profile(
        name, features, isa, floats, registers, lanes, rows, pass_lanes, l2_bytes() // 2,
        KERNEL_ATTENTION_FROM, PARALLEL_ATTENTION_FROM, byte_dot(isa, features),
        ask_into=ASK_INTO.get(vendor(), 3),
    )


PROFILE = read_profile()
