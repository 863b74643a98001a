"""`llama-chat bench`: load time, prefill and decode speed, tokenizer speed and memory on a real model.

Timing lives here, never in unit tests. Figures are meant to be read as ratios against a baseline
run in the same process or the same run (benchmarks/compare_llamacpp.py runs llama.cpp beside it).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import numpy as np

from llama_chat.inference import load_model, resolve_model

from .progress import ProgressBar

# Plain prose and code, repeated to any length: a stand-in for a real conversation's text.
SAMPLE_TEXT = """The little lighthouse keeper woke before dawn, as she had every morning for thirty years.
She climbed the spiral stairs, trimmed the wick, and watched the fishing boats slip out of the harbour.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
When the storm came in the autumn, the whole village gathered in the tower, telling stories until
the wind dropped and the sea, grey and tired, lay down again like an old dog by the fire.
"""


def sample_tokens(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    text = SAMPLE_TEXT
    while len(ids) < n:
        ids = tokenizer.encode(text)
        text += SAMPLE_TEXT
    return ids[:n]


def measure_cold_load(model_arg) -> float:
    """Load from the GGUF without the prepared cache, in a child process so RSS here stays honest."""
    path = resolve_model(model_arg)
    code = (
        "import sys, time; from llama_chat.inference.weights import prepare; "
        "t = time.perf_counter(); prepare(sys.argv[1], use_cache=False); print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure_prefill(model, n: int, repeats: int) -> float:
    ids = sample_tokens(model.tokenizer, n)
    best = float("inf")
    for _ in range(repeats):
        seq = model.new_sequence(n + 1)
        t = time.perf_counter()
        model.forward(ids, seq)  # forward never looks for shared blocks: every token is computed
        best = min(best, time.perf_counter() - t)
        seq.free()
    return n / best


def measure_decode(model, context: int, n_tokens: int) -> float:
    ids = sample_tokens(model.tokenizer, context)
    seq = model.new_sequence(context + n_tokens + 1)
    logits = model.forward(ids, seq)[-1]
    t = time.perf_counter()
    for _ in range(n_tokens):
        logits = model.forward([int(np.argmax(logits))], seq)[-1]
    elapsed = time.perf_counter() - t
    seq.free()
    return n_tokens / elapsed


def measure_prefix_reuse(model, shared: int, extra: int) -> dict:
    """A second conversation whose first `shared` tokens equal an earlier one's prefills only the rest."""
    ids = sample_tokens(model.tokenizer, shared + extra)
    first = model.new_sequence(shared + extra + 1)
    model.forward(ids[:shared], first)
    second = model.new_sequence(shared + extra + 1)
    other = ids[:shared] + sample_tokens(model.tokenizer, extra + 7)[7:]  # same start, different end
    t = time.perf_counter()
    saved = second.reuse_prefix(other)
    model.forward(other[saved:], second)
    reuse_s = time.perf_counter() - t
    third = model.new_sequence(shared + extra + 1)
    t = time.perf_counter()
    model.forward(other, third)
    full_s = time.perf_counter() - t
    for seq in (first, second, third):
        seq.free()
    return {"saved_tokens": saved, "reuse_ms": reuse_s * 1000, "full_ms": full_s * 1000}


def measure_fork(model, n: int) -> dict:
    seq = model.new_sequence(n + 1)
    model.forward(sample_tokens(model.tokenizer, n), seq)
    before = model.pool.memory_breakdown()["in_use_bytes"]
    t = time.perf_counter()
    child = seq.fork()
    fork_ms = (time.perf_counter() - t) * 1000
    added = model.pool.memory_breakdown()["in_use_bytes"] - before
    child.free()
    seq.free()
    return {"fork_ms": fork_ms, "added_bytes": added}


def measure_batch3(model, context: int, n_tokens: int) -> float:
    """Time of 3 alternatives decoded together over the time of one, after a shared prompt."""
    seq = model.new_sequence(context + n_tokens + 1)
    model.forward(sample_tokens(model.tokenizer, context), seq)
    one = seq.fork()
    t = time.perf_counter()
    for _ in range(n_tokens):
        model.decode_batch([42], [one])
    single = time.perf_counter() - t
    three = [seq.fork() for _ in range(3)]
    t = time.perf_counter()
    for _ in range(n_tokens):
        model.decode_batch([42, 43, 44], three)
    batch = time.perf_counter() - t
    for s in [seq, one, *three]:
        s.free()
    return batch / single


def measure_tokenizer(tokenizer, n_tokens: int) -> tuple[int, float]:
    text = SAMPLE_TEXT * (n_tokens // 150 + 1)
    tokenizer.encode(SAMPLE_TEXT)  # warm any per-word cache with a different, shorter text
    t = time.perf_counter()
    ids = tokenizer.encode(text)
    return len(ids), time.perf_counter() - t


def run_bench(args) -> int:
    quick = args.quick
    results: dict = {}

    def report(key, value, text):
        results[key] = value
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    with ProgressBar() as bar:
        load_model(args.model, progress=bar)  # make sure the model is assembled and prepared
    cold = measure_cold_load(args.model)
    report("load_s_cold", round(cold, 3), f"load, cold (from GGUF):      {cold:.2f} s")
    t = time.perf_counter()
    model = load_model(args.model)
    warm = time.perf_counter() - t
    report("load_s_warm", round(warm, 3), f"load, warm (prepared cache): {warm:.2f} s")
    results["model"] = model.name
    results["fingerprint"] = model.fingerprint

    n_prefill = 64 if quick else 512
    prefill = measure_prefill(model, n_prefill, 1 if quick else 2)
    report("prefill_tok_s", round(prefill, 1), f"prefill, {n_prefill} tokens:     {prefill:.1f} tok/s")
    ctx = 64 if quick else 512
    decode = measure_decode(model, ctx, 4 if quick else 32)
    report("decode_tok_s", round(decode, 2), f"decode at context {ctx}:    {decode:.2f} tok/s")
    long_ctx = 512 if quick else 4096
    decode_long = measure_decode(model, long_ctx, 4 if quick else 16)
    report(
        "decode_tok_s_ctx4096",
        round(decode_long, 2),
        f"decode at context {long_ctx}:   {decode_long:.2f} tok/s",
    )
    reuse = measure_prefix_reuse(model, 100 if quick else 1000, 20 if quick else 100)
    report(
        "prefix_reuse_saved_tokens",
        reuse["saved_tokens"],
        f"prefix reuse: {reuse['saved_tokens']} tokens shared, {reuse['reuse_ms']:.0f} ms vs {reuse['full_ms']:.0f} ms",
    )
    results["prefix_reuse_ms"] = round(reuse["reuse_ms"], 1)
    results["prefix_full_prefill_ms"] = round(reuse["full_ms"], 1)
    fork = measure_fork(model, 512 if quick else 4096)
    report(
        "fork_ms",
        round(fork["fork_ms"], 3),
        f"fork of {512 if quick else 4096} tokens: {fork['fork_ms']:.3f} ms",
    )
    results["fork_added_kv_bytes"] = fork["added_bytes"]
    ratio = measure_batch3(model, 64 if quick else 512, 4 if quick else 16)
    report("batch3_vs_single_time_ratio", round(ratio, 2), f"3 alternatives / 1, time:  {ratio:.2f}")
    n_tok, secs = measure_tokenizer(model.tokenizer, 1000 if quick else 10000)
    report("tokenize_10k_s", round(secs * 10000 / n_tok, 3), f"tokenize {n_tok} tokens:     {secs:.3f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report("peak_rss_mb", round(peak, 1), f"peak RSS:                   {peak:.0f} MB")
    if args.json:
        print(json.dumps(results))
    return 0
