"""A model in each format kept in its own bits (formats.OWN_BITS): held in about its GGUF's bytes, and
its logits those of the same model with its matrices dequantized to float32; a decoded token's
products in the block formats exactly those of gguf.quants' weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from test_kernels import OWN_BITS, SCALE_BYTES, raw_tensor

from llama_chat.inference import block_formats, ggml_quants, kernels, load_model, quants
from llama_chat.inference.support import gguf_needs
from tiny_models import write_tiny_model

T = gguf.GGMLQuantizationType
DIMS = (256, 4, 2, 64, 256)  # n_embd, heads, KV heads, head_dim, n_ff: every matrix's columns 256s
# Scales of the random blocks that keep their weights about 0.1 (a block's largest scale times value)
SCALE = {
    T.Q2_K: 2e-3, T.Q3_K: 1e-3, T.IQ4_NL: 1e-3, T.IQ4_XS: 3e-5, T.IQ2_XXS: 6e-4, T.IQ2_XS: 6e-4,
    T.IQ2_S: 6e-4, T.IQ3_XXS: 2e-4, T.IQ3_S: 2e-4, T.IQ1_S: 6e-3, T.IQ1_M: 6e-3,
    T.Q4_K: 1e-4, T.Q5_K: 5e-5, T.Q6_K: 3e-5,
}


def tiny_model_in(path, qtype: T, as_float32: bool = False, gain: float = 1.0, embeddings: bool = False):
    """A tiny llama whose layer matrices and output are in `qtype` (or, as_float32, the same weights
    dequantized to float32), their weights `gain` times the usual ones; `embeddings`: its token
    embeddings in `qtype` instead, and every matrix in float32."""

    def matrix_bytes(name, data):
        if qtype not in SCALE_BYTES:  # formats gguf.quants (or ggml_quants) writes: the weights quantized
            raw = ggml_quants.quantize(data * np.float32(gain), qtype).view(np.uint8)
        else:
            raw = raw_tensor(qtype, data.shape, seed=sum(name.encode()), scale=SCALE[qtype] * gain)
        if as_float32:
            return np.asarray(ggml_quants.dequantize(raw, qtype), np.float32).reshape(data.shape), T.F32
        return raw, qtype

    if embeddings:
        return write_tiny_model(path, "llama", dims=DIMS, quantized=False, embedding_bytes=matrix_bytes)
    return write_tiny_model(path, "llama", dims=DIMS, matrix_bytes=matrix_bytes)


@pytest.mark.parametrize("qtype", OWN_BITS, ids=lambda t: t.name)
def test_a_model_in_its_own_bits_is_about_its_gguf_and_computes_as_float32(tmp_path, qtype):
    path = tiny_model_in(tmp_path / f"{qtype.name}.gguf", qtype)
    twin = tiny_model_in(tmp_path / "f32.gguf", qtype, as_float32=True)
    model, float32 = load_model(path), load_model(twin)
    reader = gguf.GGUFReader(path)
    in_gguf = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == qtype)
    resident = sum(m.nbytes for m in model.weights.matrices())
    assert resident <= 1.15 * in_gguf
    ids = model.tokenizer.encode("The formats people download run in their own bits.")
    assert np.array_equal(model.logits(ids), float32.logits(ids))
    assert gguf_needs(path)["formats"][qtype.name]["kept"] == "kept in its own bits"


def test_mxfp4_experts_are_kept_in_their_bits_and_compute_as_float32(tmp_path):
    """gpt-oss keeps its experts in MXFP4: a mixture's 3-D expert tensors in MXFP4, each expert's slice
    packed as any matrix, held in the GGUF's bytes, with the logits of the same experts in float32."""

    def experts_in(path, as_float32: bool):
        def matrix_bytes(name, data):
            if "_exps" not in name:
                return data, T.F32
            raw = gguf.quants.quantize(data, T.MXFP4)
            if as_float32:
                return np.asarray(gguf.quants.dequantize(raw, T.MXFP4), np.float32).reshape(data.shape), T.F32
            return raw, T.MXFP4

        return write_tiny_model(path, "qwen3moe", matrix_bytes=matrix_bytes)

    model = load_model(experts_in(tmp_path / "mxfp4.gguf", False))
    float32 = load_model(experts_in(tmp_path / "f32.gguf", True))
    in_gguf = sum(int(t.n_bytes) for t in gguf.GGUFReader(model.path).tensors if t.tensor_type == T.MXFP4)
    experts = [layer.experts for layer in model.weights.layers]
    assert sum(m.nbytes for e in experts for m in e.gate_up + e.down) <= 1.15 * in_gguf
    ids = model.tokenizer.encode("Experts in four bits.")
    assert np.array_equal(model.logits(ids), float32.logits(ids))


@pytest.mark.parametrize("qtype", OWN_BITS[2:], ids=lambda t: t.name)  # the block formats
def test_a_decoded_tokens_product_in_a_block_format_is_exactly_its_gguf_weights(qtype):
    """One row (a decoded token) multiplies straight from the blocks (block_formats.one_row_group): its
    products are, bit for bit, a fused multiply-add a column over the weights gguf.quants dequantizes
    (one_row_reference). MXFP4 also from random blocks, their scales spread over 2^-20 … 2^4; NVFP4
    from random blocks with every byte of UE4M3 as a scale (its subnormals, 0x7F read as 0)."""
    shape = (130, 512)
    raws = [raw_tensor(qtype, shape)]
    if qtype == T.MXFP4:
        blocks = np.random.default_rng(7).integers(0, 256, (shape[0] * shape[1] // 32, 17), dtype=np.uint8)
        blocks[:, 0] = np.random.default_rng(8).integers(107, 132, len(blocks))
        raws.append(blocks.reshape(shape[0], -1))
    if qtype == T.NVFP4:
        blocks = np.random.default_rng(7).integers(0, 256, (shape[0] * shape[1] // 64, 36), dtype=np.uint8)
        blocks[:, :4] = np.arange(blocks[:, :4].size).reshape(-1, 4) % 256
        raws.append(blocks.reshape(shape[0], -1))
    x = np.random.default_rng(9).standard_normal((1, shape[1])).astype(np.float32)
    for raw in raws:
        w = quants.pack([(raw, qtype, shape)])
        want = block_formats.one_row_reference(w.values, x)[:, : shape[0]]
        assert np.array_equal(kernels.kernel_product(x, w), want)


def test_q1_0_is_read_and_written_as_ggml_quants_c_does():
    """gguf.quants has no Q1_0: ggml_quants' port of quantize_row_q1_0_ref and dequantize_row_q1_0. A block
    is d = the mean |x| as float16, then a bit a weight (set where x ≥ 0, bit j % 8 of byte j / 8);
    a weight is d or −d."""
    x = np.where(np.arange(128) % 3 == 0, 0.75, -0.75).astype(np.float32)[None]
    block = ggml_quants.quantize(x, T.Q1_0)
    assert block.shape == (1, 18) and block[0, :2].view(np.float16)[0] == 0.75
    assert block[0, 2] == 0b01001001 and block[0, 3] == 0b10010010  # weights 0, 3, 6; then 9, 12, 15
    assert np.array_equal(ggml_quants.dequantize(block, T.Q1_0), x)
    ramp = (np.arange(128, dtype=np.float32) / 128)[None]  # all ≥ 0: every weight the mean, 127/256
    block = ggml_quants.quantize(ramp, T.Q1_0)
    assert np.array_equal(ggml_quants.dequantize(block, T.Q1_0), np.full((1, 128), 127 / 256))


def test_nvfp4_is_written_as_ggml_quants_c_does():
    """gguf.quants reads NVFP4 but does not write it: ggml_quants' port of quantize_row_nvfp4_ref. Each
    16 weights' scale is the UE4M3 of their largest |x| / 6 (halved when read, as the e2m1 values are
    doubled), each weight the nearest e2m1 value (the first of two equally near), weight j of a
    sub-block in the low nibble of its byte j, weight 8 + j in the high one."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    sub = np.concatenate([e2m1, -e2m1])  # indices 0…15, −0 read as the first 0
    x = np.concatenate([sub, sub / 8, sub * 2, sub[::-1]])[None]
    block = ggml_quants.quantize(x, T.NVFP4)
    assert block.shape == (1, 36) and list(block[0, :4]) == [0x38, 0x20, 0x40, 0x38]  # 1, 1/8, 2, 1
    assert list(block[0, 4:12]) == [0x00, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7]
    assert np.array_equal(ggml_quants.dequantize(block, T.NVFP4), x)
