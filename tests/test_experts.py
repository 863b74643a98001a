"""A mixture of experts (qwen3moe): the router's choice as llama.cpp makes it, only the chosen experts'
weights read, each expert read once a step for all of a prompt's rows routed to it, and each expert's
matrices exactly the GGUF's slices of its 3-D tensors. (Its logits against llama.cpp's:
test_llamacpp_tiny.py.)"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

import gguf
import numpy as np
import pytest
from test_kernels import raw_tensor

from llama_chat.app.cli import main
from llama_chat.inference import expert_products, kernels, load_model, quants
from llama_chat.inference.experts import mixture, route
from llama_chat.inference.forward import gated_ffn, gated_unit
from tiny_later_archs import N_EXPERT, N_EXPERT_USED
from tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def moe(tiny_model_paths):
    return load_model(tiny_model_paths["qwen3moe"])


@pytest.fixture
def products(monkeypatch, moe):
    """Each expert matrix multiplied in a step, as (layer, expert, "gate_up" or "down", rows): one at a
    time (kernels.matmul) or all of a step's together (expert_products.grouped_product)."""
    names, grouped = {}, {}
    for i, layer in enumerate(moe.weights.layers):
        for e in range(N_EXPERT):
            names[id(layer.experts.gate_up[e])] = (i, e, "gate_up")
            names[id(layer.experts.down[e])] = (i, e, "down")
        if layer.experts.grouped is not None:
            gate_up, down = layer.experts.grouped
            grouped[id(gate_up)], grouped[id(down)] = (i, "gate_up"), (i, "down")
    seen = []
    matmul, grouped_product = kernels.matmul, expert_products.grouped_product

    def watched(x, w):
        if id(w) in names:
            seen.append((*names[id(w)], x.shape[0]))
        return matmul(x, w)

    def watched_grouped(x, plan, w):
        layer, kind = grouped[id(w)]
        seen.extend((layer, int(e), kind, int(n)) for e, n in zip(plan.experts, plan.counts, strict=True))
        return grouped_product(x, plan, w)

    monkeypatch.setattr(kernels, "matmul", watched)
    monkeypatch.setattr(expert_products, "grouped_product", watched_grouped)
    return seen


def test_the_router_picks_the_top_k_and_normalizes_their_weights():
    """llama.cpp's build_moe_ffn for qwen3moe: softmax over every expert, the k most probable, their
    probabilities divided by their sum."""
    logits = np.random.default_rng(3).standard_normal((5, N_EXPERT)).astype(np.float32)
    chosen, weights = route(logits, N_EXPERT_USED, normalize=True)
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum(axis=1, keepdims=True)
    best = np.argsort(-probs, axis=1)[:, :N_EXPERT_USED]
    assert (chosen == best).all()
    expected = np.take_along_axis(probs, best, axis=1)
    assert np.abs(weights - expected / expected.sum(axis=1, keepdims=True)).max() < 1e-6
    _, plain = route(logits, N_EXPERT_USED, normalize=False)
    assert np.abs(plain - expected).max() < 1e-6


def test_a_decoded_token_reads_only_its_chosen_experts(moe, products):
    seq = moe.new_sequence(64)
    moe.forward(moe.tokenizer.encode("hello the world"), seq)
    products.clear()
    moe.forward(moe.tokenizer.encode(" sun")[:1], seq)
    for layer in range(moe.config.n_layer):
        mine = [p for p in products if p[0] == layer]
        kinds = sorted(kind for _, _, kind, _ in mine)
        assert kinds == ["down"] * N_EXPERT_USED + ["gate_up"] * N_EXPERT_USED
        assert len({e for _, e, _, _ in mine}) == N_EXPERT_USED and all(rows == 1 for *_, rows in mine)


def test_a_prompt_reads_each_expert_once_a_step_for_all_its_rows(moe, products):
    ids = moe.tokenizer.encode("the hello world is in the air, then the water and the sun " * 2)
    moe.logits(ids)
    counts = Counter((layer, e, kind) for layer, e, kind, _ in products)
    assert max(counts.values()) == 1  # one product per expert matrix and layer, whatever its rows
    for layer in range(moe.config.n_layer):
        rows = [n for i, _, kind, n in products if i == layer and kind == "gate_up"]
        assert sum(rows) == len(ids) * N_EXPERT_USED  # every row went to k experts
        assert len(rows) > N_EXPERT_USED  # the rows went to several experts: grouped, not one a row


@pytest.mark.parametrize("activations", ["f32", "q8", "mixed"])
@pytest.mark.parametrize("rows", [1, 2, 3, 40])
def test_all_experts_in_one_call_give_the_bits_of_one_expert_at_a_time(tiny_model_paths, rows, activations):
    """The grouped products (one compiled call for all of a step's experts) against the experts
    multiplied one at a time: the same bits, a decoded token's and a prompt's, inputs as floats or bytes."""
    moe = load_model(tiny_model_paths["qwen3moe"], activations=activations)
    layer = moe.weights.layers[1].experts
    alone = dataclasses.replace(layer)
    alone.__dict__["grouped"] = None  # (the cached property, left out)
    x = np.random.default_rng(rows).standard_normal((rows, moe.config.n_embd)).astype(np.float32)
    ffn, unit = partial(gated_ffn, act="silu"), partial(gated_unit, act="silu")
    args = (N_EXPERT_USED, "softmax", True, ffn, unit)
    assert layer.grouped is not None
    assert np.array_equal(mixture(x, layer, *args), mixture(x, alone, *args))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K])
@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 12])
def test_grouped_k_quant_experts_give_each_row_the_bits_of_its_expert_alone(qtype, activations, rows):
    """Q4_K and Q6_K experts (a Q4_K_M model's), grouped: a decoded token's k experts (one row each,
    the one-row kernel), and a prompt's segments of one, two and more rows, each with the bits of its
    expert's own product."""
    shape = (96, 512)  # rows a group and a part of one, columns two Q4_K blocks
    packed = [quants.pack([(raw_tensor(qtype, shape, seed=e), qtype, shape)]) for e in range(N_EXPERT)]
    experts = [dataclasses.replace(w, activations=activations) for w in packed]
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    chosen = np.stack([rng.permutation(N_EXPERT)[:N_EXPERT_USED] for _ in range(rows)])
    plan = expert_products.Layout(chosen, N_EXPERT)
    xs = expert_products.gather_rows(x, plan.rows, plan.at, plan.n_rows)
    out = expert_products.grouped_product(xs, plan, expert_products.matrices_of(experts))
    for p in range(len(plan.rows)):
        row, expert = plan.rows[p], chosen[plan.rows[p], plan.slots[p]]
        alone = kernels.kernel_product(x[row : row + 1], experts[expert])[0]
        assert np.array_equal(out[plan.at[p]], alone)


def test_each_experts_matrices_are_its_slices_of_the_gguf(moe, tiny_model_paths):
    """Q8_0 gate and down experts, float32 up experts: an expert's packed rows are the GGUF's
    dequantized rows of that expert, bit for bit."""
    tensors = {t.name: t for t in gguf.GGUFReader(tiny_model_paths["qwen3moe"]).tensors}

    def dequantized(name, e):
        t = tensors[f"blk.1.{name}.weight"]
        return gguf.quants.dequantize(t.data, t.tensor_type)[e]

    for e in (0, 5, N_EXPERT - 1):
        gate_up, down = moe.weights.layers[1].experts.gate_up[e], moe.weights.layers[1].experts.down[e]
        gguf_gate_up = np.concatenate([dequantized("ffn_gate_exps", e), dequantized("ffn_up_exps", e)])
        assert np.array_equal(kernels.rows(gate_up, np.arange(gate_up.n_rows)), gguf_gate_up)
        assert np.array_equal(kernels.rows(down, np.arange(down.n_rows)), dequantized("ffn_down_exps", e))


def test_prefill_then_decode_equals_one_pass_with_experts(moe):
    """Grouping rows by expert changes no row's bits: a prompt read in pieces and a token at a time
    gives the logits of the prompt read whole."""
    ids = moe.tokenizer.encode("the hello world is in the air, then the water and the sun")
    whole = moe.logits(ids)
    seq = moe.new_sequence(len(ids))
    parts = [moe.forward(ids[:9], seq, all_logits=True)] + [moe.forward([t], seq) for t in ids[9:]]
    assert np.abs(np.concatenate(parts) - whole).max() <= 2e-3  # (the float16 cache, as test_forward)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"metadata": {"qwen3moe.expert_used_count": 9}}, "0 < expert_used_count ≤ expert_count, not 9 of 8"),
        ({"drop": "blk.1.ffn_up_exps.weight"}, "missing tensor blk.1.ffn_up_exps.weight"),
        (
            {"shapes": {"blk.0.ffn_down_exps.weight": (4, 64, 32)}},
            "ffn_down_exps.weight has shape [4, 64, 32], expected [8, 64, 32]",
        ),
    ],
)
def test_a_broken_mixture_of_experts_gives_one_clear_line(tmp_path, capsys, change, expected):
    path = write_tiny_model(tmp_path / "bad.gguf", "qwen3moe", **change)
    assert main(["--model", str(path), "tokenize", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and str(path) in err[0]


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_gpt_oss_step_multiplies_its_mxfp4_experts_in_one_call_with_the_bits_of_one_at_a_time(
    tiny_model_paths, rows
):
    """MXFP4 experts (gpt-oss) go through the grouped products too (a decoded token's k experts in one
    compiled call, straight from their blocks), with the bits of each expert multiplied on its own."""
    model = load_model(tiny_model_paths["gpt-oss"])
    cfg, layer = model.config, model.weights.layers[0].experts
    assert layer.grouped is not None and layer.grouped_for(rows) is not None
    alone = dataclasses.replace(layer)
    alone.__dict__["grouped"] = None
    x = np.random.default_rng(rows).standard_normal((rows, cfg.n_embd)).astype(np.float32)
    ffn, unit = partial(gated_ffn, act=cfg.ffn_act), partial(gated_unit, act=cfg.ffn_act)
    args = (cfg.n_expert_used, cfg.expert_gating, cfg.expert_weights_norm, ffn, unit)
    assert np.array_equal(mixture(x, layer, *args), mixture(x, alone, *args))
