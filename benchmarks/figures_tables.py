"""The figures table as Markdown, from the JSON the benchmarks print (figures.py runs them or reads it).

Every figure in docs/figures.md and in the README's figures block comes from here, so a figure is
written by one function from one measurement and never typed by hand. Inputs, by name (any may be
missing; its rows are then left out):

- `compare`, `compare_7b`, `compare_moe`, `compare_gptoss`: compare_llamacpp.py's JSON (the default
  model; the synthetic 7B; the synthetic Qwen3-30B-A3B and gpt-oss-20b, their first layers);
- `roofline`, `roofline_7b`: roofline.py's JSON for the same two models;
- `bench`: `llama-chat bench --json`;
- `cluster`: benchmarks/cluster.py's JSON (two servers behind HAProxy, KV in a Redis Cluster);
- `machine`: the CPU, the date and the commit (figures.machine()).
"""

from __future__ import annotations

from pathlib import Path

from limits import on_threads

ISA_NAMES = {"native": "native", "avx2": "AVX2"}
MODEL_NAMES = {
    "compare": "0.5B",
    "compare_7b": "7B",
    "compare_moe": "Qwen3-30B-A3B",
    "compare_gptoss": "gpt-oss-20b",
}

# compare_llamacpp.py's measures: (label, our key, llama.cpp's key, unit, ratio key). {n}: its long prefill.
COMPARE_ROWS = (
    ("prefill, {n} tokens", "prefill_long", "prefill_long", "tok/s", "prefill_512_ratio"),
    ("prefill, 32 tokens", "prefill_short", "prefill_short", "tok/s", "prefill_32_ratio"),
    ("decode at context {n}", "decode", "decode", "tok/s", "decode_ratio"),
    (
        "a reply copying code from its prompt (llama-chat: prompt lookup; llama.cpp: plain decode)",
        "lookup",
        "code_decode",
        "tok/s",
        "lookup_vs_llamacpp_decode",
    ),
    ("a 64-token turn after 1,024 cached tokens", "turn_ms", "turn_ms", "ms", "turn_ratio"),
    ("load, warm (to the first token)", "load_s", "load_s", "s", "load_ratio"),
    ("peak RSS", "peak_rss_mb", "peak_rss_mb", "MB", "rss_ratio"),
)

# `llama-chat bench --json`: (label, key, unit).
BENCH_ROWS = (
    ("compile the kernels (first start on a machine)", "compile_s", "s"),
    ("load the model, warm (metadata cached)", "load_s_warm", "s"),
    ("load the model, cold (GGUF read anew)", "load_s_cold", "s"),
    ("peak RSS of `ask` (a short reply)", "peak_rss_mb", "MB"),
    ("prefill, 512 tokens", "prefill_tok_s", "tok/s"),
    ("a 64-token turn after 1,024 cached tokens", "prefill_64_after_1024_ms", "ms"),
    ("decode at context 512", "decode_tok_s", "tok/s"),
    ("decode at context 4,096", "decode_tok_s_ctx4096", "tok/s"),
    ("decode at 4,096 against at 512", "decode_ctx4096_vs_512", "×"),
    ("decode with prompt lookup, a code edit", "decode_lookup_tok_s", "tok/s"),
    ("the same reply, plain decode", "decode_lookup_plain_tok_s", "tok/s"),
    ("3 alternatives decoded together, against 1 (time)", "batch3_vs_single_time_ratio", "×"),
    ("2 conversations replying at once, against 1 (time per token)", "two_jobs_vs_one_time_ratio", "×"),
    (
        "8 conversations replying at once: their tokens a second over one's",
        "eight_jobs_aggregate_decode",
        "×",
    ),
    ("JSON-schema mask, per token", "json_mask_ms_per_token", "ms"),
    ("resume a stored ~2,000-token conversation, fresh process", "resume_ms_2048", "ms"),
    ("prefilling those tokens again instead", "reprefill_ms_2048", "ms"),
    ("resume against prefilling again", "resume_speedup", "× faster"),
    ("a second conversation sharing ~1,000 leading tokens", "prefix_reuse_ms", "ms"),
    ("the same conversation prefilled in full", "prefix_full_prefill_ms", "ms"),
    ("fork of a 4,096-token sequence in RAM", "fork_ms", "ms"),
    ("fork of that stored session", "fork_session_ms", "ms"),
    ("database growth on that fork", "fork_added_bytes", "bytes"),
    ("export / import of that session", ("export_ms_2048", "import_ms_2048"), "ms"),
    ("export file with KV against its stored size", "export_size_ratio", "×"),
    ("live KV cache in RAM", "live_kv_bytes_per_token", "bytes/token"),
    ("Ctrl+C on a reply to it stored", "stop_ms", "ms"),
    ("Esc on regenerate ×3 to all three stored", "stop_three_ms", "ms"),
    ("the app: start to the chat screen / to the model loaded", ("app_screen_s", "app_ready_s"), "s"),
    ("the app: slowest key press while a reply streams", "app_key_ms", "ms"),
    ("tokenize 10,000 tokens", "tokenize_10k_s", "s"),
)

# The README's headline rows: (source, kind, key) picked from the tables above.
HEADLINE = (
    ("compare", "compare", "prefill_long"),
    ("compare", "compare", "decode"),
    ("compare", "compare", "lookup"),
    ("compare", "compare", "turn_ms"),
    ("compare_7b", "compare", "decode"),
    ("compare_7b", "compare", "prefill_long"),
    ("compare_moe", "compare", "decode"),
    ("compare_gptoss", "compare", "decode"),
    ("roofline", "roofline", "decode"),
    ("roofline_7b", "roofline", "decode"),
    ("roofline_7b", "roofline", "prefill"),
    ("bench", "bench", "compile_s"),
    ("bench", "bench", "resume_ms_2048"),
    ("bench", "codecs", None),
    ("cluster", "cluster", "migration_ms"),
)

# benchmarks/cluster.py's TTFT of a continued turn by where its KV came from: (key, where).
TTFT_SOURCES = (
    ("ram", "its KV in the server's RAM"),
    ("redis", "the other server, its KV read from Redis"),
    ("recomputed", "nothing cached anywhere, recomputed"),
)


def number(value) -> str:
    """A figure to three significant digits or so, with thousands separated."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    size = abs(value)
    if size >= 100 or isinstance(value, int):
        return f"{value:,.0f}"
    return f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 0.1 else f"{value:.3g}"


def joined(values, unit: str = "") -> str:
    """Values of the ISAs side by side ("216 / 196 tok/s"); "–" where none was measured."""
    cells = [number(v) if v is not None else "–" for v in values]
    if all(c == "–" for c in cells):
        return "–"
    return " / ".join(cells) + (unit if unit.startswith("×") or not unit else f" {unit}")


def isas_of(result: dict) -> list[str]:
    return [isa for isa in ISA_NAMES if isinstance(result.get(isa), dict)]


def isa_header(isas: list[str], machine: dict) -> str:
    names = [machine.get("native_isa", "native") if isa == "native" else ISA_NAMES[isa] for isa in isas]
    return " / ".join(names)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def compare_row(name: str, compare: dict, key: str) -> tuple[str, ...] | None:
    """One measure of compare_llamacpp.py for every ISA it ran: (what, llama-chat, llama.cpp, ratio)."""
    label, ours_key, theirs_key, unit, ratio_key = next(row for row in COMPARE_ROWS if row[1] == key)
    isas = isas_of(compare)
    ours = [compare[isa]["ours"].get(ours_key) for isa in isas]
    if all(v is None for v in ours):
        return None
    theirs = [compare[isa]["llamacpp"].get(theirs_key) for isa in isas]
    ratios = [compare[isa].get(ratio_key) for isa in isas]
    what = f"{MODEL_NAMES[name]}: {label.format(n=compare.get('prefill_long', 512))}"
    if key == "lookup":
        same = [compare[isa].get("lookup_tokens_equal_to_llamacpp") for isa in isas]
        if any(same):
            what += f"; tokens equal to llama.cpp's: {joined(same)}"
    return what, joined(ours, unit), joined(theirs, unit), joined([r and f"{r}×" for r in ratios])


def roofline_row(name: str, roofline: dict, kind: str) -> tuple[str, str, str]:
    """Decode against the read bandwidth, or prefill against the compute limit, for every ISA."""
    isas = isas_of(roofline)
    model = MODEL_NAMES[name.replace("roofline", "compare")]
    if kind == "decode":
        key = "decode_fraction_of_bandwidth"
        what = (
            f"{model}: decode, fraction of the read bandwidth "
            f"({roofline['decode_bytes_per_token'] / 1e9:.3g} GB a token at context "
            f"{roofline['decode_context']})"
        )
    else:
        key = "prefill_fraction_of_compute"
        what = (
            f"{model}: prefill of {roofline['prefill_tokens']}, fraction of the compute limit "
            f"({roofline['prefill_ops_per_token'] / 1e9:.3g} GOP a token; llama-chat "
            f"{'float32 multiply-adds' if roofline['activations'] == 'f32' else '8-bit dot products'}, "
            "llama.cpp 8-bit dot products)"
        )
    cells = [
        joined([roofline[isa].get(f"{engine}_{key}") for isa in isas]) for engine in ("ours", "llamacpp")
    ]
    return what, *cells


def bench_row(bench: dict, key) -> tuple[str, ...] | None:
    label, keys, unit = next(row for row in BENCH_ROWS if row[1] == key)
    values = [bench.get(k) for k in (keys if isinstance(keys, tuple) else (keys,))]
    if all(v is None for v in values):
        return None
    return label, joined(values, unit)


def codecs_row(bench: dict) -> tuple[str, ...] | None:
    codec = bench.get("codecs", {}).get(bench.get("default_codec"))
    if not codec:
        return None
    return (
        f"stored KV, the default codec ({bench['default_codec']})",
        f"{number(codec['bytes_per_token'])} bytes/token",
    )


def cluster_row(cluster: dict, key: str) -> tuple[str, str] | None:
    """One measure of benchmarks/cluster.py: a conversation moved (best, p50, p95 of its runs), the
    TTFT of a continued turn by where its KV came from (p50 / p95), or the output of 1 and 2 servers."""
    if key == "migration_ms":
        moved = cluster.get("migration_ms")
        if not moved:
            return None
        what = (
            f"a {number(moved['prompt_tokens'])}-token conversation moved to another server: KV ready "
            f"(its first token from Redis less from RAM; best / p50 / p95 of {moved['n']})"
        )
        return what, joined([moved.get("best"), moved["p50"], moved["p95"]], "ms")
    if key == "output_tok_s":
        rates = cluster.get("output_tok_s")
        if not rates:
            return None
        return "output tokens a second, 1 / 2 servers", joined([rates.get("1"), rates.get("2")], "tok/s")
    ttft = cluster.get("ttft_ms", {}).get(key)
    if not ttft:
        return None
    tokens = number(cluster.get("ttft_prompt_tokens", 0))
    what = f"first token of a continued {tokens}-token turn (p50 / p95): {dict(TTFT_SOURCES)[key]}"
    return what, joined([ttft["p50"], ttft["p95"]], "ms")


def cluster_section(cluster: dict) -> str:
    keys = [key for key, _ in TTFT_SOURCES] + ["migration_ms", "output_tok_s"]
    rows = [row for key in keys if (row := cluster_row(cluster, key))]
    return "\n\n".join(
        [
            f"`benchmarks/cluster.py`: `{cluster.get('model', '?')}`, two `llama-chat serve`s at "
            f"{cluster.get('threads_per_server', 1)} thread each behind HAProxy, their KV shared through a "
            "Redis Cluster of 3 primaries and 3 replicas, all on this machine's loopback "
            "(`deploy/local-cluster.sh`).",
            table(("what", "figure"), rows),
        ]
    )


def machine_line(machine: dict, rounds: str = "") -> str:
    flags = ", ".join(machine.get("flags", [])) or "–"
    return (
        f"{machine.get('cpu', 'unknown CPU')}, {machine.get('vcpus', '?')} vCPUs (flags: {flags}); "
        f"{machine.get('date', '?')}, commit {machine.get('commit', '?')}{rounds}"
    )


def compare_section(name: str, compare: dict, machine: dict) -> str:
    rows = [row for key in (r[1] for r in COMPARE_ROWS) if (row := compare_row(name, compare, key))]
    builds = "; ".join(
        f"{ISA_NAMES[isa]}: {compare[isa]['ours'].get('build', '?')} against "
        f"{compare[isa]['llamacpp'].get('build', 'no llama.cpp')}"
        for isa in isas_of(compare)
    )
    first = "; ".join(
        f"{ISA_NAMES[isa]} {number(compare.get(f'{isa}_ours_first_start_s'))} s" for isa in isas_of(compare)
    )
    header = (
        f"what ({isa_header(isas_of(compare), machine)})",
        "llama-chat",
        "llama.cpp",
        "llama-chat / llama.cpp",
    )
    return "\n\n".join(
        [
            f"`{Path(compare['model']).name}`, {compare.get('threads')} threads, activations "
            f"{compare.get('activations')}. Builds: {builds}. llama-chat's first start (compiling for the "
            f"profile, packing the weights): {first}. Ratios are llama-chat over llama.cpp (for the turn, "
            "load and RSS, lower is better for llama-chat).",
            table(header, rows),
        ]
    )


def limits_section(roofline: dict, machine: dict) -> str:
    """Each limit on 1 thread and on the engines' threads; the fractions take the higher."""
    n, limits = roofline["threads"], roofline["limits"]

    def both(figures: dict, key: str, unit: str) -> str:
        return joined([figures.get(on_threads(key, 1)), figures.get(on_threads(key, n))], unit)

    rows = [(f"read bandwidth from RAM, 1 / {n} threads", both(roofline, "bandwidth_gb_s", "GB/s"))]
    for key, what, unit in (
        ("fma_gflop_s", "float32 multiply-add", "GFLOP/s"),
        ("int8_gop_s", "8-bit dot product", "GOP/s"),
    ):
        for isa in isas_of(roofline):
            how = f" ({limits[isa]['byte_dot']})" if key == "int8_gop_s" else ""
            rows.append(
                (
                    f"{ISA_NAMES[isa]} ({limits[isa]['isa']}): {what}{how}, 1 / {n} threads",
                    both(limits[isa], key, unit),
                )
            )
    return table(("limit", "figure"), rows)


def fractions_section(inputs: dict, machine: dict) -> str:
    rows = [
        roofline_row(name, inputs[name], kind)
        for name in ("roofline", "roofline_7b")
        if name in inputs
        for kind in ("decode", "prefill")
    ]
    first = inputs.get("roofline") or inputs["roofline_7b"]
    return table((f"what ({isa_header(isas_of(first), machine)})", "llama-chat", "llama.cpp"), rows)


def codecs_section(bench: dict) -> str:
    rows = [
        (
            f"**{name}** (default)" if name == bench.get("default_codec") else name,
            number(c["bytes_per_token"]),
            f"{number(c['encode_ms'])} / {number(c['decode_ms'])} ms",
            f"{c['kl']:.2g}",
            str(c["greedy_match"]),
        )
        for name, c in bench["codecs"].items()
    ]
    return table(
        ("codec", "bytes/token", "encode / decode per 1,024 tokens", "KL", "greedy tokens as live"), rows
    )


def headline_rows(inputs: dict) -> list[tuple[str, ...]]:
    """The README's rows, each exactly as docs/figures.md writes it: (what, llama-chat, llama.cpp, ratio)."""
    rows = []
    for name, kind, key in HEADLINE:
        data = inputs.get(name)
        if not data:
            continue
        if kind == "compare":
            row = compare_row(name, data, key)
        elif kind == "roofline":
            row = roofline_row(name, data, key)
        elif kind == "cluster":
            row = cluster_row(data, key)
        else:
            row = bench_row(data, key) if kind == "bench" else codecs_row(data)
        if row:
            rows.append(row + ("",) * (4 - len(row)))
    return rows


def readme_block(inputs: dict) -> str:
    machine = inputs.get("machine", {})
    isas = isa_header(isas_of(inputs.get("compare") or inputs.get("compare_7b") or {}), machine)
    return "\n\n".join(
        [
            f"From [docs/figures.md](docs/figures.md), which `benchmarks/figures.py` writes: "
            f"{machine_line(machine)}. Two figures in a cell are {isas or 'the ISAs measured'}; "
            "the machine is shared, so each figure is the best of a few rounds and moves between runs. "
            f"{machine.get('note', '')}".strip(),
            table(("what", "llama-chat", "llama.cpp", "llama-chat / llama.cpp"), headline_rows(inputs)),
        ]
    )


def figures_page(inputs: dict, command: str) -> str:
    """docs/figures.md: every section whose input is there."""
    machine = inputs.get("machine", {})
    parts = [
        "# Figures",
        "Written by `benchmarks/figures.py` (do not edit: run it again). "
        f"Machine: {machine_line(machine)}. The command: `{command}`. {machine.get('note', '')}".strip(),
        "The machine is shared with other work: each figure is the best of a few alternating rounds (see "
        "each script's docstring), and figures move between runs. Compare the columns of one run; ratios to "
        "llama.cpp move from machine to machine, fractions of the machine's own limits carry over "
        "([performance.md](performance.md)). How to reproduce: [benchmarks.md](benchmarks.md).",
    ]
    for name, title in (
        ("compare", "The default model against llama.cpp"),
        ("compare_7b", "A 7B against llama.cpp"),
        ("compare_moe", "Qwen3-30B-A3B (its first 8 of 48 layers) against llama.cpp"),
        ("compare_gptoss", "gpt-oss-20b (its first 4 of 24 layers) against llama.cpp"),
    ):
        if name in inputs:
            parts += [f"## {title}", compare_section(name, inputs[name], machine)]
    rooflines = [inputs[name] for name in ("roofline", "roofline_7b") if name in inputs]
    if rooflines:
        parts += [
            "## The machine's limits, and the fraction of them each engine reaches",
            "`benchmarks/roofline.py`: the limits (`benchmarks/limits.py`), then decode as bytes moved "
            "a second "
            "against the read bandwidth and prefill as operations a second against the peak of the "
            "instructions that multiply.",
            limits_section(rooflines[0], machine),
            fractions_section(inputs, machine),
        ]
    if "bench" in inputs:
        bench = inputs["bench"]
        rows = [row for key in (r[1] for r in BENCH_ROWS) if (row := bench_row(bench, key))]
        rows += [row for row in [codecs_row(bench)] if row]
        parts += [
            "## `llama-chat bench`",
            f"`llama-chat bench --json` on the default model, kernels `{bench.get('kernel_profile', '?')}`, "
            f"activations {bench.get('activations', 'f32')}.",
            table(("what", "figure"), rows),
        ]
        if bench.get("codecs"):
            parts += [
                "### Stored KV codecs",
                "The default model's real cache, 1,024 tokens; KL of the next-token distribution and greedy "
                "tokens matching the live cache over 32 steps.",
                codecs_section(bench),
            ]
    if "cluster" in inputs:
        parts += ["## Several servers", cluster_section(inputs["cluster"])]
    return "\n\n".join(parts) + "\n"
