"""The float16 live KV cache: conversions in the compiled kernels, attention over it, its size."""

from __future__ import annotations

import numpy as np
import pytest

from llama_chat.inference import half, kernels, load_model
from llama_chat.inference.jit import njit


@njit
def _read(h, out):
    for i in range(h.size):
        out[i] = half.to_f32(h[i])


@njit
def _write(x, out):
    for i in range(x.size):
        out[i] = half.store(x[i], out)


@njit
def _read_portable(h, out):
    for i in range(h.size):
        out[i] = half.half_to_float_portable(h[i])


@njit
def _write_portable(x, out):
    for i in range(x.size):
        out[i] = half.float_to_half_portable(x[i])


def floats_to_round() -> np.ndarray:
    """Every finite float16, the float32 just above each (ties and near-ties), and normal values of
    every scale from below float16's subnormals to past its largest, with inf and NaN."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    every = every[np.isfinite(every)]
    rng = np.random.default_rng(0)
    scaled = [rng.standard_normal(4096).astype(np.float32) * np.float32(s) for s in (1e-8, 1e-5, 1, 300, 7e4)]
    special = np.array([np.inf, -np.inf, np.nan, 65519.99, 65520.0, -0.0], np.float32)
    return np.concatenate([every, np.nextafter(every, np.float32(np.inf)), *scaled, special])


@pytest.mark.parametrize("read", [_read, _read_portable])
def test_every_float16_reads_as_numpy_reads_it(read):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(bits.size, np.float32)
    read(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("write", [_write, _write_portable])
def test_float32_rounds_to_float16_as_numpy_rounds_it(write):
    x = floats_to_round()
    got = np.empty(x.size, np.uint16)
    write(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(got.view(np.float16), want, equal_nan=True)
    assert np.array_equal(np.signbit(got.view(np.float16)), np.signbit(want))


def test_storing_into_a_float32_array_keeps_the_value():
    x = floats_to_round()
    got = np.empty_like(x)
    _write(x, got)
    assert np.array_equal(got, x, equal_nan=True)


def test_one_token_attention_over_a_float16_cache_reads_its_values_exactly():
    """The kernel over float16 keys and values equals the kernel over the same values in float32."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 300, 64)).astype(np.float16)
    v = rng.standard_normal((2, 300, 64)).astype(np.float16)
    q = rng.standard_normal((2, 3, 64)).astype(np.float32) / 8
    runs = np.array([(10, 150), (200, 90)])  # two runs of the cache, as a sequence's blocks may lie
    got = kernels.one_token_attention(q, k, v, runs)
    want = kernels.one_token_attention(q, k.astype(np.float32), v.astype(np.float32), runs)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_float16_cache_holds_twice_the_tokens_of_a_float32_one_in_the_same_ram(tiny_model_path):
    f16 = load_model(tiny_model_path, cache_ram_mb=4)
    f32 = load_model(tiny_model_path, cache_ram_mb=4, cache_type="f32")
    assert f16.pool.cache_type == "f16"  # the default, as llama.cpp's
    assert f16.pool.token_bytes * 2 == f32.pool.token_bytes
    assert f16.pool.n_slots // 2 == f32.pool.n_slots  # (give or take the rounding of the budget)


def test_an_unknown_cache_type_is_refused_in_one_line(tiny_model_path):
    with pytest.raises(ValueError, match="unknown KV cache type 'q3'"):
        load_model(tiny_model_path, cache_type="q3")


def test_inputs_as_bytes_answer_near_the_exact_model_with_kv_of_their_own(tiny_model_paths):
    """--activations q8: products on inputs quantized to bytes (the tiny Gemma's output matrix, its Q8_0
    embeddings) give logits near the exact ones, and KV computed so is kept apart (another fingerprint)."""
    exact = load_model(tiny_model_paths["gemma3"], cache_ram_mb=4, activations="f32")
    as_bytes = load_model(tiny_model_paths["gemma3"], cache_ram_mb=4, activations="q8")
    assert as_bytes.fingerprint != exact.fingerprint
    assert as_bytes.weights.activations == "q8"
    ids = list(range(1, 40))
    want, got = exact.logits(ids), as_bytes.logits(ids)
    assert not np.array_equal(got, want)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_mixed_inputs_go_as_bytes_only_where_they_come_from_a_norm(tiny_model_paths):
    """--activations mixed: q/k/v, gate/up and the output matrix take their inputs as bytes, the attention
    output and FFN down matrices float32 (the outlying channels of their inputs); its KV is its own."""
    path = tiny_model_paths["qwen2"]
    mixed = load_model(path, cache_ram_mb=4, activations="mixed")
    others = {load_model(path, cache_ram_mb=4, activations=a).fingerprint for a in ("f32", "q8")}
    assert mixed.fingerprint not in others
    layer = mixed.weights.layers[0]
    inputs = {kind: {p.activations for p in getattr(w, "parts", [w])} for kind, w in vars(layer).items()
              if hasattr(w, "n_rows")}
    assert inputs == {"attn_qkv": {"q8"}, "ffn_gate_up": {"q8"}, "attn_output": {"f32"}, "ffn_down": {"f32"}}
    assert mixed.weights.output.activations == "q8"
    ids = list(range(1, 40))
    want, got = load_model(path, cache_ram_mb=4, activations="f32").logits(ids), mixed.logits(ids)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_unknown_activations_are_refused_in_one_line(tiny_model_path):
    with pytest.raises(ValueError, match="activations must be one of f32, q8, mixed, not 'q4'"):
        load_model(tiny_model_path, activations="q4")
