"""Agreement with llama.cpp on the two real models: logits, greedy chat replies, the chat prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FIXTURES, real_cache
from llama_chat.inference import GenerationStats, Model, SamplingParams, chat_prompt_ids, generate
from llama_chat.inference.activation_modes import DEFAULT_ACTIVATIONS
from llama_chat.inference.weights import prepare

pytestmark = pytest.mark.real_model

REFERENCE = json.loads((FIXTURES / "llamacpp" / "reference.json").read_text())
CHAT_REFERENCE = json.loads((FIXTURES / "llamacpp" / "chat_reference.json").read_text())
QWEN, GEMMA = "qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m"
TEXTS = ["story", "code", "facts"]


# The real models of this module, loaded once for it and freed at its end (each holds hundreds of MB; the
# real-model tests all run on one worker, which goes on to others).
def load(path, activations: str = DEFAULT_ACTIVATIONS) -> Model:
    with real_cache():
        return Model(prepare(path, activations=activations))


@pytest.fixture(scope="module")
def qwen_model(qwen_model_path):
    """Computed exactly (--activations f32), as the fixtures of llama.cpp were measured against; the
    default mode is held to its own checks below."""
    return load(qwen_model_path, "f32")


@pytest.fixture(scope="module")
def gemma_model(gemma_model_path):
    return load(gemma_model_path, "f32")


@pytest.fixture
def real_model(request, qwen_model, gemma_model):
    return {QWEN: qwen_model, GEMMA: gemma_model}[request.param]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.fixture(scope="module")
def our_logits(qwen_model, gemma_model):
    """Teacher-forced logits of every reference text, computed once per model (what the tests read)."""
    models = {QWEN: qwen_model, GEMMA: gemma_model}
    return {
        (name, text): read_back(models[name], REFERENCE[name]["logits"][text])
        for name in (QWEN, GEMMA)
        for text in TEXTS
    }


def read_back(model, ref: dict) -> SimpleNamespace:
    """What the tests compare of a model's logits on a reference text: the best token and the logits of
    llama.cpp's top 20 at each position, and the whole last row. Not all of them: a text's logits are
    vocabulary × positions (a quarter GB for Gemma's extra texts), held for the whole module."""
    logits = model.logits(ref["ids"])
    return SimpleNamespace(
        dtype=logits.dtype,
        best=logits.argmax(axis=1),
        top20=[logits[i, ids] for i, ids in enumerate(ref["top20_ids"])],
        last=logits[-1].copy(),
    )


@pytest.mark.parametrize("name", [QWEN, GEMMA])
@pytest.mark.parametrize("text", TEXTS)
def test_best_token_matches_where_llamacpp_is_sure(our_logits, name, text):
    ref = REFERENCE[name]["logits"][text]
    ours = our_logits[name, text]
    assert ours.dtype == np.float32
    checked = 0
    for i, (ids, values) in enumerate(zip(ref["top20_ids"], ref["top20_logits"])):
        if values[0] - values[1] >= 0.5:
            assert int(ours.best[i]) == ids[0], f"position {i}"
            checked += 1
    assert checked >= len(ref["ids"]) // 2


# llama.cpp's own spread on every text: how far its f32-KV run lands from its default f16-KV run
# (benchmarks/make_extra_reference.py, llama-cpp-python 0.3.36). Where llama.cpp disagrees with itself
# by more than 1.0, ours may be as far from it as it is from itself, and no farther.
EXTRA = json.loads((FIXTURES / "llamacpp" / "extra_reference.json").read_text())


# Gemma-3 is numerically touchy at a few positions: on the 'code' text llama.cpp moves its own top-20
# by 1.38 when only its KV cache type changes (f16 → f32); ours land 1.14 from its default there, inside
# that spread. Emulating ggml's arithmetic in NumPy (activations quantized to Q8_0 / Q8_K before each
# matmul, float16 KV, ggml's float16 GELU table) did not bring Gemma closer over the seven texts: with
# the activations quantized, 'story' went 0.86 → 0.69 and 'code' 1.14 → 1.25, 'json' 3.35 → 5.22,
# 'shell' 2.04 → 1.75 with its last-position KL over 0.01; so float32 is kept.
@pytest.mark.parametrize("name", [QWEN, GEMMA])
@pytest.mark.parametrize("text", TEXTS)
def test_top20_logits_within_one(our_logits, name, text):
    """Within 1.0 of llama.cpp's top-20 logits, or within llama.cpp's own spread where that is wider."""
    ref = REFERENCE[name]["logits"][text]
    ours = our_logits[name, text]
    pairs = zip(ours.top20, ref["top20_logits"])
    worst = max(np.abs(top20 - np.asarray(values)).max() for top20, values in pairs)
    assert worst <= max(1.0, EXTRA["fixture_spreads"][name][text])


@pytest.mark.parametrize("name", [QWEN, GEMMA])
@pytest.mark.parametrize("text", TEXTS)
def test_last_position_kl_below_001(our_logits, name, text):
    reference = np.load(FIXTURES / "llamacpp" / f"{name}.{text}.last.npy")
    p, q = log_softmax(reference), log_softmax(our_logits[name, text].last)
    kl = float((np.exp(p) * (p - q)).sum())
    assert kl <= 0.01


@pytest.mark.parametrize("case", sorted(CHAT_REFERENCE["greedy"]))
def test_greedy_chat_reply_equals_llamacpp(qwen_model, case):
    ref = CHAT_REFERENCE["greedy"][case]
    ids = chat_prompt_ids(qwen_model, ref["messages"])
    assert qwen_model.chat_template.render(ref["messages"]) == ref["prompt"]
    assert ids == ref["prompt_ids"]
    stats = GenerationStats()
    text = "".join(
        generate(
            qwen_model,
            ids,
            sampling=SamplingParams(temperature=0),
            max_tokens=len(ref["greedy_ids"]),
            stats=stats,
        )
    )
    assert stats.token_ids == ref["greedy_ids"]
    assert text == ref["greedy_text"]


@pytest.fixture(scope="module")
def qwen_mixed(qwen_model_path):
    """The default model with bytes only for the inputs that come from a norm (--activations mixed)."""
    return load(qwen_model_path, "mixed")


@pytest.mark.parametrize("case", sorted(CHAT_REFERENCE["greedy"]))
def test_mixed_inputs_keep_the_greedy_chat_replies(qwen_mixed, case):
    """With bytes only where the inputs come from a norm, the default model's greedy replies are llama.cpp's
    too."""
    ref = CHAT_REFERENCE["greedy"][case]
    stats = GenerationStats()
    sampling = SamplingParams(temperature=0)
    "".join(
        generate(
            qwen_mixed, ref["prompt_ids"], sampling=sampling, max_tokens=len(ref["greedy_ids"]), stats=stats
        )
    )
    assert stats.token_ids == ref["greedy_ids"]


@pytest.fixture(scope="module")
def in_default_mode(qwen_model_path, gemma_model_path):
    """Both real models as a user gets them: --activations q8 (every product's inputs as bytes, as
    llama.cpp's), by default."""
    return {QWEN: load(qwen_model_path), GEMMA: load(gemma_model_path)}


def test_the_default_mode_is_bytes_and_its_kv_its_own(in_default_mode, qwen_model, qwen_mixed):
    assert in_default_mode[QWEN].weights.activations == "q8"
    # KV computed in one mode is never resumed in another
    fingerprints = {in_default_mode[QWEN].fingerprint, qwen_model.fingerprint, qwen_mixed.fingerprint}
    assert len(fingerprints) == 3


@pytest.mark.parametrize("case", sorted(CHAT_REFERENCE["greedy"]))
def test_the_default_mode_keeps_the_greedy_chat_replies(in_default_mode, case):
    """The default model's greedy replies in the default mode are llama.cpp's, token for token."""
    ref = CHAT_REFERENCE["greedy"][case]
    stats = GenerationStats()
    sampling = SamplingParams(temperature=0)
    model = in_default_mode[QWEN]
    "".join(
        generate(model, ref["prompt_ids"], sampling=sampling, max_tokens=len(ref["greedy_ids"]), stats=stats)
    )
    assert stats.token_ids == ref["greedy_ids"]


# The exact model's logits on llama.cpp's top 20 of every text: every matrix product in float64 on the
# dequantized weights, a float32 KV cache (benchmarks/exact_reference.py --write-fixture).
EXACT = json.loads((FIXTURES / "llamacpp" / "exact_top20.json").read_text())["models"]


def from_exact(model, name: str, text: str) -> tuple[float, float]:
    """The worst top-20 logit's distance from the exact model's on one reference text: the model's, and
    llama.cpp's own (it multiplies bytes too)."""
    ref = {**REFERENCE[name]["logits"], **EXTRA["models"][name]}[text]
    logits = model.logits(ref["ids"])
    exact = [np.asarray(values) for values in EXACT[name][text]]
    ours = max(np.abs(logits[i, ids] - exact[i]).max() for i, ids in enumerate(ref["top20_ids"]))
    theirs = max(np.abs(np.asarray(values) - exact[i]).max() for i, values in enumerate(ref["top20_logits"]))
    return ours, theirs


@pytest.mark.parametrize("name, text", [(name, text) for name in EXACT for text in EXACT[name]])
def test_the_default_mode_lies_no_farther_from_the_exact_model_than_llamacpp(in_default_mode, name, text):
    """On every reference text (the fixtures' and the extra ones), the worst top-20 logit of the default
    mode is nearer the exact model's than llama.cpp's own is."""
    ours, theirs = from_exact(in_default_mode[name], name, text)
    assert ours <= theirs


@pytest.mark.parametrize("text", sorted(EXACT[QWEN]))
def test_mixed_inputs_lie_no_farther_from_the_exact_model_than_llamacpp(qwen_mixed, text):
    ours, theirs = from_exact(qwen_mixed, QWEN, text)
    assert ours <= theirs


def test_gemma_completion_continues_text(gemma_model):
    """The base model has no chat template: it continues plain text. Greedy decoding through the cache
    picks at every step the best token of a teacher-forced pass over the same text."""
    assert not gemma_model.has_chat_template
    ids = chat_prompt_ids(gemma_model, [{"role": "user", "content": "Once upon a time"}])
    assert ids[0] == gemma_model.tokenizer.bos_id
    stats = GenerationStats()
    text = "".join(
        generate(gemma_model, ids, sampling=SamplingParams(temperature=0), max_tokens=12, stats=stats)
    )
    assert text.startswith(", there was")
    forced = gemma_model.logits(ids + stats.token_ids)
    assert [int(t) for t in forced[len(ids) - 1 : -1].argmax(axis=1)] == stats.token_ids


@pytest.mark.parametrize("mode", ["f32", "default"])
def test_prompt_lookup_on_a_code_edit_is_the_plain_reply(qwen_model, in_default_mode, mode):
    """A reply that copies code from the prompt: lookup guesses most of it, and the tokens are the plain
    decode's, computed exactly and in the default mode."""
    from llama_chat.app.bench.forward import measure_lookup

    model = qwen_model if mode == "f32" else in_default_mode[QWEN]
    run = measure_lookup(model, 160)
    assert run["same_text"] and run["same_tokens"]
    assert "def describe(width, height):" in model.tokenizer.decode(run["token_ids"])  # copied code
    assert run["accepted"] >= len(run["token_ids"]) // 3


# Texts beyond the original fixtures, so the tolerances are not tuned to three texts (the same rule).
# Measured (float32 activations): Gemma lands 2.04 from llama.cpp's top-20 on 'shell' (llama.cpp's own
# f16/f32-KV runs differ by 1.46 there) and 1.04 on 'french' (limit 1.0, llama.cpp's own spread 0.89);
# argmax and KL hold on both. Qwen is within 0.6 everywhere. Both gaps are llama.cpp's distance from the
# exact logits (float64 products, benchmarks/exact_reference.py), which ours are within 0.0002 of:
# its 8-bit activations, amplified at Gemma's first positions (docs/benchmarks.md, "Agreement with
# llama.cpp").
GEMMA_EXTRA_GAP = {"shell": 2.04, "french": 1.04}
EXTRA_CASES = [
    pytest.param(
        name,
        text,
        marks=[
            pytest.mark.xfail(
                strict=True,
                reason=f"gemma '{text}': top-20 off by {GEMMA_EXTRA_GAP[text]}, llama.cpp's own spread "
                f"{EXTRA['models'][name][text]['f32_kv_top20_spread']}",
            )
        ]
        if name == GEMMA and text in GEMMA_EXTRA_GAP
        else [],
    )
    for name, texts in EXTRA["models"].items()
    for text in sorted(texts)
]


@pytest.fixture(scope="module")
def extra_logits(qwen_model, gemma_model):
    models = {QWEN: qwen_model, GEMMA: gemma_model}
    return {
        (name, text): read_back(models[name], EXTRA["models"][name][text])
        for name, texts in EXTRA["models"].items()
        for text in texts
    }


@pytest.mark.parametrize("name, text", EXTRA_CASES)
def test_more_texts_agree_with_llamacpp(extra_logits, name, text):
    ref = EXTRA["models"][name][text]
    ours = extra_logits[name, text]
    worst = 0.0
    for i, (ids, values) in enumerate(zip(ref["top20_ids"], ref["top20_logits"])):
        if values[0] - values[1] >= 0.5:
            assert int(ours.best[i]) == ids[0], f"position {i}"
        worst = max(worst, float(np.abs(ours.top20[i] - np.asarray(values)).max()))
    last = np.load(FIXTURES / "llamacpp" / f"extra.{name}.{text}.last.npy").astype(np.float32)
    p, q = log_softmax(last), log_softmax(ours.last)
    assert float((np.exp(p) * (p - q)).sum()) <= 0.01
    assert worst <= max(1.0, ref["f32_kv_top20_spread"])


@pytest.mark.parametrize("real_model", [QWEN, GEMMA], indirect=True)
def test_decode_past_1024_positions_agrees_with_blas_attention(real_model, monkeypatch):
    """Past KERNEL_ATTENTION_FROM cached positions a decoded token's attention is the compiled kernel's
    (gemma3: its global layers; the sliding ones see 512): the logits stay where BLAS puts them."""
    from llama_chat.app.bench.samples import sample_tokens
    from llama_chat.inference import forward, kernels

    calls = []
    by_kernel = kernels.tokens_attention
    monkeypatch.setattr(kernels, "tokens_attention", lambda *args: calls.append(1) or by_kernel(*args))
    ids = sample_tokens(real_model.tokenizer, 1100)
    logits = {}
    for name, kernels_from in (("blas", 10**9), ("kernel", forward.KERNEL_ATTENTION_FROM)):
        monkeypatch.setattr(forward, "KERNEL_ATTENTION_FROM", kernels_from)
        seq = real_model.new_sequence(len(ids))
        real_model.forward(ids[:1090], seq)
        logits[name] = np.concatenate([real_model.forward([t], seq) for t in ids[1090:]])
        seq.free()
    assert calls  # the kernel's run went through it
    # Both read the same float16 cache; a decoded token's own K and V come from attention sums added in
    # another order, which may round them to the next float16 (2^-11 relative), and later tokens read
    # those: measured 4e-3 (qwen) and 8e-3 (gemma) over these 10 tokens; 4-5e-5 with a float32 cache.
    assert np.abs(logits["kernel"] - logits["blas"]).max() <= 2e-2
    assert (logits["kernel"].argmax(axis=1) == logits["blas"].argmax(axis=1)).all()
