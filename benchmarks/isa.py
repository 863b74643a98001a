"""The instruction sets the benchmarks compare on one machine: how each engine is built or run for each.

`native`: everything this CPU has. `avx2`: what a machine without AVX-512 has (Haswell and later, Zen 1
to 3), emulated on a newer one: numba compiles for a Haswell with no AVX-512 features (in its own
kernel cache folder, so the two never mix) and llama.cpp is built with AVX2 and no AVX-512.
"""

from __future__ import annotations

import os
from pathlib import Path

ISAS = ("native", "avx2")

# llama.cpp built for AVX2 machines (cmake options, as CMAKE_ARGS for `pip install llama-cpp-python`).
AVX2_CMAKE_ARGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF",
]

# ggml's cmake options for x86 extensions and the /proc/cpuinfo flags each needs. AMX is left out on
# purpose: a VM may list AMX flags that its CPU then refuses to run (SIGILL).
GGML_X86_OPTIONS = {
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "BMI2": ("bmi2",),
    "FMA": ("fma",),
    "F16C": ("f16c",),
    "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
}

def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields = dict(line.partition(":")[::2] for line in text.splitlines()[:30] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name", "unknown CPU")
    return f"{name} (family {fields.get('cpu family')}, model {fields.get('model')})"


def llama_cpp_cmake_args(isa: str) -> list[str]:
    """cmake options that build llama.cpp for `isa` on this machine: for native, every extension in
    GGML_X86_OPTIONS this CPU lists (no AMX), named one by one rather than -march=native."""
    if isa == "avx2":
        return list(AVX2_CMAKE_ARGS)
    flags = cpu_flags()
    if not flags:  # not Linux on x86: let ggml find out
        return ["-DGGML_NATIVE=ON"]
    on = [option for option, needs in GGML_X86_OPTIONS.items() if all(flag in flags for flag in needs)]
    return [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{option}={'ON' if option in on else 'OFF'}" for option in GGML_X86_OPTIONS),
    ]


def compiles_for(isa: str) -> bool:
    """Whether this process's kernels are compiled for `isa` (as our_env runs them)."""
    return (os.environ.get("NUMBA_CPU_NAME") == "haswell") == (isa == "avx2")


def our_env(isa: str, base: dict | None = None) -> dict:
    """The environment that runs llama-chat's kernels compiled for `isa` (native: unchanged). A named
    processor alone brings its own features (inference/cpu.py), and each profile compiles into its own
    cache folder, so `NUMBA_CPU_NAME=haswell` is all the AVX2 profile needs."""
    env = dict(os.environ if base is None else base)
    if isa == "native":
        return env
    env.pop("NUMBA_CPU_FEATURES", None)
    env["NUMBA_CPU_NAME"] = "haswell"
    return env
