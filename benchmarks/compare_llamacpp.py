"""Run llama-chat's benchmark and llama.cpp (through llama-cpp-python) on the same GGUF, in one run.

    python benchmarks/compare_llamacpp.py [--model NAME|PATH] [--threads 2]

Prints both sets of figures and their ratios (llama-chat / llama.cpp), then one JSON object on the last
line. llama-cpp-python is a tool for this script only, never a dependency of llama-chat: install it
with `pip install llama-cpp-python` (it builds llama.cpp from source, several minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from llama_chat.app.bench import sample_tokens
from llama_chat.inference import load_model, resolve_model


def bench_llamacpp(path: str, tokens_512: list[int], threads: int) -> dict:
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, verbose=False, logits_all=False)
    load_s = time.perf_counter() - t
    best = float("inf")
    for _ in range(2):
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens_512)
        best = min(best, time.perf_counter() - t)
    prefill = len(tokens_512) / best
    # decode at context 512: greedy, one token at a time, after the prefill above
    t = time.perf_counter()
    n = 32
    for _ in range(n):
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # the last token's logits
        token = int(np.argmax(last))
        llm.eval([token])
    decode = n / (time.perf_counter() - t)
    return {"load_s": round(load_s, 3), "prefill_tok_s": round(prefill, 1), "decode_tok_s": round(decode, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = str(resolve_model(args.model))

    cmd = [
        sys.executable,
        "-m",
        "llama_chat",
        "--threads",
        str(args.threads),
        "--model",
        path,
        "bench",
        "--json",
    ]
    ours = json.loads(
        subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    )
    print(f"llama-chat: {ours}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no comparison (pip install llama-cpp-python)")
        print(json.dumps({"llama_chat": ours}))
        return 0
    tokens = sample_tokens(load_model(path).tokenizer, 512)
    theirs = bench_llamacpp(path, tokens, args.threads)
    print(f"llama.cpp:  {theirs}")
    ratios = {
        "prefill_ratio": round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 2),
        "decode_ratio": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 2),
        "load_warm_ratio": round(ours["load_s_warm"] / theirs["load_s"], 2),
    }
    for key, value in ratios.items():
        print(f"{key:18} {value}")
    print(json.dumps({"llama_chat": ours, "llama_cpp": theirs, **ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
