"""Every architecture against llama.cpp, on its tiny model: the same token ids for a text and for a chat
prompt in the family's template, the same logits at every position, the same greedy reply
(tests/fixtures/llamacpp/tiny.json, written by benchmarks/make_tiny_reference.py with llama-cpp-python;
float32 weights and KV on both sides, so that a difference of the architecture is not lost in rounding)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llama_chat.inference import chat_prompt_ids, chat_template, load_model
from tiny_later_archs import LONG_CONTEXT
from tiny_models import ARCHS, FixtureDay, write_tiny_model

LLAMACPP = Path(__file__).parent / "fixtures" / "llamacpp"
REFERENCE = json.loads((LLAMACPP / "tiny.json").read_text())
# ggml computes GELU from a float16 table (GGML_GELU_FP16): 0.0025 and 0.0032 from the exact function
# on the gemmas' logits; every other architecture agrees to 2e-5.
TOLERANCE = {"gemma2": 5e-3, "gemma3": 5e-3}
# every architecture, and the models run past their original context (phi3 with its long factors)
REFERENCES = ARCHS + tuple(LONG_CONTEXT)


@pytest.fixture(scope="module")
def float_models(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("float-models")
    return {arch: write_tiny_model(folder / f"tiny-{arch}.gguf", arch, quantized=False) for arch in ARCHS}


@pytest.fixture
def reference_model(request, float_models, monkeypatch):
    monkeypatch.setattr(chat_template, "datetime", FixtureDay)  # the day the fixtures' prompts were rendered
    name = request.param
    arch, n_ctx = LONG_CONTEXT.get(name, (name, None))
    return name, load_model(float_models[arch], cache_type="f32", n_ctx=n_ctx), REFERENCE["models"][name]


@pytest.mark.parametrize("reference_model", REFERENCES, indirect=True)
def test_tokens_are_llamacpps(reference_model):
    _, model, ref = reference_model
    tok = model.tokenizer
    assert tok.encode(REFERENCE["text"], add_bos=tok.add_bos) == ref["text_ids"]
    assert chat_prompt_ids(model, REFERENCE["messages"]) == ref["prompt_ids"]


@pytest.mark.parametrize("reference_model", REFERENCES, indirect=True)
def test_logits_at_every_position_are_llamacpps(reference_model):
    arch, model, ref = reference_model
    expected = np.load(LLAMACPP / f"tiny.{arch}.npy")
    logits = model.logits(ref["text_ids"])
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= TOLERANCE.get(arch, 1e-3)
    assert (logits.argmax(axis=1) == expected.argmax(axis=1)).all()


@pytest.mark.parametrize("reference_model", REFERENCES, indirect=True)
def test_greedy_reply_is_llamacpps(reference_model):
    """Token for token, prompt in one pass then a token a pass, as llama.cpp decoded it (whose two best
    tokens were never closer than the logits' difference above)."""
    _, model, ref = reference_model
    seq = model.new_sequence(len(ref["prompt_ids"]) + len(ref["greedy_ids"]))
    logits = model.forward(ref["prompt_ids"], seq)[-1]
    greedy = []
    for _ in ref["greedy_ids"]:
        greedy.append(int(np.argmax(logits)))
        logits = model.forward([greedy[-1]], seq)[-1]
    assert greedy == ref["greedy_ids"]
