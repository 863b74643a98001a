"""benchmarks/figures.py: docs/figures.md and the README's figures block written from the benchmarks' JSON,
without running an engine; benchmarks/roofline.py's count of what a model reads and does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import figures  # noqa: E402
import figures_tables  # noqa: E402


def engine(decode, prefill_long, **more):
    return {
        "build": "test build",
        "decode": decode,
        "prefill_long": prefill_long,
        "prefill_short": 100.0,
        **more,
    }


COMPARE = {
    "model": "/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "threads": 2,
    "activations": "f32",
    "prefill_long": 512,
    "decode_tokens": 16,
    "native_ours_first_start_s": 12.5,
    "avx2_ours_first_start_s": 13.0,
    "native": {
        "ours": engine(22.0, 216.0, lookup=70.2, turn_ms=344.0, peak_rss_mb=880.0),
        "llamacpp": engine(16.1, 200.0, code_decode=16.7, turn_ms=455.0, peak_rss_mb=687.0),
        "decode_ratio": 1.37,
        "prefill_512_ratio": 1.08,
        "lookup_vs_llamacpp_decode": 4.2,
        "lookup_tokens_equal_to_llamacpp": "118/118",
        "turn_ratio": 0.76,
    },
    "avx2": {
        "ours": engine(21.1, 196.0, lookup=51.1, turn_ms=469.0, peak_rss_mb=882.0),
        "llamacpp": engine(15.7, 132.0, code_decode=16.3, turn_ms=615.0, peak_rss_mb=687.0),
        "decode_ratio": 1.34,
        "prefill_512_ratio": 1.48,
        "turn_ratio": 0.76,
    },
}
LIMITS = {
    "isa": "AVX-512",
    "byte_dot": "vnni",
    "fma_gflop_s_1_thread": 95.0,
    "fma_gflop_s_2_threads": 180.0,
    "fma_gflop_s": 180.0,
    "int8_gop_s": 700.0,
}
ROOFLINE = {
    "model": COMPARE["model"],
    "threads": 2,
    "activations": "f32",
    "bandwidth_gb_s": 24.7,
    "bandwidth_gb_s_1_thread": 23.9,
    "bandwidth_gb_s_2_threads": 24.7,
    "decode_bytes_per_token": 398_249_472,
    "decode_context": 520,
    "prefill_ops_per_token": 738_248_000,
    "prefill_tokens": 512,
    "limits": {"native": LIMITS, "avx2": {**LIMITS, "isa": "AVX2", "byte_dot": "avx2"}},
    "native": {"ours_decode_fraction_of_bandwidth": 0.358, "llamacpp_decode_fraction_of_bandwidth": 0.26},
    "avx2": {"ours_decode_fraction_of_bandwidth": 0.341},
}
BENCH = {
    "compile_s": 12.1,
    "resume_ms_2048": 31.8,
    "export_ms_2048": 37.0,
    "import_ms_2048": 101.0,
    "default_codec": "q8",
    "codecs": {
        "q8": {"bytes_per_token": 6530, "encode_ms": 35, "decode_ms": 11.5, "kl": 7.3e-5, "greedy_match": 32}
    },
}
CLUSTER = {
    "model": "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "threads_per_server": 1,
    "ttft_ms": {
        "ram": {"best": 480.0, "p50": 590.0, "p95": 841.0, "n": 8},
        "redis": {"best": 470.0, "p50": 498.0, "p95": 821.0, "n": 8},
        "recomputed": {"best": 12000.0, "p50": 13223.0, "p95": 17441.0, "n": 8},
    },
    "ttft_prompt_tokens": 602,
    "migration_ms": {"best": 41.5, "p50": 52.0, "p95": 77.3, "n": 5, "prompt_tokens": 1901},
    "output_tok_s": {"1": 4.5, "2": 6.2},
}
INPUTS = {
    "compare": COMPARE,
    "roofline": ROOFLINE,
    "bench": BENCH,
    "cluster": CLUSTER,
    "machine": {"cpu": "Test CPU", "date": "d"},
}


def rows_of(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]


def test_a_measure_of_both_engines_is_one_row_with_both_isas_side_by_side():
    page = figures_tables.figures_page(INPUTS, "python benchmarks/figures.py")
    assert "| 0.5B: decode at context 512 | 22.0 / 21.1 tok/s | 16.1 / 15.7 tok/s | 1.37× / 1.34× |" in page
    assert (
        "| 0.5B: a 64-token turn after 1,024 cached tokens | 344 / 469 ms | 455 / 615 ms | 0.76× / 0.76× |"
        in page
    )
    assert "118/118" in page  # the lookup's tokens, compared with llama.cpp's
    assert "Test CPU" in page


def test_the_roofline_rows_give_each_engines_fraction_and_a_missing_one_as_a_dash():
    page = figures_tables.figures_page(INPUTS, "")
    decode = next(row for row in rows_of(page) if "decode, fraction of the read bandwidth" in row)
    assert decode.endswith("| 0.36 / 0.34 | 0.26 / – |")
    assert "| read bandwidth from RAM, 1 / 2 threads | 23.9 / 24.7 GB/s |" in page
    assert "| native (AVX-512): float32 multiply-add, 1 / 2 threads | 95.0 / 180 GFLOP/s |" in page


def test_a_mixture_of_experts_has_its_section_and_its_decode_in_the_readme():
    moe = {**COMPARE, "model": "/x/synthetic-qwen3-30b-a3b-8layers-q4_k_m.gguf"}
    inputs = {**INPUTS, "compare_moe": moe}
    page = figures_tables.figures_page(inputs, "")
    assert "## Qwen3-30B-A3B (its first 8 of 48 layers) against llama.cpp" in page
    row = "| Qwen3-30B-A3B: decode at context 512 | 22.0 / 21.1 tok/s | 16.1 / 15.7 tok/s | 1.37× / 1.34× |"
    assert row in page and row in figures_tables.readme_block(inputs)


def test_a_missing_source_leaves_its_section_out():
    page = figures_tables.figures_page({"bench": BENCH}, "")
    assert "## The default model" not in page and "## The machine" not in page
    assert "| resume a stored ~2,000-token conversation, fresh process | 31.8 ms |" in page
    assert "| export / import of that session | 37.0 / 101 ms |" in page


def test_the_cluster_rows_give_a_moved_conversation_and_each_source_of_a_continued_turns_kv():
    page = figures_tables.figures_page(INPUTS, "")
    section = page.split("## Several servers")[1]
    assert "two `llama-chat serve`s at 1 thread each behind HAProxy" in section
    moved = "| a 1,901-token conversation moved to another server: KV ready"
    how = "(its first token from Redis less from RAM; best / p50 / p95 of 5)"
    assert f"{moved} {how} | 41.5 / 52.0 / 77.3 ms |" in section
    ram = "| first token of a continued 602-token turn (p50 / p95): its KV in the server's RAM"
    assert f"{ram} | 590 / 841 ms |" in section
    assert "recomputed | 13,223 / 17,441 ms |" in section
    assert "| output tokens a second, 1 / 2 servers | 4.50 / 6.20 tok/s |" in section
    assert moved in figures_tables.readme_block(INPUTS)  # a headline row
    assert "## Several servers" not in figures_tables.figures_page({"bench": BENCH}, "")


def test_every_readme_row_is_a_row_of_the_page_word_for_word():
    page_rows = set(rows_of(figures_tables.figures_page(INPUTS, "")))
    block_rows = rows_of(figures_tables.readme_block(INPUTS))[1:]  # after the header
    assert len(block_rows) >= 5
    for row in block_rows:
        cells = [cell for cell in row.split(" | ") if cell.strip("| ")]
        # a bench row has the page's two cells; the others all four
        assert any(page_row.startswith(" | ".join(cells)) for page_row in page_rows), row


def test_the_readme_block_is_replaced_between_its_markers_only():
    text = f"before\n{figures.BEGIN}\nold figures\n{figures.END}\nafter\n"
    new = figures.replace_block(text, "new figures")
    assert new == f"before\n{figures.BEGIN}\nnew figures\n{figures.END}\nafter\n"
    with pytest.raises(ValueError):
        figures.replace_block("no markers", "x")


def test_figures_writes_the_page_and_the_readme_from_saved_json_without_running_anything(tmp_path):
    files = {}
    for name in ("compare", "roofline", "bench", "cluster"):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(f"a table a script prints\n{json.dumps(INPUTS[name])}\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{figures.BEGIN}\n{figures.END}\nrest\n")
    out = tmp_path / "figures.md"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "figures.py"),
            "--skip",
            "compare_7b",
            "--skip",
            "roofline_7b",
            "--skip",
            "compare_moe",
            "--skip",
            "compare_gptoss",
            *(f"--from-json={name}={file}" for name, file in files.items()),
            "--out",
            str(out),
            "--readme",
            str(readme),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| 0.5B: prefill, 512 tokens | 216 / 196 tok/s |" in out.read_text()
    block = readme.read_text()
    assert block.startswith(f"# x\n{figures.BEGIN}\n") and block.endswith(f"{figures.END}\nrest\n")
    assert "| 0.5B: prefill, 512 tokens | 216 / 196 tok/s |" in block
    assert "moved to another server: KV ready" in out.read_text() and "moved to another server" in block


def test_a_source_named_wrong_is_one_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "figures.py"),
            f"--from-json=nonsense={tmp_path}",
            "--skip",
            "bench",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--from-json nonsense=" in done.stderr
    assert "Traceback" not in done.stderr


def test_roofline_counts_the_bytes_a_token_reads_and_the_operations_it_does(tiny_model_paths):
    import roofline

    from llama_chat.inference.weights import model_info

    info = model_info(Path(tiny_model_paths["qwen2"]), use_cache=False)
    cfg = info.config
    tied = "output.weight" not in info.tensors  # then the output product reads the embedding table
    read = sum(t.nbytes for name, t in info.tensors.items() if tied or name != "token_embd.weight")
    needs = roofline.model_needs(info, prefill_tokens=8, decode_tokens=4)
    assert needs["weight_bytes"] == read
    assert needs["decode_context"] == 10
    assert needs["kv_bytes_per_token"] == 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 2 * 10
    assert needs["decode_bytes_per_token"] == needs["weight_bytes"] + needs["kv_bytes_per_token"]
    per_layer_weights = sum(
        t.shape[0] * t.shape[1] for n, t in info.tensors.items() if n.startswith("blk.") and len(t.shape) == 2
    )
    assert needs["prefill_ops_per_token"] > 2 * per_layer_weights


def test_each_limit_is_the_best_of_the_runs_measuring_it():
    """Other work on a shared machine only lowers what a measurement of a limit sees."""
    import roofline

    busy = {"native": {"isa": "AVX-512", "bandwidth_gb_s": 4.4, "fma_gflop_s": 58.3, "threads": 2}}
    quiet = {"native": {"isa": "AVX-512", "bandwidth_gb_s": 19.5, "fma_gflop_s": 51.0, "threads": 2}}
    best = roofline.best_limits([busy, quiet])["native"]
    assert (best["bandwidth_gb_s"], best["fma_gflop_s"], best["isa"]) == (19.5, 58.3, "AVX-512")
