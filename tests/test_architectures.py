"""The switches that set the later architectures apart, read from their GGUFs as llama.cpp reads them
(gemma2's windows and soft-capping, phi3's fused matrices and LongRoPE, granite's scales, olmo2's
norms, smollm3's layers without RoPE), and what adding switches leaves alone: the fingerprint of the
models that ran before. (Their logits against llama.cpp's: test_llamacpp_tiny.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from llama_chat.app.chat.build import EngineOptions, open_model
from llama_chat.inference import load_model
from llama_chat.inference.config import ADDED, read_config
from llama_chat.inference.errors import ModelError
from llama_chat.inference.forward import rope
from tiny_later_archs import PHI3_ROPE_DIM
from tiny_models import write_tiny_model


def test_gemma2_slides_its_window_on_every_other_layer(tiny_model_paths):
    """llama.cpp's gemma2: the even layers see the last 8 positions (the tiny model's window), the odd
    ones all; a token outside every window still changes the output, through the global layers."""
    model = load_model(tiny_model_paths["gemma2"])
    cfg = model.config
    assert cfg.sliding_window == 8
    assert [cfg.is_sliding(i) for i in range(cfg.n_layer)] == [True, False, True, False]
    assert cfg.post_norms and cfg.embed_scale == 8.0 and cfg.ffn_act == "gelu"
    ids = model.tokenizer.encode("hello the world is in the air and the sun and the water")
    changed = list(ids)
    changed[1] = model.tokenizer.encode("q")[-1]
    assert np.abs(model.logits(ids)[-1] - model.logits(changed)[-1]).max() > 1e-4


def test_gemma2_caps_its_logits(tiny_model_paths):
    """Final logits pass through cap·tanh(x / cap): none reaches the GGUF's cap (8 in the tiny model,
    whose logits reach 32 without it), and attention scores are capped at 2."""
    model = load_model(tiny_model_paths["gemma2"])
    assert (model.config.final_logit_softcap, model.config.attn_logit_softcap) == (8.0, 2.0)
    logits = model.logits(model.tokenizer.encode("the hello world is in the air"))
    assert np.abs(logits).max() < 8.0
    assert np.abs(logits).max() > 6.0  # where tanh bends: the cap bites


def test_phi3_reads_its_fused_matrices_and_longrope(tiny_model_paths):
    """phi3: q/k/v in one tensor and gate/up in ffn_up, packed as they lie; RoPE on the first 12 of 16
    channels (as Phi-4-mini's 96 of 128) with the short factors and the attention factor; the GGUF's
    sliding window ignored, as llama.cpp ignores it; the context stops at the original length (256 of
    the 512 the GGUF says), where the short factors hold."""
    model = load_model(tiny_model_paths["phi3"])
    cfg, layer = model.config, model.weights.layers[0]
    assert layer.attn_qkv.shape == ((cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim, cfg.n_embd)
    assert layer.ffn_gate_up.shape == (2 * cfg.n_ff, cfg.n_embd)
    assert cfg.rope_dim == PHI3_ROPE_DIM and cfg.rope_attn_factor == np.float32(1.19)
    assert model.weights.rope_freqs.shape == (PHI3_ROPE_DIM // 2,)
    assert cfg.sliding_window == 0
    assert (model.metadata["phi3.context_length"], cfg.n_ctx_train) == (512, 256)
    assert model.new_sequence(4096).n_ctx == 256


def test_phi3_past_its_original_context_takes_the_long_factors(tiny_model_paths):
    """Asked for a context past the original length (--ctx), phi3 divides RoPE's frequencies by
    rope_factors_long, as llama.cpp does for such a context, and gets its whole trained context; its
    fingerprint differs, so KV computed with the short factors is never taken for it."""
    path = tiny_model_paths["phi3"]
    short, within, long = load_model(path), load_model(path, n_ctx=256), load_model(path, n_ctx=300)
    assert within.fingerprint == short.fingerprint and not within.config.rope_long
    assert long.config.rope_long and long.config.n_ctx_train == 512
    assert long.new_sequence(4096).n_ctx == 512
    assert long.fingerprint != short.fingerprint
    assert long.weights.rope_freqs.min() >= 4.0 > short.weights.rope_freqs.max()  # the tiny model's factors
    ids = long.tokenizer.encode("the hello world is in the air")
    assert np.abs(long.logits(ids)[-1] - short.logits(ids)[-1]).max() > 1e-3
    # --ctx 300, as the app loads
    assert open_model(EngineOptions(model=str(path), n_ctx=300)).config.rope_long


def test_granite_reads_its_scales(tiny_model_paths):
    """granite: embeddings times embedding_scale, each residual branch times residual_scale, q·k times
    attention.scale, logits divided by logit_scale (without which llama.cpp refuses the model)."""
    model = load_model(tiny_model_paths["granite"])
    cfg = model.config
    assert (cfg.embed_scale, cfg.attn_scale, cfg.logit_scale) == (12.0, np.float32(0.3), 1.25)
    assert cfg.residual_scale == np.float32(0.22) and not cfg.rope_neox
    without = {k: v for k, v in model.metadata.items() if k != "granite.logit_scale"}
    with pytest.raises(ModelError, match="missing metadata granite.logit_scale"):
        read_config(without, model.path)


def test_olmo2_norms_after_and_over_whole_projections(tiny_model_paths):
    """olmo2: no norm before attention or the FFN, norms after both; q and k normed over all their
    heads at once (weights [n_head·head_dim] and [n_head_kv·head_dim])."""
    model = load_model(tiny_model_paths["olmo2"])
    cfg, layer = model.config, model.weights.layers[0]
    assert not cfg.pre_norms and cfg.post_norms and cfg.qk_norm_whole and cfg.rope_neox
    assert layer.attn_norm is None and layer.ffn_norm is None
    assert layer.attn_q_norm.shape == (cfg.n_head * cfg.head_dim,)
    assert layer.attn_k_norm.shape == (cfg.n_head_kv * cfg.head_dim,)


def test_an_olmo2_with_sliding_windows_is_refused_in_one_line(tmp_path):
    """OLMo 3 is an olmo2 with sliding windows (and YaRN), which are not read here: refused at load,
    not run as OLMo 2."""
    path = write_tiny_model(tmp_path / "olmo3.gguf", "olmo2", metadata={"olmo2.attention.sliding_window": 8})
    with pytest.raises(
        ModelError, match=r"olmo3\.gguf: olmo2 with a sliding window \(OLMo 3\) is not supported$"
    ):
        load_model(path)


def test_smollm3_turns_no_rope_on_every_fourth_layer(tmp_path):
    """smollm3: layers 3, 7, 11… attend without positions (llama.cpp's n_no_rope_layer_step, 4, no
    key); a context shift leaves their keys as they are and turns the others'."""
    model = load_model(write_tiny_model(tmp_path / "smollm3.gguf", "smollm3", n_layer=8))
    assert [model.config.rotates(i) for i in range(8)] == [True, True, True, False] * 2
    seq = model.new_sequence(64)
    model.forward(model.tokenizer.encode("the hello world is in the air and the sun"), seq)

    def keys(layer: int) -> np.ndarray:  # [kv_head, n_tokens, hd]
        return np.concatenate([k for k, _ in seq.views(0, seq.n_tokens).layer(layer)], axis=1).astype(
            np.float32
        )

    before = [keys(i) for i in range(8)]
    model.context_shift(seq, 1, 2)
    assert np.array_equal(keys(3), np.delete(before[3], [1, 2], axis=1))
    assert not np.allclose(keys(2), np.delete(before[2], [1, 2], axis=1), atol=1e-3)
    seq.free()


def test_partial_rope_turns_only_the_first_channels():
    """With n_rot of hd channels turned, the rest pass untouched, and the turned ones are a rotation
    (scaled by the attention factor): their norm per pair is kept times it."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    turned = rope(x, np.arange(3, 8), 10000.0, True, None, n_rot=12, scale=1.5)
    assert np.array_equal(turned[..., 12:], x[..., 12:])
    pairs = lambda a: np.hypot(a[..., :6], a[..., 6:12])  # noqa: E731 (neox pairs: i and i + n_rot/2)
    assert np.allclose(pairs(turned), 1.5 * pairs(x), rtol=1e-5)
    assert np.allclose(turned[..., :12], rope(x[..., :12], np.arange(3, 8), 10000.0, True, None, scale=1.5))


def test_the_models_that_ran_before_keep_their_fingerprints(tiny_model_paths):
    """The fingerprint (what stored KV is keyed by) describes an added switch only where a model sets
    it: the four architectures that ran before describe the same fields as before, so their KV stays."""
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        described = load_model(tiny_model_paths[arch]).config.description()
        assert not set(described) & ADDED
    assert "n_expert" in load_model(tiny_model_paths["qwen3moe"]).config.description()


def test_kv_computed_from_bytes_is_keyed_by_their_arithmetic(tiny_model_paths, monkeypatch):
    """The products over bytes changed (offsets times the sum of the bytes): KV stored by the earlier
    arithmetic has another key, so it is recomputed rather than resumed; exact (f32) KV keeps its key."""
    from llama_chat.inference import weights

    path = tiny_model_paths["qwen2"]
    now = {mode: load_model(path, activations=mode).fingerprint for mode in ("f32", "q8", "mixed")}
    monkeypatch.setattr(weights, "BYTES_REVISION", weights.BYTES_REVISION - 1)
    before = {mode: load_model(path, activations=mode).fingerprint for mode in now}
    assert before["f32"] == now["f32"] and before["q8"] != now["q8"] and before["mixed"] != now["mixed"]
