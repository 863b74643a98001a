"""benchmarks/synthetic_model.py: a real model's Q4_K_M layout with random weights, on a tiny shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from llama_chat.inference import load_model, load_tokenizer

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "synthetic_model.py"
spec = importlib.util.spec_from_file_location("synthetic_model", SCRIPT)
synthetic = sys.modules["synthetic_model"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(synthetic)

# Eight layers: llama.cpp's Q4_K_M keeps attn_v and ffn_down of layers 0, 3, 6 and 7 in Q6_K.
TINY = {
    "qwen2": synthetic.Shape("qwen2", 8, 256, 512, 2, 1, qkv_bias=True),
    "llama": synthetic.Shape("llama", 8, 256, 512, 2, 1, rope_base=5e5, llama3_rope=True),
}


@pytest.fixture(params=sorted(TINY))
def written(request, tmp_path, qwen2):
    shape = TINY[request.param]
    return synthetic.write_synthetic(tmp_path / "synthetic.gguf", "tiny", shape, qwen2), qwen2


def test_tensor_types_are_llama_cpp_q4_k_m(written):
    path, _ = written
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    q6 = {name for name, kind in types.items() if kind == gguf.GGMLQuantizationType.Q6_K}
    assert q6 == {"output.weight"} | {
        f"blk.{i}.{w}.weight" for i in (0, 3, 6, 7) for w in ("attn_v", "ffn_down")
    }
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert types["blk.1.attn_v.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert all(kind == gguf.GGMLQuantizationType.F32 for name, kind in types.items() if "norm" in name)


def test_weights_have_a_trained_models_spread(written):
    path, _ = written
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            assert abs(values.std() - synthetic.WEIGHT_STD) < 0.002, tensor.name
            assert abs(values.mean()) < 0.002, tensor.name


def test_a_mixture_of_experts_is_written_as_q4_k_m_writes_it(tmp_path, qwen2):
    """qwen3moe: the router in float32, the experts' 3-D tensors in Q4_K (ffn_down_exps in Q6_K on the
    layers of more_bits, as ffn_down), q/k norms; it loads and gives finite logits."""
    experts = {"n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256}
    shape = synthetic.Shape("qwen3moe", 8, 256, 512, 2, 1, qk_norm=True, **experts)
    path = synthetic.write_synthetic(tmp_path / "moe.gguf", "tiny-moe", shape, qwen2)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    Q = gguf.GGMLQuantizationType
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert [int(n) for n in reversed(tensors["blk.1.ffn_gate_exps.weight"].shape)] == [8, 256, 256]
    down = [tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type for i in range(8)]
    assert {i for i, kind in enumerate(down) if kind == Q.Q6_K} == {0, 3, 6, 7}
    assert tensors["blk.2.ffn_up_exps.weight"].tensor_type == Q.Q4_K and "blk.2.attn_q_norm.weight" in tensors
    model = load_model(path)
    assert (model.config.n_expert, model.config.n_expert_used, model.config.n_ff_exp) == (8, 2, 256)
    assert np.isfinite(model.logits(load_tokenizer(path).encode("hello there, the world"))).all()


def test_gpt_oss_is_written_as_its_mxfp4_gguf_lays_it_out(tmp_path, qwen2):
    """gpt-oss: experts in MXFP4 with a trained model's spread, the other matrices in Q8_0, biases,
    sinks, a window and YaRN; it loads and gives finite logits."""
    experts = {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 256}
    shape = synthetic.Shape(
        "gpt-oss", 2, 256, 256, 4, 2, head_dim=64, qkv_bias=True, sliding_window=16, yarn=(32.0, 4096),
        **experts,
    )
    path = synthetic.write_synthetic(tmp_path / "gpt-oss.gguf", "tiny-gpt-oss", shape, qwen2)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    Q = gguf.GGMLQuantizationType
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == Q.MXFP4
    assert tensors["blk.0.attn_q.weight"].tensor_type == tensors["output.weight"].tensor_type == Q.Q8_0
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.attn_output.weight"):
        values = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
        assert abs(values.std() - synthetic.WEIGHT_STD) < 0.004, name
    assert "blk.1.attn_sinks.weight" in tensors and "blk.0.ffn_gate_exps.bias" in tensors
    model = load_model(path)
    assert (model.config.sliding_window, model.config.yarn) == (16, (32.0, 4096))
    assert np.isfinite(model.logits(load_tokenizer(path).encode("hello there, the world"))).all()


def test_loads_with_the_source_tokenizer_and_gives_finite_logits(written):
    path, source = written
    assert load_tokenizer(path).encode("hello there") == load_tokenizer(source).encode("hello there")
    logits = load_model(path).logits(load_tokenizer(path).encode("hello there, the world"))
    assert np.isfinite(logits).all() and logits.std() > 0.01
