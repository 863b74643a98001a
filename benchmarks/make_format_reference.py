"""Write tests/fixtures/llamacpp/formats.json and formats.npz: llama.cpp's logits and greedy reply on tiny
llamas in each format we read in its own bits (tests/tiny_formats.py), so that each format is checked
against llama.cpp itself, without llama.cpp in CI.

    .venv/bin/python benchmarks/make_format_reference.py [--llamacpp-python PATH] [--format NAME ...]

Two models a format, written again byte for byte from their seed by the tests. "matrices": every layer
matrix and the output in the format. llama.cpp runs as for make_tiny_reference.py (F32 KV cache, no flash
attention), but it multiplies a quantized matrix by its inputs rounded to 8 bits (Q8_0, Q8_1 or Q8_K
blocks), float16 and bfloat16 ones by its inputs in 16 bits: its logits are the format's weights through
that rounding, which the tests' tolerances measure. "embeddings": the token embeddings in the format,
every matrix float32; llama.cpp reads an embedding row by dequantizing it (its dequantize_row_*), with
no rounding of its inputs, so these logits check the format's weights to float rounding. For each:
llama.cpp's logits at the last LAST_POSITIONS positions of make_tiny_reference's text (a row depends on
every token before it); for "matrices" its greedy reply to the chat prompt, with the margin between its
two best tokens at each step. Printed: how far ours are, under `--activations f32` and `q8`. `--format`
writes those formats again and keeps the others'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from make_tiny_reference import OUT, run_llamacpp  # noqa: E402
from tiny_formats import FORMATS, T, format_model  # noqa: E402

from llama_chat.inference import load_model  # noqa: E402

LAST_POSITIONS = 8


def reference(qtype: T, folder: Path, python: str, embeddings: bool) -> tuple[dict, np.ndarray]:
    """llama.cpp's ids, greedy reply and last rows of logits on a model of `qtype`; ours printed beside."""
    model_name = f"{qtype.name}.{'embeddings' if embeddings else 'matrices'}"
    path = format_model(folder / f"{model_name}.gguf", qtype, embeddings)
    model = load_model(path, cache_type="f32", activations="f32")
    result, logits = run_llamacpp(path, model, folder / f"{model_name}.npy", python)
    logits = logits[-LAST_POSITIONS:]
    margins = np.sort(logits, axis=1)[:, -1] - np.sort(logits, axis=1)[:, -2]
    report = [
        f"{model_name}: logits' spread {logits.std(axis=1).mean():.2f}, smallest margins: last rows"
        f" {margins.min():.3f}, greedy {min(result['margins']):.3f}; ours"
    ]
    for activations in ("f32", "q8"):
        ours = load_model(path, cache_type="f32", activations=activations).logits(result["text_ids"])
        report.append(f"{activations} {np.abs(ours[-LAST_POSITIONS:] - logits).max():.1e}")
    print(", ".join(report), flush=True)
    return result, logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default=sys.executable, help="a Python with llama_cpp installed")
    names = [qtype.name for qtype in FORMATS]
    parser.add_argument("--format", action="append", choices=names, help="only this one (repeatable)")
    args = parser.parse_args()
    fixture, logits = {"last_positions": LAST_POSITIONS, "formats": {}}, {}
    if args.format and (OUT / "formats.json").exists():
        fixture = json.loads((OUT / "formats.json").read_text())
        logits = dict(np.load(OUT / "formats.npz"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.format or names:
            result, logits[f"{name}.matrices"] = reference(T[name], Path(tmp), args.llamacpp_python, False)
            _, logits[f"{name}.embeddings"] = reference(T[name], Path(tmp), args.llamacpp_python, True)
            fixture["formats"][name] = {key: result[key] for key in ("greedy_ids", "margins")}
            for key in ("text_ids", "prompt_ids"):  # the same for every format: one tokenizer
                assert fixture.setdefault(key, result[key]) == result[key]
    fixture["formats"] = {name: fixture["formats"][name] for name in names if name in fixture["formats"]}
    (OUT / "formats.json").write_text(json.dumps(fixture) + "\n")
    np.savez(OUT / "formats.npz", **logits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
