"""The tiny models checked against llama.cpp in each format read in its own bits: test_formats' llama,
256 wide (the K and IQ formats' blocks of 256 weights), every layer matrix and the output in the format,
and its twin with only the token embeddings in it (tests/fixtures/llamacpp/formats.json and .npz,
written by benchmarks/make_format_reference.py; tests/test_llamacpp_formats.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
from test_formats import tiny_model_in
from test_kernels import SCALE_BYTES

T = gguf.GGMLQuantizationType
# Every format read in its own bits (inference/formats.py): one checked against llama.cpp once it is
# here and benchmarks/make_format_reference.py has run again.
FORMATS = (
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS,
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
    T.TQ1_0, T.TQ2_0,
    T.MXFP4, T.NVFP4, T.Q1_0,
    T.F16, T.BF16,
)  # fmt: skip
# The weights gguf.quants quantizes, a tenth of test_formats' (a standard deviation of 0.02, as in its
# random blocks): larger, the products grow through the layers and llama.cpp's 8-bit inputs move its
# logits by more of their spread (2 to 5 % here, 5 to 30 % with weights three times these), which leaves
# fewer of its greedy tokens clear of that difference.
GAIN = 0.1


def format_model(path: Path, qtype: T, embeddings: bool = False) -> Path:
    """The tiny llama of a format, byte for byte the same from the same seed; `embeddings`: the one with
    its token embeddings in the format and every matrix in float32, which llama.cpp reads as it
    dequantizes (no 8-bit inputs): its logits check a format's weights to float rounding."""
    gain = 1.0 if qtype in SCALE_BYTES else GAIN
    return tiny_model_in(path, qtype, gain=gain, embeddings=embeddings)
