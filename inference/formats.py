"""Which kind of packed matrix each GGUF format makes, and the arrays (shape, dtype) each kind packs into.

The integer formats of ggml with a scale per 16 or 32 weights (Q4_0 … Q8_0, Q5_K, Q6_K) unpack to
int8 with float32 scales (quants.py) and join each other in one matrix. Formats kept in their own bits
never join another format: Q4_K and, on a processor with VNNI, Q6_K (k_quants.py; own_bits), float16
and bfloat16 (their 16 bits, which the kernels widen), and the block formats (block_formats.py: Q2_K,
Q3_K, the IQ and TQ formats, MXFP4, NVFP4, Q1_0, the GGUF's blocks as they are). A matrix whose parts
differ there (q/k in Q3_K beside a Q5_K v) is a StackedMatrix of runs, each packed on its own. Any
other format (F32, the formats read only by gguf.quants) makes the whole matrix float32.
"""

from __future__ import annotations

import gguf
import numpy as np

from . import k_quants
from .block_formats import BLOCK_FORMATS, PACKED_BYTES
from .cpu import PROFILE
from .half import NATIVE

Q = gguf.GGMLQuantizationType
LANES = PROFILE.lanes
F32 = np.float32

INTEGER_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
GROUP = {Q.Q6_K: 16}  # weights per scale; 32 for every other integer format
HAS_OFFSETS = (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K)
# The integer formats whose weights as int8 (quants.py) lie within ±32 — all but Q8_0, whose bytes are its
# weights: a product of bytes without VNNI adds their 16-bit sums over several words (PackedMatrix.small)
SMALL = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The 16-bit floats as the kernels read them: float16 as uint16 bits, bfloat16 as int16 bits (numba has
# neither type: the dtype tells the kernels which they are). Without F16C (the "SSE" profile) a kernel
# cannot widen float16 in one instruction: there float16 matrices stay float32.
HALF_TYPES = {Q.F16: np.uint16, Q.BF16: np.int16} if NATIVE else {Q.BF16: np.int16}
# Q6_K keeps its bits (k_quants.py) where its one-row kernel waits on memory: it reads 212 bytes per 256
# weights where int8 reads 320. With AVX-512 VNNI's vpdpbusd a 7B's decoded token took 0.87-0.91 of the
# time; with AVX2's vpmaddubsw, since the one-row kernel goes through a half block's sub-blocks in turn,
# 169-173 ms against 180-203 (the Zen 4, `decode_matrices.py`: its ffn_down 47-48 ms against 56-62). A
# long prompt makes the bits int8 a group at a time (products.Q6_K_TILES_FROM). AVX-512 without VNNI
# ("bw") is unmeasured and stays int8. A model with int8 matrices anyway keeps its Q6_K in int8 too
# (own_bits).
Q6_K_IN_BITS = PROFILE.byte_dot in ("vnni", "avx2")
# The formats kept in their own bits, each the kind of packed matrix it makes
OWN_BITS = {
    Q.Q4_K: "Q4_K weights",
    **({Q.Q6_K: "Q6_K weights"} if Q6_K_IN_BITS else {}),
    **{qtype: f"{qtype.name} weights" for qtype in HALF_TYPES},
    **{qtype: f"{qtype.name} blocks" for qtype in BLOCK_FORMATS},
}
# The kinds of packed matrix, each with a format of that kind: the kernels compile once per kind, not
# per format (the block formats share one kernel: a matrix's block size tells it the format).
KINDS = {
    Q.Q8_0: "integer weights", Q.Q4_1: "integer weights with offsets", **OWN_BITS, Q.F32: "float weights"
}


def own_bits(type_names) -> dict:
    """The formats a model kept in their own bits, from its tensors' type names: OWN_BITS, less Q6_K where
    the model has matrices in int8 anyway (Q5_0, Q8_0…, as small models whose widths are not multiples
    of 256 have): there Q6_K is a small share of the bytes, and in its bits a kind of kernel more for a
    first start to compile (3 s of the default model's, which decoded no faster: docs/performance.md)."""
    formats = {Q[name] for name in type_names if name in Q.__members__}
    if Q.Q6_K in OWN_BITS and formats & (set(INTEGER_FORMATS) - set(OWN_BITS)):
        return {qtype: kind for qtype, kind in OWN_BITS.items() if qtype != Q.Q6_K}
    return OWN_BITS


def kinds_of(formats: set, own: dict = OWN_BITS) -> set[str]:
    """The kinds of packed matrix that parts of these formats make, one per part pack makes (`own`: the
    formats kept in their own bits, own_bits)."""
    if formats - set(INTEGER_FORMATS) - set(own):
        return {"float weights"}
    kept, rest = formats & set(own), formats - set(own)
    return {own[qtype] for qtype in kept} | ({kind_of(rest, own)} if rest else set())


def kind_of(formats: set, own: dict = OWN_BITS) -> str:
    """The kind of packed matrix that parts of these formats make, joined in one (pack_one decides by it):
    a format of its own bits alone keeps them; joined with others, only integer formats stay integers."""
    if len(formats) == 1 and next(iter(formats)) in own:
        return own[next(iter(formats))]
    if formats - set(INTEGER_FORMATS):
        return "float weights"
    return "integer weights with offsets" if formats & set(HAS_OFFSETS) else "integer weights"


def kind_taken(formats: set, inputs: str, own: dict = OWN_BITS) -> str:
    """The kind of packed matrix that products with these inputs ("f32" or "q8") read for parts of these
    formats joined in one: kind_of's, but Q6_K, packed in its own bits, taken as int8 by float32 inputs
    (quants.for_inputs)."""
    kind = kind_of(formats, own)
    return "integer weights" if kind == "Q6_K weights" and inputs == "f32" else kind


def runs_of(parts: list, own: dict = OWN_BITS) -> list[list]:
    """Tensors to be stacked ((…, type, shape), as quants.pack's parts) in runs of consecutive parts of one
    format kept in its own bits, and of the others: a StackedMatrix's parts."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        if own.get(part[1]) == own.get(runs[-1][-1][1]):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def layout(
    formats: set, n_rows: int, n_cols: int, own: dict = OWN_BITS
) -> list[tuple[tuple[int, ...], type] | None]:
    """The arrays (shape, dtype) that a matrix of parts in these formats packs into: values, scales and
    offsets, None where it has none (pack allocates them; packed_file.py reserves their room)."""
    groups = -(-n_rows // LANES)
    kind = kind_of(formats, own)
    if kind == "float weights":
        return [((groups, n_cols, LANES), F32), None, None]
    if kind == "Q4_K weights":
        return k_quants.layout(groups, n_cols)
    if kind == "Q6_K weights":
        return k_quants.q6_k_layout(groups, n_cols)
    (qtype,) = formats if len(formats) == 1 else (None,)
    if qtype in HALF_TYPES:
        return [((groups, n_cols, LANES), HALF_TYPES[qtype]), None, None]
    if qtype in BLOCK_FORMATS:
        block_len = gguf.GGML_QUANT_SIZES[qtype][0]
        return [((groups, n_cols // block_len, PACKED_BYTES[qtype], LANES), np.uint8), None, None]
    scales = ((groups, n_cols // min(GROUP.get(q, 32) for q in formats), LANES), F32)
    offsets = scales if kind == "integer weights with offsets" else None
    return [((groups, n_cols, LANES), np.int8), scales, offsets]
