"""What adding architectures' switches leaves alone: the fingerprint of the models that ran before.
(The later architectures' logits against llama.cpp's: test_llamacpp_tiny.py.)"""

from __future__ import annotations

from llama_chat.inference import load_model
from llama_chat.inference.config import ADDED


def test_the_models_that_ran_before_keep_their_fingerprints(tiny_model_paths):
    """The fingerprint (what stored KV is keyed by) describes an added switch only where a model sets
    it: the four architectures that ran before describe the same fields as before, so their KV stays."""
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        described = load_model(tiny_model_paths[arch]).config.description()
        assert not set(described) & ADDED
    assert "n_expert" in load_model(tiny_model_paths["qwen3moe"]).config.description()
