"""How far llama.cpp's logits, and ours, lie from the model computed exactly (not CI).

    .venv/bin/python benchmarks/exact_reference.py [--model NAME] [--cache-type f16|f32] \\
        [--activations f32|q8|mixed] [--write-fixture]

"Exactly": the same forward pass with every matrix product in float64 on the GGUF's weights
dequantized (as ggml dequantizes them) and a float32 KV cache, so no rounding of activations,
attention or KV is left to speak of (ours: the live cache of --cache-type, float16 by default). For each text
of tests/fixtures/llamacpp (the three fixtures and the extra texts) it prints the worst top-20 |difference|
over the positions, on llama.cpp's 20 best tokens: ours vs llama.cpp (what the real-model tests check),
llama.cpp vs the exact logits, and ours vs the exact logits. Where ours is near zero from the exact logits,
the distance to llama.cpp is llama.cpp's own rounding (8-bit activations before each product, float16 KV,
scores and GELU), not a difference of the model. Then, for the default model, whether our greedy replies to
the chat fixtures (chat_reference.json) are llama.cpp's, token for token (`--activations q8`: ours with inputs
as bytes, as llama.cpp's). `--write-fixture` also writes the exact logits on llama.cpp's top 20 of every text
to EXACT_FIXTURE, against which test_real_models.py holds the default mode (its logits no farther from them
than llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from llama_chat.inference import kernels, load_model
from llama_chat.inference.kv_arena import CACHE_TYPES, DEFAULT_CACHE_TYPE

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llamacpp"
EXACT_FIXTURE = FIXTURES / "exact_top20.json"
MODELS = ("qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")


def cases(name: str) -> list[tuple[str, dict]]:
    """(text, its llama.cpp reference: ids, top20_ids, top20_logits) for one model."""
    fixtures = json.loads((FIXTURES / "reference.json").read_text())[name]["logits"]
    extra = json.loads((FIXTURES / "extra_reference.json").read_text())["models"][name]
    return [*fixtures.items(), *extra.items()]


def exact_products() -> None:
    """From here on the model's matrix products run in float64 on dequantized weights."""
    dequantized: dict[int, tuple[object, np.ndarray]] = {}

    def matmul(x, w):
        hit = dequantized.get(id(w))
        if hit is None or hit[0] is not w:
            hit = dequantized[id(w)] = (w, kernels.rows(w, np.arange(w.n_rows)).astype(np.float64))
        return np.asarray(x, np.float64) @ hit[1].T

    kernels.matmul = matmul


def worst_top20(logits: np.ndarray, ref: dict, other: np.ndarray | None = None) -> float:
    """The largest |logits - other| (llama.cpp's own values when other is None) on llama.cpp's top 20."""
    worst = 0.0
    for i, (ids, values) in enumerate(zip(ref["top20_ids"], ref["top20_logits"], strict=True)):
        b = np.asarray(values) if other is None else other[i, ids]
        worst = max(worst, float(np.abs(logits[i, ids] - b).max()))
    return worst


def greedy_as_llamacpp(model) -> tuple[int, int]:
    """How many of llama.cpp's greedy chat replies (tests/fixtures/llamacpp/chat_reference.json) the
    model gives token for token, of how many."""
    cases = json.loads((FIXTURES / "chat_reference.json").read_text())["greedy"]
    same = 0
    for case in cases.values():
        seq = model.new_sequence(len(case["prompt_ids"]) + len(case["greedy_ids"]) + 1)
        try:
            logits, reply = model.forward(case["prompt_ids"], seq)[-1], []
            while len(reply) < len(case["greedy_ids"]):
                reply.append(int(np.argmax(logits)))
                logits = model.forward(reply[-1:], seq)[-1]
        finally:
            seq.free()
        same += reply == case["greedy_ids"]
    return same, len(cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=None, help="one model (default: both)")
    parser.add_argument(
        "--cache-type", choices=CACHE_TYPES, default=DEFAULT_CACHE_TYPE, help="our live KV cache's type"
    )
    parser.add_argument(
        "--activations",
        choices=kernels.ACTIVATIONS,
        default=kernels.DEFAULT_ACTIVATIONS,
        help="what our products take as inputs",
    )
    parser.add_argument("--write-fixture", action="store_true", help=f"write {EXACT_FIXTURE.name}")
    args = parser.parse_args()
    names = [args.model] if args.model else list(MODELS)
    ours = {}
    for name in names:
        model = load_model(name, cache_type=args.cache_type, activations=args.activations)
        ours[name] = {text: model.logits(ref["ids"]) for text, ref in cases(name)}
        if name == MODELS[0]:
            same, replies = greedy_as_llamacpp(model)
            print(f"{name}: greedy replies identical to llama.cpp's: {same}/{replies}", flush=True)
    exact_products()
    print(f"{'model':36} {'text':8} {'ours-llama.cpp':>14} {'llama.cpp-exact':>15} {'ours-exact':>10}")
    fixture: dict = {"generated_with": "benchmarks/exact_reference.py --write-fixture", "models": {}}
    for name in names:
        # the exact pass keeps its KV as computed
        model = load_model(name, cache_type="f32", activations="f32")
        for text, ref in cases(name):
            exact = model.logits(ref["ids"])
            top20 = [[round(float(v), 5) for v in exact[i, ids]] for i, ids in enumerate(ref["top20_ids"])]
            fixture["models"].setdefault(name, {})[text] = top20
            mine = ours[name][text]
            row = (worst_top20(mine, ref), worst_top20(exact, ref), worst_top20(mine, ref, exact))
            print(f"{name:36} {text:8} {row[0]:14.3f} {row[1]:15.3f} {row[2]:10.5f}", flush=True)
    if args.write_fixture:
        EXACT_FIXTURE.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
