"""The packed weight formats and the compiled kernels, against gguf.quants' own dequantization."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numba
import numpy as np
import pytest

from llama_chat.inference import blas_crossover, cpu, formats, ggml_quants, k_quants, kernels, quants, warmup
from llama_chat.inference.products import Q6_K_TILES_FROM
from llama_chat.inference.threads import kernels_on_this_thread

T = gguf.GGMLQuantizationType
# Kept in their own bits: the 16-bit floats and the block formats (formats.OWN_BITS)
OWN_BITS = [
    T.F16, T.BF16, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
    T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.NVFP4, T.Q1_0,
]
FORMATS = [T.F32, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *OWN_BITS]
# Where the float16 scales of a format that gguf.quants does not quantize lie in its block: its blocks are
# random bytes (every bit pattern is a valid block) with small, finite scales there.
SCALE_BYTES = {
    T.Q4_K: slice(0, 4), T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210), T.Q2_K: slice(80, 84),
    T.Q3_K: slice(108, 110), T.IQ4_NL: slice(0, 2), T.IQ4_XS: slice(0, 2),
    **dict.fromkeys((T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S), slice(0, 2)),
    T.IQ1_M: slice(48, 56),  # d in the top nibbles of its four uint16 (_iq1_m_scale)
}


def raw_tensor(qtype: T, shape: tuple[int, int], seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """A tensor's GGUF bytes: quantized by gguf.quants (or ggml_quants' port of ggml-quants.c) where it
    can, else random blocks with small, finite scales (below `scale`)."""
    rng = np.random.default_rng(seed)
    if qtype not in SCALE_BYTES:
        data = ggml_quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        return data.view(np.uint8).reshape(shape[0], -1)
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_len * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    at = SCALE_BYTES[qtype]
    scales = (rng.random((blocks.shape[0], 2)) * scale).astype(np.float16)
    if qtype == T.IQ1_M:
        _iq1_m_scale(blocks, scales[:, 0].view(np.uint16))
    else:
        blocks[:, at] = scales.view(np.uint8)[:, : at.stop - at.start]
    return raw


def _iq1_m_scale(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M's float16 d, four bits in the top nibble of each of the uint16 at bytes 48, 50, 52, 54."""
    for m in range(4):
        top = ((d >> (4 * m)) & 15).astype(np.uint8) << 4
        blocks[:, 49 + 2 * m] = (blocks[:, 49 + 2 * m] & 15) | top


def reference(qtype: T, raw: np.ndarray, shape) -> np.ndarray:
    return np.asarray(ggml_quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_packing_keeps_every_weight_exactly(qtype):
    shape = (70, 512)  # rows not a multiple of the 64 lanes: the last group is padded
    raw = raw_tensor(qtype, shape)
    w = quants.pack([(raw, qtype, shape)])
    assert np.array_equal(kernels.rows(w, np.arange(shape[0])), reference(qtype, raw, shape))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 8, 20, kernels.KERNEL_ROWS + 1])
@pytest.mark.parametrize("product", [kernels.kernel_product, kernels.tile_product], ids=["kernels", "BLAS"])
def test_matmul_equals_float_matmul_of_the_dequantized_weights(qtype, n, product):
    shape = (130, 512)
    raw = raw_tensor(qtype, shape)
    w = quants.pack([(raw, qtype, shape)])
    x = np.random.default_rng(1).standard_normal((n, shape[1])).astype(np.float32)
    expected = x.astype(np.float64) @ reference(qtype, raw, shape).T.astype(np.float64)
    got = product(x, w)
    assert got.shape == (n, shape[0]) and got.dtype == np.float32
    # float32 sums of 512 products, in another order than float64's
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() + 1e-6


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F32, T.BF16, T.Q3_K], ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch(qtype):
    """Prompt-lookup verification relies on it: row i of an n-row product is the 1-row product."""
    shape = (128, 256)
    w = quants.pack([(raw_tensor(qtype, shape), qtype, shape)])
    x = np.random.default_rng(2).standard_normal((kernels.KERNEL_ROWS, shape[1])).astype(np.float32)
    alone = [kernels.matmul(x[i : i + 1], w)[0] for i in range(len(x))]
    for n in (2, 3, 5, kernels.KERNEL_ROWS):  # the kernel's paths: 2 rows, 4-row steps padded or not
        together = kernels.matmul(x[:n], w)
        for i in range(n):
            assert np.array_equal(together[i], alone[i]), (n, i)


@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_a_row_gets_the_same_bits_on_the_calling_thread_alone_as_over_all_threads(activations):
    """A one-row product of a small matrix runs on the calling thread alone (cpu.PARALLEL_PRODUCT_FROM),
    of a larger one over the threads: a row's result is the same either way."""
    shape = (1024, 2304)
    w = replace(quants.pack([(raw_tensor(T.Q8_0, shape), T.Q8_0, shape)]), activations=activations)
    assert w.nbytes >= cpu.PARALLEL_PRODUCT_FROM  # (this one splits over the threads)
    x = np.random.default_rng(3).standard_normal((1, shape[1])).astype(np.float32)
    before = numba.get_num_threads()
    over_all = kernels.matmul(x, w)
    with kernels_on_this_thread():
        assert numba.get_num_threads() == 1
        alone = kernels.matmul(x, w)
    assert numba.get_num_threads() == before
    assert np.array_equal(over_all, alone)


@pytest.mark.parametrize(
    "qtype, activations",
    [(T.Q8_0, "f32"), (T.Q4_K, "f32"), (T.Q6_K, "f32"), (T.F16, "f32"), (T.Q4_K, "q8"), (T.Q5_0, "q8")],
)
def test_a_token_decoded_before_its_one_row_kernel_is_ready_gets_the_bits_it_gets_after(
    qtype, activations, monkeypatch
):
    """The app's first start leaves the one-row kernels to a thread after the load: a token decoded
    meanwhile goes through the passes, padded, with the bits the one-row kernel gives it once ready."""
    from llama_chat.inference import products

    shape = (128, 256)
    w = replace(quants.pack([(raw_tensor(qtype, shape), qtype, shape)]), activations=activations)
    x = np.random.default_rng(3).standard_normal((5, shape[1])).astype(np.float32)
    monkeypatch.setattr(products, "_one_row_later", True)
    monkeypatch.setattr(products, "_one_row_ready", set())
    one_row = []
    kernel = products._one_row_product
    monkeypatch.setattr(products, "_one_row_product", lambda *args: one_row.append(1) or kernel(*args))
    before = [kernels.matmul(x[i : i + 1], w) for i in range(len(x))]
    assert not one_row  # through the passes
    products.compile_later_rows([w])
    after = [kernels.matmul(x[i : i + 1], w) for i in range(len(x))]
    assert len(one_row) == 1 + len(x)  # compiled, then taken by every row
    assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))


# Q4_K's bits; int8 with offsets, without; scales per 16
BYTE_FORMATS = [T.Q4_K, T.Q4_1, T.Q5_0, T.Q8_0, T.Q6_K]


def as_bytes(w):
    """w, its products taking their inputs as bytes (activations q8)."""
    w = replace(w, activations="q8")
    assert kernels.takes_bytes(w)
    return w


@pytest.mark.parametrize("qtype", BYTE_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 3, 8, kernels.KERNEL_ROWS + 1, 200])
def test_inputs_as_bytes_multiply_exactly_as_their_bytes_say(qtype, n):
    """Under activations q8 a product is, as llama.cpp's, Σ w·x̂ over the inputs as bytes, x̂ = xq·scale a
    scale for each 32 (kernels.quantize_rows), offsets included (offset·Σ x̂): exact up to float32
    rounding, whatever the size (the integer sums exact), and within 2 % of the exact product."""
    shape = (130, 512)
    raw = raw_tensor(qtype, shape)
    w = as_bytes(quants.pack([(raw, qtype, shape)]))
    x = np.random.default_rng(1).standard_normal((n, shape[1])).astype(np.float32)
    xq, x_runs = kernels.quantize_rows(x)
    assert np.abs(xq).max() <= 127
    x_hat = (xq.reshape(n, -1, 32) * x_runs[:, :, 1:]).reshape(n, -1).astype(np.float64)
    weights = reference(qtype, raw, shape).astype(np.float64)
    expected = x_hat @ weights.T
    got = kernels.matmul(x, w)
    assert got.shape == (n, shape[0]) and got.dtype == np.float32
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max() + 1e-6
    exact = x.astype(np.float64) @ weights.T
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0], ids=lambda t: t.name)
def test_inputs_as_bytes_give_a_row_the_same_bits_in_any_batch(qtype):
    """Rows as bytes run in the kernels at every size: row i of any product is the 1-row product."""
    shape = (128, 256)
    w = as_bytes(quants.pack([(raw_tensor(qtype, shape), qtype, shape)]))
    x = np.random.default_rng(2).standard_normal((70, shape[1])).astype(np.float32)
    alone = [kernels.matmul(x[i : i + 1], w)[0] for i in range(len(x))]
    for n in (2, 3, 5, len(x)):
        together = kernels.matmul(x[:n], w)
        for i in range(n):
            assert np.array_equal(together[i], alone[i]), (n, i)


def test_only_formats_the_byte_kernels_read_take_bytes():
    """Float matrices, and integers whose offsets come a scale per 16 columns, keep float32 inputs."""
    for qtype, takes in ((T.F16, False), (T.Q5_K, True), (T.Q6_K, True), (T.Q4_K, True)):
        shape = (64, 256)
        w = replace(quants.pack([(raw_tensor(qtype, shape), qtype, shape)]), activations="q8")
        assert kernels.takes_bytes(w) == takes, qtype
        assert not kernels.takes_bytes(replace(w, activations="f32"))


def test_past_the_kernel_rows_the_measured_crossover_picks_the_product(monkeypatch):
    shape = (128, 256)
    w = quants.pack([(raw_tensor(T.Q8_0, shape), T.Q8_0, shape)])
    x = np.random.default_rng(4).standard_normal((100, shape[1])).astype(np.float32)
    alone = np.concatenate([kernels.matmul(x[i : i + 1], w) for i in range(len(x))])
    kernels.blas_on_one_thread(False)  # (as in a step of float32 inputs past the crossover)
    monkeypatch.setattr(kernels, "blas_from", None)  # the kernels win at any size: the same bits
    assert np.array_equal(kernels.matmul(x, w), alone)
    monkeypatch.setattr(kernels, "blas_from", 64)
    by_blas = []
    tile_product = kernels.tile_product
    monkeypatch.setattr(kernels, "tile_product", lambda x, w: by_blas.append(len(x)) or tile_product(x, w))
    assert np.array_equal(kernels.matmul(x[:63], w), alone[:63])
    assert np.allclose(kernels.matmul(x, w), alone, rtol=1e-5, atol=1e-5)
    assert by_blas == [100]  # 63 rows stay in the kernels, 100 go to BLAS


def test_past_the_crossover_matrices_wider_than_blas_takes_stay_in_the_kernels(monkeypatch):
    """A 7B's matrices (3584 columns and more) ran 1.4-3x faster in the kernels than as BLAS on tiles of
    one group of rows each: a long prompt's rows keep the kernels' bits there, and BLAS its one thread."""
    narrow = quants.pack([(raw_tensor(T.Q8_0, (128, 256)), T.Q8_0, (128, 256))])
    wide_shape = (128, kernels.BLAS_WIDEST + 256)
    wide = quants.pack([(raw_tensor(T.Q4_K, wide_shape), T.Q4_K, wide_shape)])
    x = np.random.default_rng(4).standard_normal((100, wide_shape[1])).astype(np.float32)
    alone = np.concatenate([kernels.matmul(x[i : i + 1], wide) for i in range(len(x))])
    monkeypatch.setattr(kernels, "blas_from", 64)
    by_blas = []
    tile_product = kernels.tile_product
    monkeypatch.setattr(kernels, "tile_product", lambda x, w: by_blas.append(w.n_cols) or tile_product(x, w))
    try:
        kernels.use_blas_threads_for(100, "f32", lambda: [wide])
        assert kernels.threads.blas_is_on_one_thread()
        kernels.use_blas_threads_for(100, "f32", lambda: [wide, narrow])
        assert not kernels.threads.blas_is_on_one_thread()
        assert np.array_equal(kernels.matmul(x, wide), alone)
        kernels.matmul(x[:, :256], narrow)
        assert by_blas == [256]
    finally:
        kernels.blas_on_one_thread(False)


def test_a_long_prompt_of_a_model_with_bytes_for_inputs_runs_all_in_the_kernels(monkeypatch):
    """Under "mixed" (and "q8") most of a step's work is products of bytes in the kernels, which ran
    slower beside BLAS on all its threads than the float32 products gained: BLAS keeps one thread, and
    a float32 product that BLAS's tiles would suit runs in the kernels, with their bits."""
    narrow = quants.pack([(raw_tensor(T.Q8_0, (128, 256)), T.Q8_0, (128, 256))])
    x = np.random.default_rng(4).standard_normal((100, 256)).astype(np.float32)
    alone = np.concatenate([kernels.matmul(x[i : i + 1], narrow) for i in range(len(x))])
    monkeypatch.setattr(kernels, "blas_from", 64)
    monkeypatch.setattr(kernels, "tile_product", lambda x, w: pytest.fail("BLAS took a product"))
    try:
        for activations in ("mixed", "q8"):
            kernels.use_blas_threads_for(100, activations, lambda: [narrow])
            assert kernels.threads.blas_is_on_one_thread()
            assert np.array_equal(kernels.matmul(x, narrow), alone)
    finally:
        kernels.blas_on_one_thread(False)


def test_a_long_product_waits_for_the_crossover_under_measurement_and_takes_its_way(monkeypatch):
    """The crossover is measured once, by whoever asks first (the load's compile-later thread here); a
    product past KERNEL_ROWS rows that comes meanwhile waits for that answer: never another way."""
    import threading

    measuring, release, runs = threading.Event(), threading.Event(), []

    def measure():
        runs.append(1)
        measuring.set()
        release.wait()
        return 64

    monkeypatch.setattr(kernels, "blas_from", kernels.MeasuredLater(measure))
    later = threading.Thread(target=kernels.known_blas_from)
    later.start()
    measuring.wait()
    ways = []
    asking = threading.Thread(
        target=lambda: ways.append((kernels.kernels_take(40), kernels.kernels_take(100)))
    )
    asking.start()
    assert kernels.kernels_take(32)  # up to KERNEL_ROWS the kernels, without asking
    asking.join(0.2)
    assert asking.is_alive() and not ways  # waiting for the measurement
    release.set()
    later.join()
    asking.join()
    assert ways == [(True, False)] and runs == [1] and kernels.blas_from == 64


def test_a_load_leaves_the_crossover_to_the_first_prompt_past_the_kernel_rows(tiny_model_paths, monkeypatch):
    """A first start measures where BLAS takes long prompts from only when one needs it (or on the load's
    compile-later thread): not while the first reply waits."""
    from llama_chat.inference import load_model

    runs = []
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda: runs.append(1) or 33)
    monkeypatch.setattr(kernels, "blas_from", kernels.blas_from)  # (this machine's again after the test)
    model = load_model(tiny_model_paths["qwen2"], activations="f32")
    ids = list(range(1, 41))
    model.logits(ids[:32])
    assert not runs
    model.logits(ids)
    assert runs == [1] and kernels.blas_from == 33


def test_the_crossover_is_measured_once_per_machine_and_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(blas_crossover.numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_crossover, "_measured", {})
    runs = []
    monkeypatch.setattr(blas_crossover, "measure_blas_from", lambda: runs.append(1) or 128)
    assert blas_crossover.measured_blas_from() == 128 and blas_crossover.measured_blas_from() == 128
    monkeypatch.setattr(blas_crossover, "_measured", {})  # a new process reads the file
    assert blas_crossover.measured_blas_from() == 128 and len(runs) == 1


@pytest.mark.parametrize("damaged", ["{not json", '["a list"]', '{"%s": "64"}', '{"%s": 64.5}'])
def test_a_damaged_crossover_file_is_measured_again(monkeypatch, tmp_path, damaged):
    monkeypatch.setattr(blas_crossover.numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_crossover, "_measured", {})
    (tmp_path / "blas_from.json").write_text(damaged.replace("%s", blas_crossover.crossover_key()))
    monkeypatch.setattr(blas_crossover, "measure_blas_from", lambda: 256)
    assert blas_crossover.measured_blas_from() == 256
    monkeypatch.setattr(blas_crossover, "_measured", {})
    assert blas_crossover.measured_blas_from() == 256  # and written again whole


def test_the_crossover_measurement_gives_a_size_it_measured_or_none():
    assert blas_crossover.measure_blas_from(repeats=1) in (*blas_crossover.CROSSOVER_ROWS, None)


def test_q4_k_stays_in_its_gguf_bytes_and_multiplies_at_least_as_exactly_as_unpacked_to_int8():
    """A Q4_K matrix is held in (about) its GGUF bytes, and its products, a run's d·sc·Σ q·x − dmin·m·Σ x
    as ggml forms them, are no further from the exact product of its weights than those of the same
    weights unpacked to int8 with float32 scales (joined with a Q8_0 row, which does so: one long sum of
    w·x), the largest error and the typical one."""
    shape = (128, 4096)
    raw = raw_tensor(T.Q4_K, shape)
    w = quants.pack([(raw, T.Q4_K, shape)])
    assert w.in_q4_k and w.nbytes <= 1.03 * raw.nbytes
    q8_row = raw_tensor(T.Q8_0, (1, shape[1]))
    unpacked = quants.pack_one([(raw, T.Q4_K, shape), (q8_row, T.Q8_0, (1, shape[1]))])
    assert not unpacked.in_q4_k and unpacked.values.dtype == np.int8
    x = np.random.default_rng(5).standard_normal((kernels.KERNEL_ROWS, shape[1])).astype(np.float32)
    exact = x.astype(np.float64) @ reference(T.Q4_K, raw, shape).astype(np.float64).T
    for n in (1, 2, 3, kernels.KERNEL_ROWS):
        ours = np.abs(kernels.matmul(x[:n], w) - exact[:n])
        int8 = np.abs(kernels.matmul(x[:n], unpacked)[:, : shape[0]] - exact[:n])
        assert ours.max() <= int8.max() and np.sqrt((ours**2).mean()) <= np.sqrt((int8**2).mean()), n


def test_joined_matrices_of_different_formats_multiply_as_each_alone():
    """q/k/v or gate/up of different formats: Q5_0 and Q8_0 fused into one matrix of integers, Q6_K and
    Q4_K in their own bits beside it."""
    parts = [(T.Q5_0, (64, 256)), (T.Q8_0, (16, 256)), (T.Q6_K, (32, 256)), (T.Q4_K, (40, 256))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)])
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    expected = np.concatenate([x @ reference(t, r, s).T for r, (t, s) in zip(raws, parts)], axis=1)
    assert np.allclose(kernels.matmul(x, joined), expected, rtol=1e-5, atol=1e-5)


def test_q4_k_joined_with_another_format_keeps_its_bytes_and_products():
    """q and k in Q4_K fused with a Q6_K v (half the layers of a Q4_K_M model): the Q4_K rows stay in
    their GGUF bytes, and each row's products are those of its part alone, bit for bit."""
    parts = [(T.Q4_K, (128, 512)), (T.Q4_K, (64, 512)), (T.Q6_K, (64, 512))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)])
    alone = [quants.pack([(r, t, s)]) for r, (t, s) in zip(raws, parts)]
    q6_k = alone[2].nbytes
    assert joined.shape == (256, 512) and joined.nbytes - q6_k <= 1.03 * (raws[0].nbytes + raws[1].nbytes)
    x = np.random.default_rng(4).standard_normal((kernels.KERNEL_ROWS, 512)).astype(np.float32)
    for n in (1, 2, 3, kernels.KERNEL_ROWS):
        expected = np.concatenate([kernels.matmul(x[:n], w) for w in alone], axis=1)
        assert np.array_equal(kernels.matmul(x[:n], joined), expected), n


def q6_k_in_bits(raw: np.ndarray, shape: tuple[int, int]) -> quants.PackedMatrix:
    """A Q6_K tensor packed in its own bits on every profile (pack keeps them where formats.Q6_K_IN_BITS),
    so that its kernels are held to the reference on each."""
    groups = -(-shape[0] // quants.LANES)
    arrays = [np.zeros(*a) for a in k_quants.q6_k_layout(groups, shape[1])]
    quants._in_parallel_over_groups(k_quants.pack_q6_k_blocks, raw, T.Q6_K, shape, 0, arrays)
    return quants.PackedMatrix(*arrays, n_rows=shape[0])


def test_q6_k_in_its_bits_and_as_int8_give_the_same_weights_and_products():
    """Q6_K in its own bits, which float32 inputs take as int8 (quants.for_inputs): the same weights,
    and bit for bit the same products either way, with inputs as floats or bytes — a long prompt's rows
    as bytes too, for which the bits are made int8 a group at a time (Q6_K_TILES_FROM)."""
    shape = (130, 512)
    raw = raw_tensor(T.Q6_K, shape, seed=8)
    bits = q6_k_in_bits(raw, shape)
    assert quants.pack([(raw, T.Q6_K, shape)]).in_q6_k == formats.Q6_K_IN_BITS
    as_int8 = quants.for_inputs(bits, "f32")
    assert bits.in_q6_k and as_int8.values.dtype == np.int8 and bits.nbytes < 0.7 * as_int8.nbytes
    weights = reference(T.Q6_K, raw, shape)
    for w in (bits, as_int8):
        assert np.array_equal(kernels.rows(w, np.arange(shape[0])), weights)
    long = Q6_K_TILES_FROM + 3
    x = np.random.default_rng(5).standard_normal((long, 512)).astype(np.float32)
    for inputs in ("f32", "q8"):
        for n in (1, 2, 3, kernels.KERNEL_ROWS, long):
            got = kernels.matmul(x[:n], replace(bits, activations=inputs))
            want = kernels.matmul(x[:n], replace(as_int8, activations=inputs))
            assert np.array_equal(got, want), (inputs, n)
    alone = kernels.matmul(x[:1], replace(bits, activations="q8"))
    assert np.array_equal(kernels.matmul(x, replace(bits, activations="q8"))[:1], alone)  # any batch


def test_a_model_with_int8_matrices_keeps_its_q6_k_in_int8():
    """Where the processor keeps Q6_K in its bits (formats.Q6_K_IN_BITS), a model whose other matrices are
    int8 anyway (Q5_0, Q8_0: the default model) keeps its Q6_K in int8 too, one kind of kernel fewer to
    compile; a Q4_K_M model of 256-wide matrices keeps its bits. q/k in Q5_0 with a Q6_K v then join in
    one matrix, as before there was a Q6_K in bits."""
    q4_k_m = formats.own_bits(["Q4_K", "Q6_K", "F32"])
    small = formats.own_bits(["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
    assert (T.Q6_K in q4_k_m) == formats.Q6_K_IN_BITS and T.Q6_K not in small and T.Q4_K in small
    parts = [(T.Q5_0, (64, 256)), (T.Q6_K, (32, 256))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)], small)
    assert not hasattr(joined, "parts") and joined.values.dtype == np.int8
    expected = np.concatenate([reference(t, r, s) for r, (t, s) in zip(raws, parts)])
    assert np.array_equal(kernels.rows(joined, np.arange(96)), expected)


def test_every_float16_scale_is_read_exactly():
    """All 65,536 float16 bit patterns as Q8_0 block scales (subnormals, infinities, NaN included)."""
    shape = (2048, 1024)  # 65,536 blocks of 32
    blocks = np.zeros((shape[0] * shape[1] // 32, 34), np.uint8)
    blocks[:, 0:2] = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = 1  # every weight is its block's scale
    w = quants.pack([(blocks.reshape(shape[0], -1), T.Q8_0, shape)])
    expected = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        got = kernels.rows(w, np.arange(shape[0]))[:, ::32].reshape(-1)
    assert np.array_equal(got, expected, equal_nan=True)


def test_joined_parts_that_share_a_group_of_rows_keep_every_weight_exactly():
    """Parts start mid-group (70 + 40 rows): each part fills only its own rows of the shared group."""
    parts = [(T.Q5_0, (70, 256)), (T.Q8_0, (40, 256)), (T.Q4_K, (30, 256)), (T.Q6_K, (5, 256))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)])
    expected = np.concatenate([reference(t, r, s) for r, (t, s) in zip(raws, parts)])
    assert np.array_equal(kernels.rows(joined, np.arange(len(expected))), expected)


def test_a_float_part_makes_the_joined_matrix_float():
    parts = [(T.Q8_0, (64, 256)), (T.F32, (32, 256))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)])
    expected = np.concatenate([reference(t, r, s) for r, (t, s) in zip(raws, parts)])
    assert joined.scales is None and np.array_equal(kernels.rows(joined, np.arange(96)), expected)


@pytest.mark.parametrize("qtype", OWN_BITS, ids=lambda t: t.name)
def test_a_format_in_its_own_bits_stays_in_about_its_gguf_bytes(qtype):
    """Held in at most 1.15 times its GGUF bytes (4.2 times as float32), alone or joined with parts in
    other formats (q/k in Q3_K beside a Q5_K v: each kept as itself), every weight the GGUF's."""
    shape = (128, 1024)
    raw = raw_tensor(qtype, shape)
    assert quants.pack([(raw, qtype, shape)]).nbytes <= 1.15 * raw.nbytes
    parts = [(qtype, shape), (T.Q5_K, (64, 1024)), (qtype, (64, 1024))]
    raws = [raw_tensor(t, s, seed=i) for i, (t, s) in enumerate(parts)]
    joined = quants.pack([(r, t, s) for r, (t, s) in zip(raws, parts)])
    alone = quants.pack([(raws[1], T.Q5_K, parts[1][1])]).nbytes
    assert joined.nbytes - alone <= 1.15 * (raws[0].nbytes + raws[2].nbytes)
    expected = np.concatenate([reference(t, r, s) for r, (t, s) in zip(raws, parts)])
    assert np.array_equal(kernels.rows(joined, np.arange(256)), expected)


@pytest.mark.parametrize("qtype", OWN_BITS, ids=lambda t: t.name)
def test_a_format_in_its_own_bits_multiplies_as_its_weights_in_float32_bit_for_bit(qtype):
    """The kernels decode each weight as gguf.quants does and multiply it as they multiply float32
    weights, so a product is the one of the same matrix dequantized to float32, bit for bit."""
    shape = (130, 512)
    raw = raw_tensor(qtype, shape)
    w = quants.pack([(raw, qtype, shape)])
    as_f32 = quants.pack([(reference(qtype, raw, shape).view(np.uint8), T.F32, shape)])
    x = np.random.default_rng(6).standard_normal((kernels.KERNEL_ROWS, shape[1])).astype(np.float32)
    for n in (1, 2, 3, kernels.KERNEL_ROWS):
        assert np.array_equal(kernels.kernel_product(x[:n], w), kernels.kernel_product(x[:n], as_f32)), n


@pytest.mark.parametrize(
    "n_kv, group, hd, runs",
    [
        (2, 7, 64, [(0, 4096)]),  # the default model at context 4,096
        (1, 4, 256, [(5, 300)]),  # gemma3-270m's heads, a window that starts mid-block
        (4, 2, 128, [(0, 64), (192, 700), (96, 1)]),  # runs in three places, one of a single position
        (2, 8, 128, [(0, 600)]),  # Qwen3's and gpt-oss's groups of 8: two passes of 4 heads' values
        (1, 6, 80, [(0, 300)]),  # 4 heads' values, then 2; a head of 5 vectors (AVX-512: a partial block)
        (2, 1, 16, [(3, 1)]),  # one position
    ],
)
def test_one_token_attention_equals_softmax_attention(n_kv, group, hd, runs):
    """The compiled attention of one token (chunks of positions merged as flash-decoding does, its own
    exp) against softmax(q·k)·v in float64, over runs of positions where a sequence's blocks lie."""
    rng = np.random.default_rng(4)
    size = max(f + n for f, n in runs) + 7  # a layer of the cache, positions past the runs unread
    k = rng.standard_normal((n_kv, size, hd), dtype=np.float32) * 2
    v = rng.standard_normal((n_kv, size, hd), dtype=np.float32)
    q = rng.standard_normal((n_kv, group, hd), dtype=np.float32) * 0.5
    got = kernels.one_token_attention(q, k, v, runs)
    where = np.concatenate([np.arange(f, f + n) for f, n in runs])
    scores = q.astype(np.float64) @ k[:, where].astype(np.float64).transpose(0, 2, 1)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True)) @ v[:, where].astype(np.float64)
    assert got.shape == (n_kv, group, hd) and got.dtype == np.float32
    assert np.abs(got - expected).max() <= 1e-5


@pytest.mark.parametrize("cache_type", [np.float16, np.float32])
def test_tokens_attended_together_get_the_bits_each_gets_alone(cache_type):
    """Several sequences' next tokens in one call of the attention kernel (a scheduler's step of
    replies): each token's result is bit for bit its own call's, whatever the others' lengths."""
    rng = np.random.default_rng(5)
    n_kv, group, hd = 2, 7, 64
    k = rng.standard_normal((n_kv, 3000, hd), dtype=np.float32).astype(cache_type)
    v = rng.standard_normal((n_kv, 3000, hd), dtype=np.float32).astype(cache_type)
    runs = [[(0, 512)], [(600, 1700), (64, 3)], [(2400, 257)], [(0, 300)], [(10, 2900)]]
    q = rng.standard_normal((len(runs), n_kv, group, hd), dtype=np.float32) * 0.5
    together = kernels.tokens_attention(q, k, v, runs)
    for t, token_runs in enumerate(runs):
        assert np.array_equal(together[t], kernels.one_token_attention(q[t], k, v, token_runs))


def test_a_short_history_is_attended_on_the_calling_thread_with_the_bits_of_all_threads(monkeypatch):
    """Under cpu.PARALLEL_TOKEN_ATTENTION_FROM multiply-adds of scores, a step's attention wakes no thread of
    numba's (each costs more than the work): its tokens get the bits they get over all the threads."""
    from llama_chat.inference import attention

    rng = np.random.default_rng(6)
    k, v = (rng.standard_normal((2, 1200, 64), dtype=np.float32).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((2, 2, 7, 64), dtype=np.float32) * 0.5
    runs = [[(0, 700)], [(0, 512), (900, 3)]]
    threads_seen = []
    kernel = attention._one_token_attention

    def watched(*args):
        threads_seen.append(numba.get_num_threads())
        kernel(*args)

    monkeypatch.setattr(attention, "_one_token_attention", watched)
    before = numba.get_num_threads()
    alone = kernels.tokens_attention(q, k, v, runs)
    monkeypatch.setattr(attention, "PARALLEL_TOKEN_ATTENTION_FROM", 0)
    over_all = kernels.tokens_attention(q, k, v, runs)
    assert threads_seen == [1, before] and numba.get_num_threads() == before
    assert np.array_equal(alone, over_all)


def test_the_kernels_exp_is_within_two_float32_ulps():
    x = -np.concatenate([np.linspace(0, 87, 4001), [1e-8, 0.5, 20.25]]).astype(np.float32)
    got = np.array([kernels._exp_nonpositive(v) for v in x], dtype=np.float64)
    expected = np.exp(x.astype(np.float64))
    assert (np.abs(got - expected) / expected).max() <= 2.4e-7  # 2 ulps of float32
    assert 0 < kernels._exp_nonpositive(np.float32(-200.0)) < 1.3e-38  # underflow: nothing, not NaN


# The exactness checks above, in a process compiled for AVX2 (`NUMBA_CPU_NAME=haswell`: the named
# processor's own features, no AVX-512) whatever this machine has, so that both register files' kernel
# shapes are checked on any machine. Only the kernels these checks take are compiled, into the AVX2
# profile's own cache folder (inference/jit.py): once per machine, as for a user.
AVX2_CHECKS = """
import sys
sys.path.insert(0, sys.argv[1])
import gguf
import numpy as np
import test_kernels as t
from llama_chat.inference import kernels
from llama_chat.inference.cpu import PROFILE
T = gguf.GGMLQuantizationType
for qtype in (T.Q5_0, T.Q4_1, T.Q4_K, T.F16, T.BF16, T.Q3_K, T.IQ4_XS):  # ints, Q4_K, floats, blocks
    t.test_packing_keeps_every_weight_exactly(qtype)
    t.test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch(qtype)
    for n in (1, 3, kernels.KERNEL_ROWS):
        t.test_matmul_equals_float_matmul_of_the_dequantized_weights(qtype, n, kernels.kernel_product)
t.test_matmul_equals_float_matmul_of_the_dequantized_weights(T.Q4_K, 40, kernels.tile_product)
for qtype in (T.Q3_K, T.IQ4_XS, T.MXFP4, T.NVFP4, T.Q1_0):  # a decoded token straight from the blocks
    t.test_a_format_in_its_own_bits_multiplies_as_its_weights_in_float32_bit_for_bit(qtype)
for qtype in t.BYTE_FORMATS:
    for n in (1, 3, 40):
        t.test_inputs_as_bytes_multiply_exactly_as_their_bytes_say(qtype, n)
t.test_inputs_as_bytes_give_a_row_the_same_bits_in_any_batch(T.Q5_0)
t.test_one_token_attention_equals_softmax_attention(2, 7, 64, [(0, 4096)])
t.test_one_token_attention_equals_softmax_attention(4, 2, 128, [(0, 64), (192, 700), (96, 1)])
t.test_tokens_attended_together_get_the_bits_each_gets_alone(np.float16)
t.test_q6_k_in_its_bits_and_as_int8_give_the_same_weights_and_products()
print(PROFILE.isa, PROFILE.lanes, PROFILE.rows, PROFILE.pass_lanes)
"""


def test_the_kernels_are_exact_under_the_avx2_profile():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "LLAMA_CHAT_KERNEL_SHAPE")}
    env["NUMBA_CPU_NAME"] = "haswell"
    run = subprocess.run(
        [sys.executable, "-c", AVX2_CHECKS, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    isa, *shape = run.stdout.split()
    assert (isa, *map(int, shape)) == ("AVX2", *cpu.kernel_shape(8, 16))


@pytest.mark.parametrize("isa, floats, registers", list(cpu.REGISTER_FILES.values()))
def test_the_kernel_shape_fits_the_register_file(isa, floats, registers):
    """Partial sums of ROWS input rows across LANES, a vector of weights and a broadcast input fit the
    vector registers: sums that spill cost a third of the speed (AVX2 with AVX-512's shape)."""
    lanes, rows, pass_lanes = cpu.kernel_shape(floats, registers)
    assert lanes % pass_lanes == 0 and pass_lanes % floats == 0
    for n, width in ((2, lanes), (rows, pass_lanes)):  # one or two rows across all lanes; passes
        assert n * width // floats + width // floats + 1 <= registers, isa


def test_the_kernels_ask_for_weights_into_the_caches_chosen_for_the_processors_maker(tmp_path):
    """An AMD processor's kernels ask into L2 (llvm.prefetch locality 1), others' into every level (3);
    the maker is /proc/cpuinfo's vendor_id, unknown where that file says nothing or is missing."""
    amd, other, silent = tmp_path / "amd", tmp_path / "intel", tmp_path / "silent"
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    other.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    silent.write_text("processor\t: 0\n")
    assert [cpu.vendor(p) for p in (amd, other, silent, tmp_path / "none")] == [
        "AuthenticAMD", "GenuineIntel", "", "",
    ]
    assert cpu.ASK_INTO.get(cpu.vendor(amd), 3) == 1 and cpu.ASK_INTO.get(cpu.vendor(other), 3) == 3
    assert cpu.PROFILE.ask_into == cpu.ASK_INTO.get(cpu.vendor(), 3)


def test_this_process_compiles_for_its_profile_into_the_profiles_own_cache_folder():
    """numba keys its cache by processor and features but not by LANES and ROWS, which change the
    code and the packed layout: each profile (its key names them) has a folder of its own."""
    assert Path(numba.config.CACHE_DIR).name == cpu.PROFILE.key
    assert f"{kernels.LANES}-{kernels.ROWS}x{kernels.PASS_LANES}" in cpu.PROFILE.key
    other = subprocess.run(
        [sys.executable, "-c", "from llama_chat.inference.cpu import PROFILE; print(PROFILE.key)"],
        env={**os.environ, "LLAMA_CHAT_KERNEL_SHAPE": "16x3x8"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.split()[-1].endswith("-16-3x8") and other.stdout.split()[-1] != cpu.PROFILE.key


def test_compiling_for_a_model_takes_only_its_kinds_of_matrix_a_step_each(monkeypatch):
    """A first start compiles what the model's matrices take (a Q8_0 one, and Q5_0 beside a Q6_K part,
    which float32 inputs take as int8: integers without offsets) and the attention of several rows
    (every prompt's), not the float, offset or GGUF-bits kernels nor one token's attention kernel
    (app/chat/build.compile_later's) nor the unpacking loops (packing's, where a model is packed), and
    its progress moves after each signature."""
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda: None)
    seen = []
    matrices = [(T.Q8_0,), (T.Q5_0, T.Q6_K)]
    warmup.compile_kernels(lambda label, done, total: seen.append((label, done, total)), matrices, "f32")
    steps = [label.split(": ")[-1] for label, done, total in seen[:-1]]
    assert steps == ["integer weights", "attention of several rows"]
    assert [done for _, done, _ in seen] == [0, 1, 2] and {total for _, _, total in seen} == {2}


def test_a_model_with_inputs_as_bytes_compiles_their_kernels_at_its_start(monkeypatch):
    """--activations q8: the byte kernels of the model's kinds of matrix and both quantizing loops are
    compiled (or loaded), as steps of the progress, so no reply waits on the compiler; not the float32
    kernels, which none of its matrices takes. Under mixed, what each matrix takes: float32 for one
    (a Q4_K ffn_down), bytes for the other (a Q5_0 attn_qkv)."""
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda: None)
    seen = []
    warmup.compile_kernels(lambda label, done, total: seen.append(label), [(T.Q4_K,), (T.Q5_0,)], "q8")
    steps = [label.split(": ")[-1] for label in seen[:-1]]
    kinds = ["integer weights", "Q4_K weights"]
    rows = "attention of several rows"
    assert steps == ["inputs as bytes", *(f"{kind}, inputs as bytes" for kind in kinds), rows]
    seen.clear()
    warmup.compile_kernels(
        lambda label, *_: seen.append(label), [(T.Q4_K,), (T.Q5_0,)], "mixed", ["f32", "q8"]
    )
    steps = [label.split(": ")[-1] for label in seen[:-1]]
    assert steps == ["Q4_K weights", "inputs as bytes", "integer weights, inputs as bytes", rows]
