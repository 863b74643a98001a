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

from .chat.settings import CODEC
from .measure import measure_app, measure_codecs, measure_sessions, measure_stop
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


# A reply that repeats code from the prompt with small edits: where prompt lookup pays.
CODE_EDIT = [
    {
        "role": "user",
        "content": """Rename `area` to `rectangle_area` everywhere and change nothing else:

```python
def area(width, height):
    \"\"\"The area of a rectangle.\"\"\"
    if width < 0 or height < 0:
        raise ValueError("negative size")
    return width * height


def describe(width, height):
    return f"{width} x {height} = {area(width, height)}"


def total_area(shapes):
    total = 0
    for width, height in shapes:
        total += area(width, height)
    return total


def largest(shapes):
    return max(shapes, key=lambda s: area(*s))
```""",
    }
]


def sample_text() -> str:
    """Real, varied text: the source of a standard-library module (code, comments and docstrings),
    after the prose above. Repeated text would let the model copy, which hides cache errors."""
    import argparse

    with open(argparse.__file__, encoding="utf-8") as f:
        return SAMPLE_TEXT + f.read()


def sample_tokens(tokenizer, n: int) -> list[int]:
    text = sample_text()
    ids = tokenizer.encode(text[: n * 6])
    while len(ids) < n:
        text += text
        ids = tokenizer.encode(text[: n * 6])
    return ids[:n]


def _child(code: str, *args: str, env: dict | None = None) -> str:
    """The last line a Python child process prints: timings and RSS of a start of its own."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.strip().splitlines()[-1]


def measure_cold_load(model_arg) -> float:
    """Load from the GGUF without the prepared cache (metadata read again, weights packed), in a child
    process so RSS here stays honest; compiled kernels come from their cache (see measure_compile)."""
    code = (
        "import sys, time; from llama_chat.inference.weights import prepare; "
        "t = time.perf_counter(); prepare(sys.argv[1], use_cache=False); print(time.perf_counter() - t)"
    )
    return float(_child(code, str(resolve_model(model_arg))))


def measure_compile(model_arg) -> float:
    """Seconds a first start spends compiling the kernels this model takes (an empty numba cache, in a
    child process)."""
    import os
    import tempfile

    code = (
        "import sys; from llama_chat.inference.quants import compile_kernels; "
        "from llama_chat.inference.weights import model_info; "
        "print(compile_kernels(None, model_info(sys.argv[1]).matrix_formats))"
    )
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NUMBA_CACHE_DIR": folder}
        return float(_child(code, str(resolve_model(model_arg)), env=env))


ASK_CHILD = """
import resource, sys
from llama_chat.app.cli import main
main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def measure_ask_rss(model_arg, folder) -> float:
    """Peak RSS (MB) of `llama-chat ask` answering a short question, in a process of its own."""
    path = str(resolve_model(model_arg))
    args = ["--model", path, "--db", str(folder / "rss.db"), "ask", "Say hello.", "--max-tokens", "16"]
    return float(_child(ASK_CHILD, *args))


def measure_lookup(model, max_tokens: int) -> dict:
    """Greedy decode of a reply that edits code from the prompt, with and without prompt lookup."""
    from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate

    ids = chat_prompt_ids(model, CODE_EDIT)
    runs = {}
    for lookup in (False, True):
        stats = GenerationStats()
        greedy = SamplingParams(temperature=0)
        text = "".join(
            generate(model, ids, sampling=greedy, max_tokens=max_tokens, stats=stats, lookup=lookup)
        )
        runs[lookup] = (text, stats)
    (plain, plain_stats), (looked, stats) = runs[False], runs[True]
    return {
        "plain_tok_s": plain_stats.decode_tok_s,
        "lookup_tok_s": stats.decode_tok_s,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "same_text": looked == plain,
        "token_ids": stats.token_ids,
    }


PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {"city": {"type": "string"}, "age": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "kind", "owner", "tags"],
}


def measure_json_mask(model, max_tokens: int) -> dict:
    """A greedy reply under a JSON schema (nested object, enum, array): its decode time per token, and
    the grammar's share of it (its mask and step per token, replayed alone over the same tokens)."""
    from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate
    from llama_chat.inference.constrain import Constraint, check_grammar, json_schema_grammar

    grammar = check_grammar(model.tokenizer, json_schema_grammar(PET_SCHEMA))  # the vocabulary read once
    ids = chat_prompt_ids(model, [{"role": "user", "content": "Invent a pet and its owner, as JSON."}])
    stats = GenerationStats()
    sampling = SamplingParams(temperature=0, grammar=grammar)
    "".join(generate(model, ids, sampling=sampling, max_tokens=max_tokens, stats=stats, lookup=False))
    constraint, logits = Constraint(model.tokenizer, grammar), np.zeros(model.config.n_vocab, np.float32)
    t = time.perf_counter()
    for token in stats.token_ids:
        constraint.mask(logits)
        constraint.accept(token)
    mask_ms = 1000 * (time.perf_counter() - t) / max(len(stats.token_ids), 1)
    decode_ms = 1000 / stats.decode_tok_s if stats.decode_tok_s else 0.0
    return {"mask_ms": mask_ms, "decode_ms": decode_ms, "tokens": len(stats.token_ids)}


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


def measure_short_prefill(model, cached: int, n: int, repeats: int) -> float:
    """Milliseconds to read a new turn of n tokens after `cached` tokens already in the cache (the time
    to first token of a continued chat), the best of `repeats`, each on a fork of the cached sequence."""
    ids = sample_tokens(model.tokenizer, cached + n)
    seq = model.new_sequence(cached + n + 1)
    model.forward(ids[:cached], seq)
    best = float("inf")
    for _ in range(repeats):
        turn = seq.fork()
        t = time.perf_counter()
        model.forward(ids[cached:], turn)
        best = min(best, time.perf_counter() - t)
        turn.free()
    seq.free()
    return best * 1000


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


def measure_decode_contexts(model, contexts: tuple[int, ...], n_tokens: int) -> list[float]:
    """Decode tokens/s at several context lengths, one token of each in turn, so that a busy moment
    of this shared machine slows every context alike and their ratio stays meaningful."""
    ids = sample_tokens(model.tokenizer, max(contexts))
    seqs, logits = [], []
    for n in contexts:
        seqs.append(model.new_sequence(n + n_tokens + 1))
        logits.append(model.forward(ids[:n], seqs[-1])[-1])
    elapsed = [0.0] * len(contexts)
    for _ in range(n_tokens):
        for i, seq in enumerate(seqs):
            t = time.perf_counter()
            logits[i] = model.forward([int(np.argmax(logits[i]))], seq)[-1]
            elapsed[i] += time.perf_counter() - t
    for seq in seqs:
        seq.free()
    return [n_tokens / e for e in elapsed]


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


def measure_jobs_at_once(model, context: int, n_tokens: int, counts: tuple[int, ...] = (2, 8)) -> dict[int, float]:
    """C conversations replying at once through the scheduler (one batch per step) against one alone, for
    each C of counts: decode time per token of the slowest of the C over that of the one. Each
    conversation is a shared prompt read before the clock starts and a token of its own."""
    from .chat.jobs import Job
    from .chat.scheduler import Scheduler

    scheduler = Scheduler(model, parallel=max(counts))
    ids = sample_tokens(model.tokenizer, context)
    base = model.new_sequence(context + n_tokens + 2)
    model.forward(ids[:-1], base)
    vocab = sorted(set(ids))

    def job(i: int) -> Job:
        prompt = [*ids, vocab[i % len(vocab)]]  # its own last token: a reply of its own
        return Job(
            lambda: (prompt, base.fork()),
            max_tokens=n_tokens,
            lookup=False,  # the same work per token for every reply
            finish=lambda job: [s.free() for s in job.seqs],
        )

    def per_token(jobs: list[Job]) -> float:
        for j in jobs:
            scheduler.submit(j)
        for j in jobs:
            j.wait()
        return max(j.stats[0].decode_s / max(j.stats[0].generated_tokens, 1) for j in jobs)

    one = per_token([job(0)])
    ratios = {c: per_token([job(1 + i) for i in range(c)]) / one for c in counts}
    scheduler.close()
    base.free()
    return ratios


def measure_codec_quality(model, n_tokens: int, n_greedy: int) -> dict:
    """Every codec on the model's real KV: size and speed (measure.measure_codecs), KL divergence
    of the next-token distribution against the live cache, and how many greedy tokens match live."""
    from llama_chat.storage.codec import decode_kv, encode_kv
    from llama_chat.storage.kv_plan import model_plan

    plan = model_plan(model)
    ids = sample_tokens(model.tokenizer, n_tokens + 1)
    live = model.new_sequence(n_tokens + n_greedy + 2)
    model.forward(ids[:n_tokens], live)
    k, v = live.gather(0, n_tokens)
    table = measure_codecs(k, v, plan)

    def greedy(seq, first: int) -> tuple[np.ndarray, list[int]]:
        logits = model.forward([first], seq)[-1]
        out, row = [], logits
        for _ in range(n_greedy):
            out.append(int(np.argmax(row)))
            row = model.forward([out[-1]], seq)[-1]
        return logits, out

    live_logits, live_tokens = greedy(live, ids[n_tokens])
    p = live_logits.astype(np.float64) - live_logits.max()
    p -= np.log(np.exp(p).sum())
    B = model.pool.block_size
    for codec in table:
        seq = model.new_sequence(n_tokens + n_greedy + 2)
        seq.private = True  # keep the decoded KV: sharing by prefix key would hand back the live blocks
        for start in range(0, n_tokens, B):
            dk, dv = decode_kv(encode_kv(k[:, :, start : start + B], v[:, :, start : start + B], codec, plan))
            seq.append_kv(ids[start : start + dk.shape[2]], dk, dv)
        logits, tokens = greedy(seq, ids[n_tokens])
        q = logits.astype(np.float64) - logits.max()
        q -= np.log(np.exp(q).sum())
        same = next((i for i, (a, b) in enumerate(zip(tokens, live_tokens, strict=True)) if a != b), n_greedy)
        table[codec]["kl"] = float((np.exp(p) * (p - q)).sum())
        table[codec]["greedy_match"] = f"{same}/{n_greedy}"
        seq.free()
    live.free()
    return table


def measure_tokenizer(tokenizer, n_tokens: int) -> tuple[int, float]:
    text = sample_text()[: n_tokens * 4]
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
    import tempfile
    from pathlib import Path

    from llama_chat.inference import kernels
    from llama_chat.inference.cpu import PROFILE

    crossover = f"BLAS from {kernels.blas_from} rows" if kernels.blas_from else "the kernels at any size"
    report("kernel_profile", PROFILE.key, f"kernels: {PROFILE.describe()}; {crossover}")
    results["blas_from"] = kernels.blas_from
    compile_s = measure_compile(args.model)
    report("compile_s", round(compile_s, 2), f"compile kernels (first start only): {compile_s:.2f} s")
    cold = measure_cold_load(args.model)
    report("load_s_cold", round(cold, 3), f"load, cold (GGUF read anew):  {cold:.2f} s")
    t = time.perf_counter()
    model = load_model(args.model)
    warm = time.perf_counter() - t
    report("load_s_warm", round(warm, 3), f"load, warm (metadata cached): {warm:.2f} s")
    with tempfile.TemporaryDirectory() as folder:
        rss = measure_ask_rss(args.model, Path(folder))
    report("peak_rss_mb", round(rss, 1), f"peak RSS of `ask`:           {rss:.0f} MB")
    results["model"] = model.name
    results["fingerprint"] = model.fingerprint
    report(
        "live_kv_bytes_per_token",
        model.pool.token_bytes,
        f"live KV cache in RAM: {model.pool.token_bytes:,} bytes/token ({model.pool.cache_type})",
    )

    n_prefill = 64 if quick else 512
    prefill = measure_prefill(model, n_prefill, 1 if quick else 2)
    report("prefill_tok_s", round(prefill, 1), f"prefill, {n_prefill} tokens:     {prefill:.1f} tok/s")
    cached = 256 if quick else 1024
    short = measure_short_prefill(model, cached, 64, 1 if quick else 3)
    report(
        "prefill_64_after_1024_ms",
        round(short, 1),
        f"prefill, 64 tokens after {cached} cached: {short:.0f} ms",
    )
    ctx, long_ctx = (64, 512) if quick else (512, 4096)
    decode, decode_long = measure_decode_contexts(model, (ctx, long_ctx), 4 if quick else 24)
    report("decode_tok_s", round(decode, 2), f"decode at context {ctx}:    {decode:.2f} tok/s")
    report(
        "decode_tok_s_ctx4096",
        round(decode_long, 2),
        f"decode at context {long_ctx}:   {decode_long:.2f} tok/s",
    )
    ratio = decode_long / decode
    report("decode_ctx4096_vs_512", round(ratio, 3), f"decode {long_ctx} / {ctx}:      {ratio:.2f}")
    look = measure_lookup(model, 32 if quick else 160)
    report(
        "decode_lookup_tok_s",
        round(look["lookup_tok_s"], 2),
        f"decode with prompt lookup, a code edit: {look['lookup_tok_s']:.2f} tok/s "
        f"(plain {look['plain_tok_s']:.2f}; {look['accepted']} of {look['drafted']} guessed tokens kept; "
        f"same text: {look['same_text']})",
    )
    results["decode_lookup_plain_tok_s"] = round(look["plain_tok_s"], 2)
    mask = measure_json_mask(model, 40 if quick else 120)
    share = mask["mask_ms"] / mask["decode_ms"] if mask["decode_ms"] else 0.0
    report(
        "json_mask_ms_per_token",
        round(mask["mask_ms"], 3),
        f"JSON-schema mask: {mask['mask_ms']:.2f} ms per token, {100 * share:.1f} % of decode "
        f"({mask['decode_ms']:.0f} ms per token, {mask['tokens']} tokens)",
    )
    results["lookup_same_text"] = look["same_text"]
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
    at_once = measure_jobs_at_once(model, 64 if quick else 512, 4 if quick else 32)
    report(
        "two_jobs_vs_one_time_ratio",
        round(at_once[2], 2),
        f"2 conversations at once / 1, time per token: {at_once[2]:.2f}",
    )
    report(
        "eight_jobs_aggregate_decode",
        round(8 / at_once[8], 2),
        f"8 conversations at once: {8 / at_once[8]:.2f}× one's decode (time per token {at_once[8]:.2f}×)",
    )
    with tempfile.TemporaryDirectory() as folder:
        text = model.tokenizer.decode(sample_tokens(model.tokenizer, (256 if quick else 2048) - 40))
        sess = measure_sessions(model, text, Path(folder))
    report(
        "resume_ms_2048",
        round(sess["resume_ms"], 1),
        f"resume of {sess['tokens']} tokens from SQLite, fresh process: {sess['resume_ms']:.1f} ms "
        f"({sess['restored']} restored)",
    )
    report(
        "reprefill_ms_2048",
        round(sess["reprefill_ms"], 1),
        f"prefilling them again:      {sess['reprefill_ms']:.0f} ms",
    )
    results["resume_speedup"] = round(sess["reprefill_ms"] / sess["resume_ms"], 1)
    report(
        "fork_session_ms", round(sess["fork_ms"], 2), f"fork of that session:       {sess['fork_ms']:.2f} ms"
    )
    report(
        "fork_added_bytes",
        sess["fork_added_bytes"],
        f"database growth on fork:    {sess['fork_added_bytes']:,} bytes (one stored block: {sess['stored_block_bytes']:,})",
    )
    ex = sess["exchange"]
    report(
        "export_ms_2048", round(ex["export_ms"], 1), f"export of that session:     {ex['export_ms']:.0f} ms"
    )
    report(
        "import_ms_2048", round(ex["import_ms"], 1), f"import into an empty db:    {ex['import_ms']:.0f} ms"
    )
    report(
        "export_size_ratio",
        round(ex["size_ratio"], 4),
        f"file / stored size:         {ex['file_bytes']:,} / {ex['stored_bytes']:,} = {ex['size_ratio']:.3f}",
    )
    with tempfile.TemporaryDirectory() as folder:
        stop = measure_stop(model, SAMPLE_TEXT, Path(folder), 200)
        app = measure_app(model.path, Path(folder))
    report("stop_ms", round(stop["stop_ms"], 1), f"Ctrl+C on a reply to it stored: {stop['stop_ms']:.0f} ms")
    report(
        "stop_three_ms",
        round(stop["stop_three_ms"], 1),
        f"Esc on regenerate ×3 to all three stored: {stop['stop_three_ms']:.0f} ms",
    )
    report(
        "app_screen_s", round(app["screen_s"], 2), f"app start to the chat screen: {app['screen_s']:.2f} s"
    )
    report("app_ready_s", round(app["ready_s"], 2), f"app start to the model loaded: {app['ready_s']:.2f} s")
    report(
        "app_key_ms", round(app["key_ms"], 1), f"slowest key while a reply streams: {app['key_ms']:.0f} ms"
    )
    report(
        "app_esc_ms", round(app["esc_ms"], 1), f"Esc in the app to the reply stored: {app['esc_ms']:.0f} ms"
    )
    codecs = measure_codec_quality(model, 256 if quick else 1024, 4 if quick else 32)
    results["default_codec"] = CODEC
    results["codecs"] = {
        name: {
            key: float(f"{c[key]:.3g}") if isinstance(c[key], float) else c[key]
            for key in ("bytes_per_token", "encode_ms", "decode_ms", "kl", "greedy_match")
        }
        for name, c in codecs.items()
    }
    for name, c in codecs.items():
        print(
            f"codec {name:4} {c['bytes_per_token']:8.0f} B/token  encode {c['encode_ms']:6.1f} ms  "
            f"decode {c['decode_ms']:6.1f} ms  KL {c['kl']:.2e}  greedy {c['greedy_match']}",
            file=sys.stderr if args.json else sys.stdout,
        )
    n_tok, secs = measure_tokenizer(model.tokenizer, 1000 if quick else 10000)
    report("tokenize_10k_s", round(secs * 10000 / n_tok, 3), f"tokenize {n_tok} tokens:     {secs:.3f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report("bench_peak_rss_mb", round(peak, 1), f"peak RSS of this benchmark: {peak:.0f} MB")
    if args.json:
        print(json.dumps(results))
    return 0
