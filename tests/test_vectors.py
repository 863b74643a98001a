"""The kernels' building blocks and kernels against their plain NumPy references (as ggml tests each
`arch/x86` kernel against its `*_generic` twin): each LLVM intrinsic of vectors.py and byte_vectors.py
against vectors_reference.py, bit for bit, and the products, inputs as bytes and attention against
the references beside them."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from functools import partial

import gguf
import numpy as np
import pytest
from numba import carray, literally
from numba import njit as plain_njit
from test_kernels import q6_k_in_bits, raw_tensor

from llama_chat.inference import activations, attention, products, quants
from llama_chat.inference import vectors_reference as ref
from llama_chat.inference.attention_vectors import (
    _add_rows,
    _block_scores,
    _largest,
    _tile_add,
    _tile_scores,
    _widen,
)
from llama_chat.inference.block_vectors import (
    _column_multiply_add,
    _e8m0_halves,
    _scaled_multiply_add,
    _sign_bit_scales,
)
from llama_chat.inference.byte_vectors import (
    _byte_column_dots,
    _nibble_dots,
    _nibble_pair_dots,
    _q6_k_half_dots,
    _q6_k_sub_block_dots,
    in_lane_order,
)
from llama_chat.inference.k_quants import Q6_K_ASK_AHEAD
from llama_chat.inference.vectors import (
    _bit_fields,
    _dequantize_column,
    _dequantize_nibbles,
    _multiply_add,
    _nibbles,
    _q3_k_quants,
    _q4_k_scales,
    _q6_k_column,
    _q6_k_int8_columns,
    _q6_k_int8_scales,
    _q6_k_scales,
    _registers,
    _scale_run,
    _table_fields,
)

T = gguf.GGMLQuantizationType
F32 = np.float32
W = 16  # lanes an intrinsic works across in these checks (one AVX-512 register, two AVX2 ones)
W2, W3 = 2 * W, 3 * W  # (literals for numba, as _registers wants them)
LANES = products.LANES  # rows interleaved in the packed layouts the intrinsics read


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def floats(n: int, seed: int = 0) -> np.ndarray:
    return rng(seed).standard_normal(n).astype(F32)


@plain_njit
def copy_out(registers, out):
    view = carray(registers, out.size)
    for k in range(out.size):
        out[k] = view[k]


@plain_njit
def dequantize_column(values, scales, offsets, at, scale_at, out):
    w = _registers(W)
    _dequantize_column(values, scales, offsets, at, scale_at, w, W)
    copy_out(w, out)


@pytest.mark.parametrize("kind", ["int8, scales, offsets", "int8, scales", "float32", "float16", "bfloat16"])
def test_a_column_is_dequantized_as_the_reference_says(kind):
    values = rng().integers(-128, 128, 4 * LANES).astype(np.int8)
    scales, offsets = floats(2 * LANES, 1), floats(2 * LANES, 2)
    if kind == "float32":
        values, scales, offsets = floats(4 * LANES, 3), None, None
    elif kind in ("float16", "bfloat16"):  # their bits, every pattern (NaN and infinities too)
        values = rng().integers(0, 1 << 16, 4 * LANES).astype(np.uint16)
        values, scales, offsets = values.view(np.int16) if kind == "bfloat16" else values, None, None
    elif kind == "int8, scales":
        offsets = None
    out = np.empty(W, F32)
    dequantize_column(values, scales, offsets, 37, 5, out)
    with np.errstate(invalid="ignore"):
        expected = ref.dequantize_column(values, scales, offsets, 37, 5, W)
    assert np.array_equal(out, expected, equal_nan=True)


@plain_njit
def multiply_add(sums, w, xj):
    registers, column = _registers(W2), _registers(W)
    view, weights = carray(registers, 2 * W), carray(column, W)
    for k in range(2 * W):
        view[k] = sums[k]
    for k in range(W):
        weights[k] = w[k]
    _multiply_add(registers, 1, column, xj, W)
    copy_out(registers, sums)


def test_a_multiply_add_is_fused_as_the_reference_says():
    sums, w = floats(2 * W, 1), floats(W, 2)
    want = sums.copy()
    ref.multiply_add(want, 1, w, F32(0.3), W)
    multiply_add(sums, w, F32(0.3))
    assert np.array_equal(sums, want)


def q4_k(seed: int = 0):
    """A Q4_K matrix of LANES rows packed in k_quants' layout."""
    shape = (LANES, 512)
    raw = rng(seed).integers(0, 256, (shape[0], 2 * 144), dtype=np.uint8)
    d_dmin = (rng(seed + 1).random((shape[0] * 2, 2)) * 0.02).astype(np.float16)
    raw.reshape(-1, 144)[:, 0:4] = d_dmin.view(np.uint8)
    return quants.pack([(raw, T.Q4_K, shape)])


@plain_njit
def bit_fields(values, at, shift, mask, out):
    w = _registers(W)
    _bit_fields(values, at, shift, mask, w, W)
    copy_out(w, out)


@pytest.mark.parametrize("shift, mask", [(0, 3), (6, 3), (5, 1), (4, 15)])
def test_a_bit_field_of_bytes_is_read_as_the_reference_says(shift, mask):
    """The fields the block formats' decoders take out of their bytes (block_formats.py): Q2_K's and
    Q3_K's 2-bit quants, Q3_K's high bits, a nibble."""
    values = rng().integers(0, 256, (2, 3, LANES), dtype=np.uint8)
    out = np.empty(W, F32)
    bit_fields(values, 37, shift, mask, out)
    assert np.array_equal(out, ref.bit_fields(values, 37, shift, mask, W))


@plain_njit
def q3_k_quants(values, low_at, shift, high_at, bit, out):
    w = _registers(W)
    _q3_k_quants(values, low_at, shift, high_at, bit, w, W)
    copy_out(w, out)


@pytest.mark.parametrize("shift, bit", [(0, 0), (6, 7), (2, 5)])
def test_q3_k_quants_are_read_as_the_reference_says(shift, bit):
    values = rng().integers(0, 256, (2, 3, LANES), dtype=np.uint8)
    out = np.empty(W, F32)
    q3_k_quants(values, 37, shift, 101, bit, out)
    assert np.array_equal(out, ref.q3_k_quants(values, 37, shift, 101, bit, W))


@plain_njit
def table_fields(values, at, shift, table, out):
    w = _registers(W)
    _table_fields(values, at, shift, table, w, W)
    copy_out(w, out)


@pytest.mark.parametrize("shift", [0, 4])
@pytest.mark.parametrize("table", [T.IQ4_NL, T.MXFP4], ids=lambda t: t.name)
def test_a_nibble_through_a_table_is_read_as_the_reference_says(shift, table):
    """The IQ formats' and MXFP4's 4-bit indices into their 16 values (block_formats.py)."""
    values = rng().integers(0, 256, (2, 3, LANES), dtype=np.uint8)
    table = np.array(gguf.quants.IQ4_NL.kvalues if table == T.IQ4_NL else gguf.quants.MXFP4.kvalues, F32)
    out = np.empty(W, F32)
    table_fields(values, 37, shift, table, out)
    assert np.array_equal(out, ref.table_fields(values, 37, shift, table, W))


@plain_njit
def e8m0_halves(values, at, out):
    w = _registers(W)
    _e8m0_halves(values, at, w, W)
    copy_out(w, out)


def test_every_e8m0_scale_is_read_as_the_reference_says():
    """MXFP4's block scales (block_formats.py): all 256 exponents, the two subnormal halves included."""
    values = np.arange(256, dtype=np.uint8)
    for at in range(0, 256, W):
        out = np.empty(W, F32)
        e8m0_halves(values, at, out)
        assert np.array_equal(out.view(np.uint32), ref.e8m0_halves(values, at, W).view(np.uint32)), at


@plain_njit
def sign_bit_scales(values, at, bit, scale, out):
    w, scales = _registers(W), _registers(W)
    s = carray(scales, W)
    for k in range(W):
        s[k] = scale[k]
    _sign_bit_scales(values, at, bit, scales, w, W)
    copy_out(w, out)


@pytest.mark.parametrize("bit", range(8))
def test_a_sign_bit_gives_the_scale_or_its_negation_as_the_reference_says(bit):
    """Q1_0's weights (block_formats.py): d where a weight's bit is set, else −d, the zeros' signs too."""
    values = rng().integers(0, 256, (2, 3, LANES), dtype=np.uint8)
    scale = floats(W, 5)
    scale[:2] = 0.0, -0.0
    out = np.empty(W, F32)
    sign_bit_scales(values, 37, bit, scale, out)
    assert np.array_equal(out.view(np.uint32), ref.sign_bit_scales(values, 37, bit, scale, W).view(np.uint32))


@plain_njit
def scaled_multiply_add(sums, w, scale, xj):
    registers, weights, scales = _registers(W), _registers(W), _registers(W)
    s, wv, sc = carray(registers, W), carray(weights, W), carray(scales, W)
    for k in range(W):
        s[k], wv[k], sc[k] = sums[k], w[k], scale[k]
    _scaled_multiply_add(registers, weights, scales, xj, W)
    copy_out(registers, sums)


@plain_njit
def column_multiply_add(sums, tile, at, xj):
    registers, cells = _registers(W), _registers(W3)
    s, t = carray(registers, W), carray(cells, W3)
    for k in range(W):
        s[k] = sums[k]
    for k in range(W3):
        t[k] = tile[k]
    _column_multiply_add(registers, cells, at, xj, W)
    copy_out(registers, sums)


def test_a_scaled_weight_and_a_tiles_column_are_fused_as_the_reference_says():
    """The block formats' one-row products (block_formats.one_row_group): a weight formed as the
    decoded tile would hold it, then one rounding for its product and sum."""
    sums, w, tile = floats(W, 1), floats(W, 2), floats(W3, 3)
    scale = np.ldexp(F32(1), rng(4).integers(-20, 4, W)).astype(F32)  # MXFP4's: powers of two
    want = sums.copy()
    ref.scaled_multiply_add(want, w, scale, F32(0.37), W)
    got = sums.copy()
    scaled_multiply_add(got, w, scale, F32(0.37))
    assert np.array_equal(got, want)
    want = sums.copy()
    ref.column_multiply_add(want, tile, W, F32(-1.3), W)
    got = sums.copy()
    column_multiply_add(got, tile, W, F32(-1.3))
    assert np.array_equal(got, want)


@plain_njit
def q4_k_scales(halves, six_bits, d_at, sc_at, lanes, scale_out, offset_out):
    scale, offset = _registers(W), _registers(W)
    _q4_k_scales(halves, six_bits, d_at, sc_at, lanes, scale, offset, W)
    copy_out(scale, scale_out)
    copy_out(offset, offset_out)


@plain_njit
def nibbles(values, at, byte, low, high, column):
    w, scale, offset = _registers(W), _registers(W), _registers(W)
    _nibbles(values, at, 0, byte, w, W)
    copy_out(w, low)
    _nibbles(values, at, 4, byte, w, W)
    copy_out(w, high)
    s, o = carray(scale, W), carray(offset, W)
    for k in range(W):
        s[k], o[k] = F32(0.5) + k, F32(-1) - k
    _dequantize_nibbles(values, at, 4, byte, scale, offset, w, W)
    copy_out(w, column)


def test_q4_k_scales_and_nibbles_are_read_as_the_reference_says():
    w = q4_k()
    scale, offset = np.empty(W, F32), np.empty(W, F32)
    q4_k_scales(w.scales, w.offsets, 2 * LANES + 3, 5 * LANES + 3, LANES, scale, offset)
    want = ref.q4_k_scales(w.scales, w.offsets, 2 * LANES + 3, 5 * LANES + 3, LANES, W)
    assert np.array_equal(scale, want[0]) and np.array_equal(offset, want[1])
    s, o = F32(0.5) + np.arange(W, dtype=F32), F32(-1) - np.arange(W, dtype=F32)
    for byte in range(4):
        low, high, column = (np.empty(W, F32) for _ in range(3))
        nibbles(w.values, 4 * LANES + 8, byte, low, high, column)
        assert np.array_equal(low, ref.nibbles(w.values, 4 * LANES + 8, 0, byte, W))
        assert np.array_equal(high, ref.nibbles(w.values, 4 * LANES + 8, 4, byte, W))
        assert np.array_equal(column, ref.dequantize_nibbles(w.values, 4 * LANES + 8, 4, byte, s, o, W))


@plain_njit
def scale_run(sums, runs, scale, offset, x_sum):
    registers, run_sums, s, o = _registers(W2), _registers(W2), _registers(W), _registers(W)
    view, run_view = carray(registers, 2 * W), carray(run_sums, 2 * W)
    s_view, o_view = carray(s, W), carray(o, W)
    for k in range(2 * W):
        view[k], run_view[k] = sums[k], runs[k]
    for k in range(W):
        s_view[k], o_view[k] = scale[k], offset[k]
    _scale_run(registers, run_sums, 1, s, o, x_sum, W)
    copy_out(registers, sums)


def test_a_runs_scale_and_offset_are_added_as_the_reference_says():
    sums, runs, scale, offset = floats(2 * W, 1), floats(2 * W, 2), floats(W, 3), floats(W, 4)
    want = sums.copy()
    ref.scale_run(want, runs, 1, scale, offset, F32(1.7), W)
    scale_run(sums, runs, scale, offset, F32(1.7))
    assert np.array_equal(sums, want)


def bytes_of(n_rows: int, n_cols: int, seed: int = 5):
    x = rng(seed).standard_normal((n_rows, n_cols)).astype(F32)
    xq, x_runs = activations.quantize_rows(x)
    return xq.view(np.int32), x_runs


@plain_njit
def nibble_dots(values, at, lanes, shift, xq, x_runs, runs_out):
    runs = _registers(W3)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    if shift == 0:
        _nibble_dots(values, at, lanes, 0, xq, 8, n_words, x_runs, 2 * 1 + 1, 2 * n_runs, runs, 3, W)
    else:
        _nibble_dots(values, at, lanes, 4, xq, 8, n_words, x_runs, 2 * 1 + 1, 2 * n_runs, runs, 3, W)
    copy_out(runs, runs_out)


@pytest.mark.parametrize("shift", [0, 4])
def test_a_q4_k_runs_byte_dots_are_the_references_integers(shift):
    w = q4_k(7)
    xq, x_runs = bytes_of(3, 512)
    out = np.empty(3 * W, F32)
    at = 4 * 8 * LANES + 4 * 8  # the second run pair's words, from lane 8
    nibble_dots(w.values, at, LANES, shift, xq, x_runs, out)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    want = ref.nibble_dots(w.values, at, LANES, shift, xq, 8, n_words, x_runs, 3, 2 * n_runs, 3, W)
    assert np.array_equal(out, want)


@plain_njit
def nibble_pair_dots(values, at, lanes, xq, x_runs, low_out, high_out):
    low, high = _registers(W), _registers(W)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    _nibble_pair_dots(values, at, lanes, xq, 8, n_words, x_runs, 2 * 1 + 1, 2 * n_runs, low, high, 1, W)
    copy_out(low, low_out)
    copy_out(high, high_out)


def test_a_pair_of_q4_k_runs_read_once_are_each_runs_integers():
    """The one-row kernel reads a word's bytes once for the run in its low nibbles and the next run in
    its high ones: each run as _nibble_dots makes it alone, with its own activations and scale."""
    w = q4_k(7)
    xq, x_runs = bytes_of(1, 512)
    low, high = np.empty(W, F32), np.empty(W, F32)
    at = 4 * 8 * LANES + 4 * 8  # the second run pair's words, from lane 8
    nibble_pair_dots(w.values, at, LANES, xq, x_runs, low, high)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    run = partial(ref.nibble_dots, w.values, at, LANES)
    assert np.array_equal(low, run(0, xq, 8, n_words, x_runs, 3, 2 * n_runs, 1, W))
    assert np.array_equal(high, run(4, xq, 16, n_words, x_runs, 5, 2 * n_runs, 1, W))


@plain_njit
def byte_column_dots(values, xq, x_runs, scales, offsets, sums, size, paired):
    registers = _registers(W3)
    view = carray(registers, 3 * W)
    for k in range(3 * W):
        view[k] = sums[k]
    lanes, n_words, n_runs = values.shape[2], xq.shape[1], x_runs.shape[1]
    at, xr_at, scale_at = 32 * lanes + 8, 2, 32 // size * lanes + 8  # columns 32… from lane 8
    if size == 16 and paired:
        _byte_column_dots(
            values, at, lanes, 16, xq, 8, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at,
            registers, 3, W, True,
        )
    elif size == 16:
        _byte_column_dots(
            values, at, lanes, 16, xq, 8, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at,
            registers, 3, W, False,
        )
    elif paired:
        _byte_column_dots(
            values, at, lanes, 32, xq, 8, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at,
            registers, 3, W, True,
        )
    else:
        _byte_column_dots(
            values, at, lanes, 32, xq, 8, n_words, x_runs, xr_at, 2 * n_runs, scales, offsets, scale_at,
            registers, 3, W, False,
        )
    copy_out(registers, sums)
    in_lane_order(registers, 3, W)
    copy_out(registers, sums[3 * W :])


@pytest.mark.parametrize(
    "qtype, size, paired",
    [(T.Q4_1, 32, False), (T.Q4_1, 32, True), (T.Q5_0, 32, True), (T.Q8_0, 32, False), (T.Q6_K, 16, False),
     (T.Q6_K, 16, True)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_an_int8_blocks_byte_dots_are_the_references(qtype, size, paired):
    """A block's integer sums, in 32 bits at each word or (`paired`, the small formats' weights) in 16
    bits over four words first: exactly the reference's, the largest inputs and weights included."""
    shape = (LANES, 256)
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng(9).integers(0, 256, (shape[0], shape[1] // block_len * block_bytes), dtype=np.uint8)
    halves = {T.Q6_K: slice(208, 210), T.Q4_1: slice(0, 4)}.get(qtype, slice(0, 2))  # d (and m)
    blocks = raw.reshape(-1, block_bytes)
    d = np.full((len(blocks), (halves.stop - halves.start) // 2), 0.01, np.float16)
    blocks[:, halves] = d.view(np.uint8)
    w = quants.for_inputs(quants.pack([(raw, qtype, shape)]), "f32")  # (Q6_K: as int8)
    assert w.small == (qtype != T.Q8_0)
    # random weights and inputs, then the sums' worst case: every weight at the format's largest size,
    # every input byte 127 (a 16-bit sum of four words' pairs then holds 8 · 32 · 127 for Q6_K)
    largest = {T.Q4_1: 15, T.Q5_0: -16, T.Q6_K: -32, T.Q8_0: -128}[qtype]
    for extreme in (False, True):
        if extreme:
            w.values[:] = largest
        xq, x_runs = bytes_of(3, 256) if not extreme else activations.quantize_rows(np.ones((3, 256), F32))
        xq = xq.view(np.int32)
        sums = np.zeros(6 * W, F32)
        sums[: 3 * W] = floats(3 * W, 1)
        want = sums[: 3 * W].copy()
        byte_column_dots(w.values, xq, x_runs, w.scales, w.offsets, sums, size, paired)
        at, scale_at = 32 * LANES + 8, LANES * (32 // size) + 8
        ref.byte_column_dots(
            w.values, at, LANES, size, xq, 8, xq.shape[1], x_runs, 2, 2 * x_runs.shape[1],
            w.scales, w.offsets, scale_at, want, 3, W,
        )
        assert np.array_equal(sums[: 3 * W], want), extreme
        ref.in_lane_order(want, 3, W)
        assert np.array_equal(sums[3 * W :], want), extreme


def q6_k(seed: int = 0):
    """A Q6_K matrix of LANES rows packed in k_quants' layout (its ql, qh and scales random, d small)."""
    shape = (LANES, 512)
    raw = rng(seed).integers(0, 256, (shape[0], 2 * 210), dtype=np.uint8)
    d = (rng(seed + 1).random((shape[0] * 2, 1)) * 0.02).astype(np.float16)
    raw.reshape(-1, 210)[:, 208:210] = d.view(np.uint8)
    return q6_k_in_bits(raw, shape)


@plain_njit
def q6_k_column(values, d, sc, ql_at, qh_at, byte, k, column_out, scale_out):
    w, scale = _registers(W), _registers(W)
    _q6_k_scales(d, sc, 8, 3 * LANES + 8, scale, W)
    _q6_k_column(values, ql_at, qh_at, byte, k, scale, w, W)
    copy_out(w, column_out)
    copy_out(scale, scale_out)


@plain_njit
def q6_k_int8(values, d, sc, ql_at, qh_at, d_at, sc_at, columns, scales):
    _q6_k_int8_columns(values, ql_at, qh_at, columns, W, W)
    _q6_k_int8_scales(d, sc, d_at, sc_at, scales, W, W)


def test_q6_k_bits_are_made_int8_as_the_reference_says():
    """A half block's columns of the second block, from lane 8, as int8 with their scales: each at its
    place in the int8 layout (a row of `W` lanes apart from the next column), nothing written beside."""
    w = q6_k(12)
    block = 4 * (LANES * 48 + 8)  # block 1's first word, from lane 8
    for h, m in [(0, 0), (1, 5), (1, 7)]:
        ql_at, qh_at = block + 4 * LANES * (16 * h + m), block + 4 * LANES * (32 + 8 * h + m)
        columns, scales = np.full((130, W), 99, np.int8), np.full((18, W), 7.0, F32)
        q6_k_int8(w.values, w.scales, w.offsets, ql_at, qh_at, LANES + 8, 16 * LANES + 8, columns, scales)
        want = ref.q6_k_int8_columns(w.values, ql_at, qh_at, W)
        assert np.array_equal(columns[1:129].reshape(4, 32, W)[:, :4], want), (h, m)
        assert (columns[0] == 99).all() and (columns[129] == 99).all()
        assert (columns[1:129].reshape(4, 32, W)[:, 4:] == 99).all()
        want_scales = ref.q6_k_int8_scales(w.scales, w.offsets, LANES + 8, 16 * LANES + 8, W)
        assert np.array_equal(scales[1:17], want_scales)
        assert (scales[0] == 7).all() and (scales[17] == 7).all()


@pytest.mark.parametrize("k", range(4))
def test_a_q6_k_column_is_dequantized_as_the_reference_says(k):
    """Every run's columns of the second block, from lane 8: its 4 low bits and 2 high ones put together,
    less 32, times the sub-block's d·sc."""
    w = q6_k(11)
    block = 4 * (LANES * 48 + 8)  # block 1's first word, from lane 8
    column, scale = np.empty(W, F32), np.empty(W, F32)
    for c, byte in [(0, 0), (3, 2), (7, 3)]:
        ql_at, qh_at = block + 4 * LANES * (8 * (k % 2) + c), block + 4 * LANES * (32 + c)
        q6_k_column(w.values, w.scales, w.offsets, ql_at, qh_at, byte, k, column, scale)
        want_scale = ref.q6_k_scales(w.scales, w.offsets, 8, 3 * LANES + 8, W)
        assert np.array_equal(scale, want_scale)
        assert np.array_equal(column, ref.q6_k_column(w.values, ql_at, qh_at, byte, k, want_scale, W))


@plain_njit
def q6_k_dots(values, d, sc, xq, x_runs, sums, rows):
    registers = _registers(W3)
    view = carray(registers, 3 * W)
    for k in range(3 * W):
        view[k] = sums[k]
    lanes, n_words, n_runs = values.shape[2], xq.shape[1], x_runs.shape[1]
    block = 4 * (lanes * 48 + 8)  # half 1 of block 1, from lane 8
    ql_at, qh_at = block + 4 * lanes * 16, block + 4 * lanes * 40
    d_at, sc_at = lanes + 8, 24 * lanes + 8
    xq_at, xs_at = 64 + 32, 2 * (8 + 4) + 1
    if rows == 1:
        _q6_k_half_dots(
            values, ql_at, qh_at, xq, xq_at, x_runs, xs_at, d, sc, d_at, sc_at, registers, W, Q6_K_ASK_AHEAD,
        )
    else:
        for s in range(8):  # as k_quants.accumulate_q6_k_q8 calls it
            k, second = s // 2, s % 2
            _q6_k_sub_block_dots(
                values, ql_at + 4 * lanes * (8 * (k % 2) + 4 * second), qh_at + 16 * lanes * second, lanes, k,
                xq, xq_at + 8 * k + 4 * second, n_words, x_runs, xs_at + 2 * k, 2 * n_runs, d, sc, d_at,
                sc_at + s * lanes, registers, 3, W,
            )
    copy_out(registers, sums)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_q6_k_half_blocks_byte_dots_are_the_references(rows):
    """One row (_q6_k_half_dots: the sub-blocks in turn, in one piece of code) and several
    (_q6_k_sub_block_dots: a call a sub-block), each as the reference adds up half a block."""
    w = q6_k(12)
    xq, x_runs = bytes_of(3, 512)
    sums = floats(3 * W, 2)
    want = sums.copy()
    q6_k_dots(w.values, w.scales, w.offsets, xq, x_runs, sums, rows)
    block = 4 * (LANES * 48 + 8)
    n_words, n_runs = xq.shape[1], x_runs.shape[1]
    ref.q6_k_dots(
        w.values, block + 4 * LANES * 16, block + 4 * LANES * 40, LANES, xq, 96, n_words, x_runs, 25,
        2 * n_runs, w.scales, w.offsets, LANES + 8, 24 * LANES + 8, want, rows, W,
    )
    assert np.array_equal(sums, want)


def test_quantizing_rows_is_bit_for_bit_the_references():
    x = rng(3).standard_normal((5, 256)).astype(F32) * np.array([0, 1, 1e-3, 40, 1], F32)[:, None]
    for got, want in zip(activations.quantize_rows(x), activations.quantize_rows_reference(x), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("inputs", ["f32", "q8"])
@pytest.mark.parametrize("n", [1, 5])
def test_products_are_the_references(qtype, inputs, n):
    shape = (96, 512)
    w = replace(quants.pack([(raw_tensor(qtype, shape), qtype, shape)]), activations=inputs)
    x = rng(1).standard_normal((n, shape[1])).astype(F32)
    want = products.product_reference(x, w)
    for product in (products.kernel_product, products.tile_product):
        if product is products.tile_product and products.takes_bytes(w):
            continue  # inputs as bytes run in the kernels only
        got = product(x, w)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-6, product.__name__


@plain_njit
def add_rows(acc, a_stride, kv, starts, count, n, weights, w_stride, heads, columns, width):
    heads, columns, width = literally(heads), literally(columns), literally(width)
    _add_rows(acc, a_stride, kv, starts, count, n, weights, w_stride, heads, columns, width)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    "heads, columns, width, n", [(7, 1, 16, 64), (4, 1, 8, 40), (2, 2, 16, 80), (1, 4, 4, 30), (1, 4, 16, 16)]
)
def test_weighted_cache_rows_are_added_as_the_reference_says(dtype, heads, columns, width, n):
    """The weighted values: each head's sums, row after row in order, fused, read from the cache where
    its rows lie (float16 widened exactly); a row's last vector reads nothing past the row (a NaN lies
    beside each), and the padding of each head's sums is left as it was."""
    count, block = 11, columns * width
    a_stride = -(-n // block) * block
    kv = (floats(count * (n + 3), 2) * 100).astype(dtype)
    kv.reshape(count, n + 3)[:, n:] = np.nan
    starts = np.arange(count)[::-1] * (n + 3)  # rows in any order
    acc, weights = floats(heads * a_stride, 1), floats(heads * 15, 3)
    as_kernels_see = kv.view(np.uint16) if dtype == np.float16 else kv
    want = acc.copy()
    ref.add_rows(want, a_stride, as_kernels_see, starts, count, n, weights, 15, heads)
    add_rows(acc, a_stride, as_kernels_see, starts, count, n, weights, 15, heads, columns, width)
    assert np.array_equal(acc, want)
    assert not np.isnan(acc).any()


@plain_njit
def tile_scores(queries, rows, rows_at, n, scores, s_at, keys, width):
    _tile_scores(queries, rows, rows_at, n, scores, s_at, literally(keys), literally(width))


@pytest.mark.parametrize("keys, width", [(8, 8), (8, 16), (1, 16), (3, 4)])
def test_a_tiles_scores_are_each_lanes_own_dot_products(keys, width):
    """Several query rows' scores: a query in each lane, each lane's fused multiply-adds in order of the
    head's columns, nothing written past the keys' scores."""
    n = 40  # (a head's size need not be a multiple of the lanes)
    queries = floats(n * width, 1).reshape(n, width)
    rows = floats(3 + keys * n, 2)
    scores = np.zeros((keys + 2) * width, F32)
    tile_scores(queries, rows, 3, n, scores, width, keys, width)
    want = ref.tile_scores(queries, rows, 3, n, keys, width)
    assert np.array_equal(scores[width : (keys + 1) * width].reshape(keys, width), want)
    assert not scores[:width].any() and not scores[(keys + 1) * width :].any()


@plain_njit
def block_scores(q, q_at, q_stride, keys, k_at, n, block, scores, s_at, s_stride, heads, width):
    heads, width = literally(heads), literally(width)
    _block_scores(q, q_at, q_stride, keys, k_at, n, block, scores, s_at, s_stride, heads, width)


@pytest.mark.parametrize("heads, width", [(7, 16), (7, 8), (1, 4), (3, 16)])
@pytest.mark.parametrize("half", [True, False])
def test_a_blocks_scores_are_each_positions_own_dot_products(heads, width, half):
    """Keys with positions across the lanes ([head_dim, block]): each query head's scores for a vector
    of positions, fused in order of the head's columns, from a block's middle, nothing written past them."""
    n, block, heads_stride = 40, 64, 45  # (a head's size need not be a multiple of the lanes)
    q = floats(heads * heads_stride, 1)
    keys = floats(n * block + 5, 2)
    keys = keys.astype(np.float16).view(np.uint16) if half else keys
    scores = np.zeros(heads * 2 * width, F32)
    block_scores(q, 3, heads_stride, keys, 5 + width, n, block, scores, width, 2 * width, heads, width)
    want = ref.block_scores(q, 3, heads_stride, keys, 5 + width, n, block, heads, width)
    got = scores.reshape(heads, 2, width)
    assert np.array_equal(got[:, 1], want)
    assert not got[:, 0].any()


@plain_njit
def tile_add(acc, d_at, weights, rows, rows_at, count, n, dims, width):
    _tile_add(acc, d_at, weights, rows, rows_at, count, n, literally(dims), literally(width))


@pytest.mark.parametrize("dims, width", [(8, 8), (8, 16), (4, 4)])
def test_a_tiles_weighted_sums_are_added_as_the_reference_says(dims, width):
    n, count = 24, 11
    acc = floats(n * width, 1).reshape(n, width)
    weights = floats(count * width, 2).reshape(count, width)
    rows = floats(5 + count * n, 3)
    want = acc.copy()
    ref.tile_add(want, 8, weights, rows, 5, count, n, dims)
    tile_add(acc, 8, weights, rows, 5, count, n, dims, width)
    assert np.array_equal(acc, want)  # the columns past d_at + dims as they were


@plain_njit
def widen(values, at, out, out_at, n, width):
    _widen(values, at, out, out_at, n, literally(width))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_cache_row_is_widened_as_the_reference_says(dtype):
    """A row of the float16 (or float32) cache as float32, exactly, nothing written beside it."""
    values = (floats(70, 5) * 1000).astype(dtype)
    values[9], values[10] = np.float16(6e-8), -np.inf  # a float16 subnormal, an infinity
    out = np.zeros(40, F32)
    as_kernels_see = values.view(np.uint16) if dtype == np.float16 else values
    widen(as_kernels_see, 7, out, 3, 32, 16)
    assert np.array_equal(out[3:35], ref.widen(as_kernels_see, 7, 32))
    assert np.array_equal(out[3:35], values[7:39].astype(F32))
    assert not out[:3].any() and not out[35:].any()


@plain_njit
def largest(values, at, n, width):
    return _largest(values, at, n, literally(width))


def test_the_largest_score_is_the_references():
    values = floats(100, 4)
    values[40], values[80] = np.nan, 100  # NaN ignored, as maxnum does; 80 past the run asked for
    assert largest(values, 3, 64, 16) == ref.largest(values, 3, 64) < 100
    assert largest(np.full(32, -np.inf, F32), 0, 32, 8) == -np.inf


def test_one_tokens_attention_is_the_references():
    q = floats(2 * 7 * 64, 1).reshape(2, 7, 64) * 0.5
    k, v = (floats(2 * 900 * 64, s).reshape(2, 900, 64) for s in (2, 3))
    runs = [(0, 300), (512, 270), (899, 1)]
    got = attention.one_token_attention(q, k.astype(np.float16), v.astype(np.float16), runs)
    want = attention.one_token_attention_reference(q, k.astype(np.float16), v.astype(np.float16), runs)
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize(
    "window, sinks, hd, softcap",
    [(0, False, 64, 0.0), (70, False, 128, 0.0), (0, True, 80, 0.0), (5, True, 64, 0.0), (9, False, 64, 2.0)],
)
def test_several_rows_attention_is_the_references(window, sinks, hd, softcap):
    """A turn's rows at once (rows_attention): each row over the positions its causal mask (and sliding
    window) lets it see, along the runs where the cache holds them, with gpt-oss's sinks and gemma2's
    soft cap; and a row's
    result the same, bit for bit, computed alone as beside the others, and in a view of the cache that
    starts at its own first position."""
    n_kv, group, T = 2, 7, 37
    k, v = (floats(n_kv * 900 * hd, s).reshape(n_kv, 900, hd).astype(np.float16) for s in (2, 3))
    q = floats(T * n_kv * group * hd, 1).reshape(T, n_kv, group, hd) * F32(0.3)
    runs = [(7, 250), (600, 40), (800, T)]
    own = sum(n for _, n in runs) - T + np.arange(T)  # each row's own position along the runs
    seen_from = np.maximum(own - window + 1, 0) if window else np.zeros(T, np.int64)
    seen_to = own + 1
    heads_sinks = floats(n_kv * group, 4).reshape(n_kv, group) * F32(2) if sinks else None
    got = attention.rows_attention(q, k, v, runs, seen_from, seen_to, softcap=softcap, sinks=heads_sinks)
    where = np.concatenate([np.arange(first, first + n) for first, n in runs])
    for t in range(T):
        seen = [(int(p), 1) for p in where[seen_from[t] : seen_to[t]]]
        want = attention.one_token_attention_reference(q[t], k, v, seen, heads_sinks, softcap)
        assert np.abs(got[t] - want).max() <= 1e-5
    t = T // 2
    one = slice(t, t + 1)
    same = {"softcap": softcap, "sinks": heads_sinks}
    alone = attention.rows_attention(q[one], k, v, runs, seen_from[one], seen_to[one], **same)
    assert np.array_equal(alone[0], got[t])
    # and in a view that starts where the row's first seen position is (a sliding window's own view)
    start = int(seen_from[t])
    view = [(int(p), 1) for p in where[start:]]
    own_view = attention.rows_attention(
        q[one], k, v, view, [0], seen_to[one] - start, origin=start, **same
    )
    assert np.array_equal(own_view[0], got[t])


def test_the_building_blocks_are_the_references_under_the_avx2_profile():
    """The byte kernels' AVX2 instructions (vpmaddubsw, vpsignb) and its 8-float vectors, on any x86
    machine: these checks again in a process compiled for a Haswell (its own kernel cache folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "LLAMA_CHAT_KERNEL_SHAPE")}
    env["NUMBA_CPU_NAME"] = "haswell"
    checks = "column or fused or nibbles or scale or byte_dots or quantizing or bit_field or table or q3_k"
    checks += " or e8m0 or sign_bit or dot_products or weighted_rows or largest or attention or tile or int8"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k", checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:]
