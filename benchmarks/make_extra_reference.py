"""Write tests/fixtures/llamacpp/extra_reference.json: llama.cpp's logits on texts beyond the original
fixtures, so the real-model tolerances are not tuned to three texts.

    python benchmarks/make_extra_reference.py

For each real model and text: the ids fed (BOS where the vocabulary adds one), llama.cpp's top-20
logits at every position and its full last-position row (float16, as .npy beside the JSON), with its
default f16 KV cache; and how far llama.cpp moves from itself when only its KV cache is float32 (the
spread of llama.cpp's own configurations on the same text), for these texts and for the three texts
of reference.json (`fixture_spreads`). Needs llama-cpp-python (a tool for this script only:
`pip install llama-cpp-python`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from llama_chat.inference import load_tokenizer, resolve_model

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llamacpp"
MODELS = ("qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")
TEXTS = {
    "recipe": "To make a simple tomato sauce, warm two spoons of olive oil in a wide pan, add a sliced "
    "clove of garlic and let it turn golden. Pour in a tin of crushed tomatoes, a pinch of salt and a "
    "few basil leaves, then simmer for twenty minutes, stirring now and then, until it thickens.",
    "json": '{"id": 1842, "name": "sensor-7", "readings": [21.4, 21.9, 22.3], "unit": "celsius", '
    '"location": {"building": "B", "floor": 3}, "active": true, "tags": ["lab", "north"]}',
    "shell": "#!/bin/sh\nset -e\nfor f in *.log; do\n  gzip -9 \"$f\"\n  mv \"$f.gz\" archive/\ndone\n"
    "echo \"archived $(ls archive | wc -l) files\"\n",
    "french": "Le petit prince s'assit sur une pierre et leva les yeux vers le ciel. « Les étoiles sont "
    "éclairées, dit-il, afin que chacun puisse un jour retrouver la sienne. »",
}

CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, kv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
kw = {} if kv == "f16" else {"type_k": 0, "type_v": 0}  # GGML_TYPE_F32
llm = Llama(model_path=path, n_ctx=1024, n_batch=512, logits_all=True, verbose=False, **kw)
llm.eval(ids)
np.save(sys.argv[4], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""


def llamacpp_logits(path: str, ids: list[int], kv: str, folder: Path) -> np.ndarray:
    import subprocess

    out = folder / f"{kv}.npy"
    subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(ids), kv, str(out)], check=True)
    return np.load(out)


def top20_spread(logits: np.ndarray, other: np.ndarray) -> float:
    """How far `other` moves from `logits` on logits' 20 best tokens, at the worst position."""
    top = np.argsort(-logits, axis=1)[:, :20]
    return float(max(np.abs(other[i, t] - logits[i, t]).max() for i, t in enumerate(top)))


def main() -> int:
    import tempfile

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            path = str(resolve_model(name))
            tok = load_tokenizer(path)
            result[name] = {}
            for text_name, text in TEXTS.items():
                ids = tok.encode(text, add_bos=tok.add_bos, special=False)
                logits = llamacpp_logits(path, ids, "f16", Path(tmp))
                other = llamacpp_logits(path, ids, "f32", Path(tmp))
                top = np.argsort(-logits, axis=1)[:, :20]
                spread = top20_spread(logits, other)
                result[name][text_name] = {
                    "ids": ids,
                    "top20_ids": top.tolist(),
                    "top20_logits": np.take_along_axis(logits, top, axis=1).round(4).tolist(),
                    "f32_kv_top20_spread": round(spread, 4),
                }
                np.save(OUT / f"extra.{name}.{text_name}.last.npy", logits[-1].astype(np.float16))
                print(name, text_name, len(ids), "tokens, llama.cpp f16 vs f32 KV:", round(spread, 3))
        spreads = fixture_spreads(Path(tmp))
    (OUT / "extra_reference.json").write_text(
        json.dumps({"texts": TEXTS, "models": result, "fixture_spreads": spreads})
    )
    return 0


def fixture_spreads(folder: Path) -> dict:
    """llama.cpp's own f16/f32-KV spread on the texts whose logits reference.json holds (the ids fed
    are reference.json's, so the f16 run is that file's reference itself)."""
    reference = json.loads((OUT / "reference.json").read_text())
    spreads: dict = {}
    for name in MODELS:
        path = str(resolve_model(name))
        spreads[name] = {}
        for text_name, ref in reference[name]["logits"].items():
            logits = llamacpp_logits(path, ref["ids"], "f16", folder)
            other = llamacpp_logits(path, ref["ids"], "f32", folder)
            spreads[name][text_name] = round(top20_spread(logits, other), 4)
            print(name, text_name, "(reference.json), llama.cpp f16 vs f32 KV:", spreads[name][text_name])
    return spreads


if __name__ == "__main__":
    raise SystemExit(main())
