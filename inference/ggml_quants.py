"""gguf.quants with what it lacks of ggml's formats, ported from llama.cpp's ggml-quants.c line by line:
Q1_0 read and written (dequantize_row_q1_0, quantize_row_q1_0_ref) and NVFP4 written
(quantize_row_nvfp4_ref; gguf.quants reads it). dequantize and quantize take and give what
gguf.quants' own do, so every reader of a GGUF's bytes goes through them.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
F32 = np.float32
Q1_0_BLOCK, Q1_0_BYTES = gguf.GGML_QUANT_SIZES[Q.Q1_0]  # 128 weights: a float16 d, then a bit each
NVFP4_BLOCK, NVFP4_BYTES = gguf.GGML_QUANT_SIZES[Q.NVFP4]  # 64 weights: 4 UE4M3 scales, 32 bytes of e2m1
NVFP4_SUB = 16  # weights a scale
E2M1_VALUES = np.array(gguf.quants.NVFP4.kvalues, F32)  # doubled: ggml_ue4m3_to_fp32 halves the scale


def dequantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [..., weights a row] of GGUF bytes [..., bytes a row] in `qtype`, as ggml reads them."""
    if qtype == Q.Q1_0:
        return _dequantize_q1_0(data)
    return gguf.quants.dequantize(data, qtype)


def quantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    """GGUF bytes [..., bytes a row] of float32 [..., weights a row] in `qtype`, as ggml writes them."""
    if qtype == Q.Q1_0:
        return _quantize_blocks(data, Q1_0_BLOCK, _q1_0_blocks)
    if qtype == Q.NVFP4:
        return _quantize_blocks(data, NVFP4_BLOCK, _nvfp4_blocks)
    return gguf.quants.quantize(data, qtype)


def _dequantize_q1_0(data: np.ndarray) -> np.ndarray:
    """dequantize_row_q1_0: weight j of a block is d where bit j % 8 of byte j / 8 is set, else −d."""
    blocks = np.ascontiguousarray(data, np.uint8).reshape(-1, Q1_0_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(F32)  # [n, 1]
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little").astype(bool)  # [n, 128]
    return np.where(bits, d, -d).reshape(*data.shape[:-1], -1)


def _quantize_blocks(data: np.ndarray, block_len: int, quantize_blocks) -> np.ndarray:
    blocks = np.asarray(data, F32).reshape(-1, block_len)
    return quantize_blocks(blocks).reshape(*data.shape[:-1], -1)


def _q1_0_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q1_0_ref: d the mean of |x| (summed in float32 in order, as the C loop), a bit set
    for each x ≥ 0."""
    d = (np.cumsum(np.abs(x), axis=1, dtype=F32)[:, -1:] / F32(Q1_0_BLOCK)).astype(np.float16)
    bits = np.packbits(x >= 0, axis=1, bitorder="little")
    return np.concatenate([d.view(np.uint8), bits], axis=1)


def _nvfp4_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_nvfp4_ref: each 16 weights' scale the UE4M3 of their largest |x| / 6 (ggml_fp32_to_ue4m3:
    gguf.quants'), each weight the e2m1 value nearest x / scale (the first of equals: best_index_mxfp4);
    byte j of a sub-block holds weight j in its low nibble and weight 8 + j in its high one."""
    sub = x.reshape(-1, NVFP4_SUB)  # [n blocks · 4, 16]
    scales = gguf.quants.NVFP4.fp32_to_ue4m3(np.abs(sub).max(axis=1) / F32(6))
    d = np.asarray(gguf.quants.NVFP4.ue4m3_to_fp32(scales), F32)
    errors = np.abs(E2M1_VALUES[None, None, :] * d[:, None, None] - sub[:, :, None])  # [n · 4, 16, 16]
    best = np.argmin(errors, axis=2).astype(np.uint8)
    qs = best[:, : NVFP4_SUB // 2] | (best[:, NVFP4_SUB // 2 :] << 4)  # [n · 4, 8]
    n = len(x)
    return np.concatenate([scales.astype(np.uint8).reshape(n, -1), qs.reshape(n, -1)], axis=1)
