"""`llama-chat bench`: load time, prefill and decode speed, tokenizer speed, memory, sessions and the
app on a real model, printed as lines (or one JSON object with --json).

Timing lives in this package, never in unit tests. Figures are meant to be read as ratios against a
baseline run in the same process or the same run (benchmarks/compare_llamacpp.py runs llama.cpp
beside it). Only the `bench` command imports this package.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from llama_chat.inference import load_model
from llama_chat.inference.activation_modes import DEFAULT_ACTIVATIONS

from ..chat.settings import CODEC
from ..progress import ProgressBar
from .forward import (
    measure_batch3,
    measure_decode_contexts,
    measure_fork,
    measure_jobs_at_once,
    measure_json_mask,
    measure_lookup,
    measure_prefill,
    measure_prefix_reuse,
    measure_short_prefill,
    measure_tokenizer,
)
from .processes import measure_app, measure_ask_rss, measure_cold_load, measure_compile
from .samples import SAMPLE_TEXT, sample_tokens
from .stored import measure_codec_quality, measure_sessions, measure_stop


def run_bench(args) -> int:
    quick = args.quick
    results: dict = {}

    def report(key, value, text):
        results[key] = value
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    activations = getattr(args, "activations", None) or DEFAULT_ACTIVATIONS
    results["activations"] = activations
    with ProgressBar() as bar:
        load_model(args.model, progress=bar, activations=activations)  # assembled, prepared, compiled
    from llama_chat.inference import kernels
    from llama_chat.inference.cpu import PROFILE

    blas_from = kernels.known_blas_from()
    crossover = f"BLAS from {blas_from} rows" if blas_from else "the kernels at any size"
    report("kernel_profile", PROFILE.key, f"kernels: {PROFILE.describe()}; {crossover}")
    results["blas_from"] = blas_from
    if not quick:  # a first start's costs, each a minute of compiling or packing: not a smoke test's
        compile_s = measure_compile(args.model, activations)
        report("compile_s", round(compile_s, 2), f"compile kernels (first start only): {compile_s:.2f} s")
        cold = measure_cold_load(args.model)
        report("load_s_cold", round(cold, 3), f"load, cold (GGUF read anew):  {cold:.2f} s")
    t = time.perf_counter()
    model = load_model(args.model, activations=activations)
    warm = time.perf_counter() - t
    report("load_s_warm", round(warm, 3), f"load, warm (metadata cached): {warm:.2f} s")
    if not quick:  # a process that loads the model again
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
    cached = 64 if quick else 1024
    short = measure_short_prefill(model, cached, 16 if quick else 64, 1 if quick else 3)
    report(
        "prefill_64_after_1024_ms",
        round(short, 1),
        f"prefill, {16 if quick else 64} tokens after {cached} cached: {short:.0f} ms",
    )
    ctx, long_ctx = (32, 128) if quick else (512, 4096)
    decode, decode_long = measure_decode_contexts(model, (ctx, long_ctx), 2 if quick else 24)
    report("decode_tok_s", round(decode, 2), f"decode at context {ctx}:    {decode:.2f} tok/s")
    report(
        "decode_tok_s_ctx4096",
        round(decode_long, 2),
        f"decode at context {long_ctx}:   {decode_long:.2f} tok/s",
    )
    ratio = decode_long / decode
    report("decode_ctx4096_vs_512", round(ratio, 3), f"decode {long_ctx} / {ctx}:      {ratio:.2f}")
    look = measure_lookup(model, 8 if quick else 160)
    report(
        "decode_lookup_tok_s",
        round(look["lookup_tok_s"], 2),
        f"decode with prompt lookup, a code edit: {look['lookup_tok_s']:.2f} tok/s "
        f"(plain {look['plain_tok_s']:.2f}; {look['accepted']} of {look['drafted']} guessed tokens kept; "
        f"same text: {look['same_text']})",
    )
    results["decode_lookup_plain_tok_s"] = round(look["plain_tok_s"], 2)
    mask = measure_json_mask(model, 8 if quick else 120)
    share = mask["mask_ms"] / mask["decode_ms"] if mask["decode_ms"] else 0.0
    report(
        "json_mask_ms_per_token",
        round(mask["mask_ms"], 3),
        f"JSON-schema mask: {mask['mask_ms']:.2f} ms per token, {100 * share:.1f} % of decode "
        f"({mask['decode_ms']:.0f} ms per token, {mask['tokens']} tokens)",
    )
    results["lookup_same_text"] = look["same_text"]
    reuse = measure_prefix_reuse(model, 72 if quick else 1000, 8 if quick else 100)
    report(
        "prefix_reuse_saved_tokens",
        reuse["saved_tokens"],
        f"prefix reuse: {reuse['saved_tokens']} tokens shared, {reuse['reuse_ms']:.0f} ms vs "
        f"{reuse['full_ms']:.0f} ms",
    )
    results["prefix_reuse_ms"] = round(reuse["reuse_ms"], 1)
    results["prefix_full_prefill_ms"] = round(reuse["full_ms"], 1)
    fork = measure_fork(model, 64 if quick else 4096)
    report(
        "fork_ms",
        round(fork["fork_ms"], 3),
        f"fork of {64 if quick else 4096} tokens: {fork['fork_ms']:.3f} ms",
    )
    results["fork_added_kv_bytes"] = fork["added_bytes"]
    ratio = measure_batch3(model, 16 if quick else 512, 2 if quick else 16)
    report("batch3_vs_single_time_ratio", round(ratio, 2), f"3 alternatives / 1, time:  {ratio:.2f}")
    at_once = measure_jobs_at_once(model, 16 if quick else 512, 2 if quick else 32)
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
        text = model.tokenizer.decode(sample_tokens(model.tokenizer, (104 if quick else 2048) - 40))
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
        f"database growth on fork:    {sess['fork_added_bytes']:,} bytes (one stored block: "
        f"{sess['stored_block_bytes']:,})",
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
        stop = measure_stop(model, SAMPLE_TEXT[: 200 if quick else None], Path(folder), 200)
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
    codecs = measure_codec_quality(model, 64 if quick else 1024, 1 if quick else 32)
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
