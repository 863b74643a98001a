"""Every format read in its own bits against llama.cpp, on tiny llamas (tests/tiny_formats.py; fixtures
tests/fixtures/llamacpp/formats.json and formats.npz, written by benchmarks/make_format_reference.py
with llama-cpp-python).

Its token embeddings in the format and every matrix float32, llama.cpp dequantizes a row as it is
(ggml's dequantize_row_*): our logits are its own to float rounding (measured: 4e-5 to 1.4e-4), so each
format's weights are ggml's. Every matrix in the format, llama.cpp multiplies by its inputs rounded to 8
bits (Q8_0, Q8_1 or Q8_K blocks; to 16 bits for F16 and BF16), which moves its logits 2 to 5 % of their
spread from the exact ones ours give under `--activations f32`: rounding our inputs as it does, in
NumPy, gives its logits to 2e-6 on the formats tried, or as near as one rounding flipped by a last-bit
difference leaves them (Q3_K 7.5e-3: noise of 1e-7 on our inputs moves it to 1e-6). Our "q8" rounds them as
Q8_0 and Q8_1 do but for their float16 scales, which brings the formats of 32-weight blocks twice as near
llama.cpp's; the K formats' Q8_K has a scale a block of 256. Our logits are compared with llama.cpp's
within each format's measured difference times about 1.5 (TOLERANCE, Q8_TOLERANCE), and the greedy
tokens llama.cpp chose by more than twice that margin must be ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_formats import FORMATS, format_model

from llama_chat.inference import load_model

LLAMACPP = Path(__file__).parent / "fixtures" / "llamacpp"
REFERENCE = json.loads((LLAMACPP / "formats.json").read_text())
LOGITS = np.load(LLAMACPP / "formats.npz")
# How far our logits may lie from llama.cpp's with every matrix in the format: the largest difference
# measured on the fixture's rows (in parentheses) times about 1.5, under `--activations f32` and, for the
# formats whose products then take bytes, "q8". The logits' spread (their standard deviation over the
# vocabulary) is 0.3 to 0.6 (Q4_K, Q5_K: 1.7), so these are 1 to 7 % of it (F16 0.1 %, BF16 1 %).
TOLERANCE = {
    "Q4_0": 0.011,  # (0.0070)
    "Q4_1": 0.009,  # (0.0057)
    "Q5_0": 0.009,  # (0.0058)
    "Q5_1": 0.01,  # (0.0066)
    "Q8_0": 0.011,  # (0.0069)
    "Q2_K": 0.017,  # (0.011)
    "Q3_K": 0.026,  # (0.017)
    "Q4_K": 0.012,  # (0.0078)
    "Q5_K": 0.01,  # (0.0066)
    "Q6_K": 0.026,  # (0.017)
    "IQ4_NL": 0.033,  # (0.022)
    "IQ4_XS": 0.02,  # (0.013)
    "IQ2_XXS": 0.017,  # (0.011)
    "IQ2_XS": 0.018,  # (0.012)
    "IQ2_S": 0.018,  # (0.012)
    "IQ3_XXS": 0.017,  # (0.011)
    "IQ3_S": 0.018,  # (0.012)
    "IQ1_S": 0.023,  # (0.015)
    "IQ1_M": 0.029,  # (0.019)
    "TQ1_0": 0.014,  # (0.0092)
    "TQ2_0": 0.014,  # (0.0092)
    "MXFP4": 0.011,  # (0.0070)
    "NVFP4": 0.009,  # (0.0060)
    "Q1_0": 0.008,  # (0.0054)
    "F16": 0.0004,  # (0.00023)
    "BF16": 0.0032,  # (0.0021)
}
# "q8": nearer llama.cpp's than f32 where it rounds the inputs as llama.cpp does (Q8_0's and Q8_1's runs
# of 32, for the formats of 32-weight blocks), about as far for the K formats (its Q8_K: runs of 256).
Q8_TOLERANCE = {
    "Q4_0": 0.006,  # (0.0037)
    "Q4_1": 0.005,  # (0.0033)
    "Q5_0": 0.0045,  # (0.0028)
    "Q5_1": 0.0055,  # (0.0037)
    "Q8_0": 0.005,  # (0.0032)
    "Q4_K": 0.02,  # (0.013)
    "Q5_K": 0.014,  # (0.0093)
    "Q6_K": 0.03,  # (0.020)
}
EXACT_WEIGHTS = 5e-4  # the embeddings' check: float rounding only
NAMES = [qtype.name for qtype in FORMATS]


def test_every_format_has_its_llamacpp_reference():
    """A format added to tiny_formats.FORMATS is checked once the script has run again."""
    assert list(REFERENCE["formats"]) == NAMES
    assert sorted(TOLERANCE) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_formats_weights_are_llamacpps(tmp_path, name):
    path = format_model(tmp_path / f"{name}.gguf", FORMATS[NAMES.index(name)], embeddings=True)
    model = load_model(path, cache_type="f32", activations="f32")
    expected = LOGITS[f"{name}.embeddings"]
    logits = model.logits(REFERENCE["text_ids"])[-len(expected) :]
    assert np.abs(logits - expected).max() <= EXACT_WEIGHTS


@pytest.mark.parametrize(
    "name, activations", [(name, "f32") for name in NAMES] + [(name, "q8") for name in Q8_TOLERANCE]
)
def test_a_model_in_a_format_gives_llamacpps_logits_and_greedy_tokens(tmp_path, name, activations):
    """The last rows of the text's logits within the format's tolerance and, where llama.cpp's two best
    tokens lie more than twice it apart, its best token; then its greedy reply token by token (each step
    fed llama.cpp's token), ours the same wherever its margin is as clear."""
    path = format_model(tmp_path / f"{name}.gguf", FORMATS[NAMES.index(name)])
    model = load_model(path, cache_type="f32", activations=activations)
    ref, tolerance = REFERENCE["formats"][name], (TOLERANCE if activations == "f32" else Q8_TOLERANCE)[name]
    expected = LOGITS[f"{name}.matrices"]
    logits = model.logits(REFERENCE["text_ids"])[-len(expected) :]
    assert np.abs(logits - expected).max() <= tolerance
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tolerance
    assert (logits.argmax(axis=1) == expected.argmax(axis=1))[clear].all()
    prompt = REFERENCE["prompt_ids"]
    seq = model.new_sequence(len(prompt) + len(ref["greedy_ids"]))
    row = model.forward(prompt, seq)[-1]
    ours = []
    for token in ref["greedy_ids"]:
        ours.append(int(np.argmax(row)))
        row = model.forward([token], seq)[-1]
    clear = np.array(ref["margins"]) > 2 * tolerance
    assert np.array(ours)[clear].tolist() == np.array(ref["greedy_ids"])[clear].tolist()
    assert clear.sum() >= len(clear) // 6  # (Q4_0's reply repeats a token that another nearly ties)
