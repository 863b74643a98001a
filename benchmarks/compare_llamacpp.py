"""Run llama-chat's benchmark and llama.cpp (through llama-cpp-python) on the same GGUF, in one run.

    python benchmarks/compare_llamacpp.py [--model NAME|PATH] [--threads 2]

Prefill (512 tokens) and decode (at context 512) of both engines, and a reply that edits code from its
prompt (llama-chat with prompt lookup against llama.cpp's plain decode, greedy, the texts compared),
measured in alternating rounds, the best of each kept; prints the ratios (llama-chat / llama.cpp), then
one JSON object on the last line (with --full, the whole `llama-chat bench --json` result too). llama-cpp-python is a tool for this script only, never a dependency of llama-chat: install it
with `pip install llama-cpp-python` (it builds llama.cpp from source, several minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from llama_chat.app.bench import CODE_EDIT, measure_decode, measure_lookup, measure_prefill, sample_tokens
from llama_chat.inference import chat_prompt_ids, load_model, resolve_model

LOOKUP_TOKENS = 160

LLAMACPP_CHILD = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, ids, code_ids, n_code = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
end_ids = set(json.loads(sys.argv[6]))
t = time.perf_counter()
llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads, verbose=False)
load_s = time.perf_counter() - t
t = time.perf_counter()
llm.eval(ids)
prefill = len(ids) / (time.perf_counter() - t)
t = time.perf_counter()
for _ in range(16):
    last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    llm.eval([int(np.argmax(last))])
decode = 16 / (time.perf_counter() - t)
llm.reset()
llm.eval(code_ids)  # the code edit, greedy: plain decode as llama.cpp runs it
out = []
t = time.perf_counter()
for _ in range(n_code):
    last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    token = int(np.argmax(last))
    if token in end_ids:
        break
    out.append(token)
    llm.eval([token])
code_decode = len(out) / (time.perf_counter() - t)
print(json.dumps({"load_s": load_s, "prefill": prefill, "decode": decode, "code_decode": code_decode, "code_ids": out}))
"""


def bench_llamacpp(path: str, ids: list[int], code_ids: list[int], end_ids: list[int], threads: int) -> dict:
    """One round of llama.cpp in its own process: its worker threads spin after each call, and in
    our process they would take the cores from our BLAS."""
    cmd = [
        sys.executable,
        "-c",
        LLAMACPP_CHILD,
        path,
        str(threads),
        json.dumps(ids),
        json.dumps(code_ids),
        str(LOOKUP_TOKENS),
        json.dumps(end_ids),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no comparison (pip install llama-cpp-python)")
        print(json.dumps(result))
        return 0
    t = time.perf_counter()
    model = load_model(path)
    ours_load = time.perf_counter() - t
    ids = sample_tokens(model.tokenizer, 512)
    code_ids = chat_prompt_ids(model, CODE_EDIT)
    # Alternate the two engines so that a busy moment of this shared machine hurts both alike.
    best = dict.fromkeys(
        ("ours_prefill", "theirs_prefill", "ours_decode", "theirs_decode", "ours_lookup", "theirs_code"), 0.0
    )
    theirs_load = float("inf")
    for _ in range(args.rounds):
        best["ours_prefill"] = max(best["ours_prefill"], measure_prefill(model, 512, 1))
        best["ours_decode"] = max(best["ours_decode"], measure_decode(model, 512, 16))
        lookup = measure_lookup(model, LOOKUP_TOKENS)
        best["ours_lookup"] = max(best["ours_lookup"], lookup["lookup_tok_s"])
        theirs = bench_llamacpp(
            path, ids, code_ids, sorted(model.tokenizer.end_of_generation_ids), args.threads
        )
        best["theirs_prefill"] = max(best["theirs_prefill"], theirs["prefill"])
        best["theirs_decode"] = max(best["theirs_decode"], theirs["decode"])
        best["theirs_code"] = max(best["theirs_code"], theirs["code_decode"])
        theirs_load = min(theirs_load, theirs["load_s"])
    ours_ids = lookup["token_ids"]
    same = next((i for i, (a, b) in enumerate(zip(ours_ids, theirs["code_ids"])) if a != b), None)
    result["lookup_same_as_plain"] = lookup["same_text"]
    result["lookup_tokens_equal_to_llamacpp"] = (
        f"{same if same is not None else min(len(ours_ids), len(theirs['code_ids']))}/{len(theirs['code_ids'])}"
    )
    result.update({k: round(v, 2) for k, v in best.items()})
    result["ours_load_warm_s"] = round(ours_load, 3)
    result["theirs_load_s"] = round(theirs_load, 3)
    result["prefill_ratio"] = round(best["ours_prefill"] / best["theirs_prefill"], 2)
    result["decode_ratio"] = round(best["ours_decode"] / best["theirs_decode"], 2)
    result["lookup_vs_llamacpp_decode"] = round(best["ours_lookup"] / best["theirs_code"], 2)
    for key in (
        "ours_prefill",
        "theirs_prefill",
        "prefill_ratio",
        "ours_decode",
        "theirs_decode",
        "decode_ratio",
        "ours_lookup",
        "theirs_code",
        "lookup_vs_llamacpp_decode",
        "lookup_same_as_plain",
        "lookup_tokens_equal_to_llamacpp",
    ):
        print(f"{key:16} {result[key]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
