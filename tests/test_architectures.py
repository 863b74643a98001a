"""The switches that set the later architectures apart, read from their GGUFs as llama.cpp reads them
(gemma2's windows and soft-capping), and what adding switches
leaves alone: the fingerprint of the models that ran before. (Their logits against llama.cpp's:
test_llamacpp_tiny.py.)"""

from __future__ import annotations

import numpy as np

from llama_chat.inference import load_model
from llama_chat.inference.config import ADDED


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


def test_the_models_that_ran_before_keep_their_fingerprints(tiny_model_paths):
    """The fingerprint (what stored KV is keyed by) describes an added switch only where a model sets
    it: the four architectures that ran before describe the same fields as before, so their KV stays."""
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        described = load_model(tiny_model_paths[arch]).config.description()
        assert not set(described) & ADDED
    assert "n_expert" in load_model(tiny_model_paths["qwen3moe"]).config.description()
