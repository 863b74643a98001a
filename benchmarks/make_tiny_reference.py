"""Write tests/fixtures/llamacpp/tiny.json and tiny.<arch>.npy: llama.cpp's tokens, logits and greedy
replies on the tiny random model of every architecture (tests/tiny_models.py), so that each
architecture is checked against llama.cpp without a real model and without llama.cpp in CI.

    .venv/bin/python benchmarks/make_tiny_reference.py [--llamacpp-python PATH] [--arch ARCH ...]

The models are the tiny ones with every matrix in float32 and llama.cpp runs in its float32
configuration (F32 KV cache, no flash attention, which rounds q to float16): its rounding of
quantized activations to 8 bits (~0.1 on these logits) would hide a difference of the architecture, and
turn near-ties of the router or of greedy decoding. Left so, only llama.cpp's float16 GELU table (the
gemmas) stands between its logits and ours. For each architecture: the ids llama.cpp gives a text and a
chat prompt (rendered with the model's own template by ours, tokenized by llama.cpp as its server does:
special tokens parsed, BOS added where the vocabulary adds one and the template wrote none), its
logits at every position of the text (float32, the .npy) and its greedy continuation of the chat
prompt, with the smallest margin between its two best tokens along it. llama.cpp runs in a child
process of another Python (llama-cpp-python is no dependency of this project: `pip install
llama-cpp-python` there, or --llamacpp-python names its interpreter). The tests write the tiny models
again from the same seed, byte for byte the files used here. `--arch` writes those architectures'
entries again and keeps the others'. Templates that write the current date render it as the fixed
day of tiny_models.FixtureDay.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llama_chat.inference import chat_template, load_model  # noqa: E402
from llama_chat.inference.prompt import prompt_text  # noqa: E402
from tiny_later_archs import LONG_CONTEXT  # noqa: E402
from tiny_models import ARCHS, FixtureDay, write_tiny_model  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "llamacpp"
TEXT = "the hello world is in the air, then the water and the sun; it is a test of the tiny model"
MESSAGES = [
    {"role": "user", "content": "hello, is the sun in the water?"},
    {"role": "assistant", "content": "the sun is in the air"},
    {"role": "user", "content": "then the world is a test"},
]
GREEDY_TOKENS = 24
FLOAT32 = {"type_k": 0, "type_v": 0, "flash_attn": False}  # GGML_TYPE_F32

CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, jobs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
n_ctx = jobs["n_ctx"]
llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, **jobs["options"])
text_ids = llm.tokenize(jobs["text"].encode(), add_bos=jobs["add_bos"], special=False)
llm.eval(text_ids)
np.save(out, np.asarray(llm.scores[: len(text_ids)], dtype=np.float32))
llm.reset()
prompt_ids = llm.tokenize(jobs["prompt"].encode(), add_bos=jobs["prompt_add_bos"], special=True)
llm.eval(prompt_ids)
greedy, margins = [], []
for _ in range(jobs["n_greedy"]):
    row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    best = np.sort(row)[-2:]
    greedy.append(int(np.argmax(row)))
    margins.append(float(best[1] - best[0]))
    llm.eval([greedy[-1]])
print(json.dumps({"text_ids": text_ids, "prompt_ids": prompt_ids, "greedy_ids": greedy, "margins": margins}))
"""


def reference(
    arch: str, folder: Path, python: str, n_ctx: int | None = None, name: str | None = None
) -> dict:
    """llama.cpp run with the context `n_ctx`, or the model's own: phi3's original one, where llama.cpp
    takes its short LongRoPE factors (LONG_CONTEXT: the same phi3 past it, with its long ones)."""
    name = name or arch
    path = write_tiny_model(folder / f"tiny-{arch}.gguf", arch, quantized=False)
    model = load_model(path, cache_type="f32", n_ctx=n_ctx)
    result, logits = run_llamacpp(path, model, folder / f"{name}.npy", python)
    np.save(OUT / f"tiny.{name}.npy", logits)
    ours = model.logits(result["text_ids"])
    same = model.tokenizer.encode(TEXT, add_bos=model.tokenizer.add_bos) == result["text_ids"]
    print(
        f"{name}: text {len(result['text_ids'])} ids (ours the same: {same}), worst |logit difference|"
        f" {np.abs(ours - logits).max():.1e}, prompt {len(result['prompt_ids'])} ids,"
        f" smallest greedy margin {min(result['margins']):.3f}"
    )
    return result


def run_llamacpp(path: Path, model, logits_path: Path, python: str) -> tuple[dict, np.ndarray]:
    """llama.cpp on the GGUF at `path` (`model`, ours, loaded from it, renders the chat prompt) in its
    float32 configuration: its ids of TEXT and of the chat prompt, its greedy reply and margins, and
    its logits at every position of TEXT (float32, kept at `logits_path`)."""
    tok = model.tokenizer
    prompt = prompt_text(model, MESSAGES, True, None)
    bos_text = "" if tok.bos_id is None else tok.token_bytes(tok.bos_id).decode()
    jobs = {
        "text": TEXT,
        "add_bos": tok.add_bos,
        "prompt": prompt,
        "prompt_add_bos": tok.add_bos and not (bos_text and prompt.startswith(bos_text)),
        "n_greedy": GREEDY_TOKENS,
        "options": FLOAT32,
        "n_ctx": model.config.n_ctx_train,
    }
    done = subprocess.run(
        [python, "-c", CHILD, str(path), json.dumps(jobs), str(logits_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"prompt": prompt, **result}, np.load(logits_path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp-python", default=sys.executable, help="a Python with llama_cpp installed")
    parser.add_argument("--arch", action="append", choices=ARCHS, help="only this one (repeatable)")
    args = parser.parse_args()
    chat_template.datetime = FixtureDay
    kept = json.loads((OUT / "tiny.json").read_text())["models"] if args.arch else {}
    with tempfile.TemporaryDirectory() as tmp:
        made = {arch: reference(arch, Path(tmp), args.llamacpp_python) for arch in args.arch or ARCHS}
        for name, (arch, n_ctx) in LONG_CONTEXT.items():
            if arch in made:
                made[name] = reference(arch, Path(tmp), args.llamacpp_python, n_ctx, name)
    names = [*ARCHS, *LONG_CONTEXT]
    models = {name: made.get(name) or kept[name] for name in names if name in made or name in kept}
    fixture = {"text": TEXT, "messages": MESSAGES, "models": models}
    (OUT / "tiny.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
