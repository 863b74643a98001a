"""Run llama-chat's benchmark and llama.cpp (through llama-cpp-python) on the same GGUF, in one run.

    python benchmarks/compare_llamacpp.py [--model NAME|PATH] [--threads 2]

Prefill (512 tokens) and decode (at context 512) of both engines, measured in alternating rounds in one
process, the best of each kept; prints the ratios (llama-chat / llama.cpp), then one JSON object on the
last line (with --full, the whole `llama-chat bench --json` result too). llama-cpp-python is a tool for this script only, never a dependency of llama-chat: install it
with `pip install llama-cpp-python` (it builds llama.cpp from source, several minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from llama_chat.app.bench import measure_decode, measure_prefill, sample_tokens
from llama_chat.inference import load_model, resolve_model


class LlamaCpp:
    """llama.cpp through llama-cpp-python, measured the way app/bench.py measures llama-chat."""

    def __init__(self, path: str, threads: int):
        from llama_cpp import Llama

        t = time.perf_counter()
        self.llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
        self.load_s = time.perf_counter() - t

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def decode(self, ids: list[int], n: int) -> float:
        self.llm.reset()
        self.llm.eval(ids)
        t = time.perf_counter()
        for _ in range(n):
            last = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
            self.llm.eval([int(np.argmax(last))])
        return n / (time.perf_counter() - t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is kept")
    parser.add_argument("--full", action="store_true", help="also run the whole `llama-chat bench --json`")
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    result: dict = {}
    if args.full:
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
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        result["llama_chat_bench"] = json.loads(out.strip().splitlines()[-1])
    try:
        theirs = LlamaCpp(path, args.threads)
    except ImportError:
        print("llama-cpp-python is not installed: no comparison (pip install llama-cpp-python)")
        print(json.dumps(result))
        return 0
    t = time.perf_counter()
    model = load_model(path)
    ours_load = time.perf_counter() - t
    ids = sample_tokens(model.tokenizer, 512)
    # Alternate the two engines so that a busy moment of this shared machine hurts both alike.
    best = {"ours_prefill": 0.0, "theirs_prefill": 0.0, "ours_decode": 0.0, "theirs_decode": 0.0}
    for _ in range(args.rounds):
        best["ours_prefill"] = max(best["ours_prefill"], measure_prefill(model, 512, 1))
        best["theirs_prefill"] = max(best["theirs_prefill"], theirs.prefill(ids))
        best["ours_decode"] = max(best["ours_decode"], measure_decode(model, 512, 16))
        best["theirs_decode"] = max(best["theirs_decode"], theirs.decode(ids, 16))
    result.update({k: round(v, 2) for k, v in best.items()})
    result["ours_load_warm_s"] = round(ours_load, 3)
    result["theirs_load_s"] = round(theirs.load_s, 3)
    result["prefill_ratio"] = round(best["ours_prefill"] / best["theirs_prefill"], 2)
    result["decode_ratio"] = round(best["ours_decode"] / best["theirs_decode"], 2)
    for key in (
        "ours_prefill",
        "theirs_prefill",
        "prefill_ratio",
        "ours_decode",
        "theirs_decode",
        "decode_ratio",
    ):
        print(f"{key:16} {result[key]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
