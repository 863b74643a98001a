"""How close each engine comes to this machine's own limits: decode against its read bandwidth, prefill
against the peak rate of the instructions that multiply.

    python benchmarks/roofline.py [--model NAME|PATH] [--threads 2] [--rounds 3]
        [--llamacpp ISA=PYTHON ...] [--prefill-long 512] [--decode-tokens 16] [--activations f32|q8|mixed]
        [--no-mmap] [--from-compare FILE] [--limits FILE ...]

A ratio to llama.cpp moves from machine to machine; the fraction of the machine's limits each engine
reaches is what carries over. Three parts:

- The machine (benchmarks/limits.py, in a process per ISA so that each compiles for its profile): read
  bandwidth from RAM with 1 and --threads threads, and per ISA the peak rates of the float32 multiply-add
  and of the 8-bit dot product (`vpdpbusd` with AVX-512 VNNI, `vpmaddubsw` with AVX2).
- The model (from its GGUF): the bytes a decoded token reads — every weight as stored (the embedding
  table only where the output matrix is tied to it: otherwise a token reads one row of it) and the
  float16 KV cache at the decode's context — and the operations a prefill token does: 2 per weight of
  the layers' matrices, the attention's q·k and weights·v at the prompt's mean context, and the output
  matrix once a prompt (only the last token's logits are computed).
- Both engines, measured by compare_llamacpp.py's own functions (the same children, alternating rounds,
  best of each; `--llamacpp native=PY --llamacpp avx2=PY` for both ISAs), or read from its JSON with
  --from-compare. Decode's fraction: tok/s × bytes a token / bandwidth. Prefill's (of --prefill-long
  tokens): tok/s × operations a token / the peak of what the engine multiplies with — float32
  multiply-adds for `--activations f32`, 8-bit dot products for the default `q8`, for `mixed` (most
  of whose operations take bytes) and for llama.cpp, which always quantizes its inputs to bytes.

Prints a table per ISA, then one JSON object on the last line (the first ISA's fractions at the top,
every ISA's under its name). `--limits FILE` takes the limits from an earlier run's JSON instead of
measuring them (figures.py hands the first model's to the second's, so both use the same); with
several files, each limit is the best of theirs: a limit is what the machine can do, and other work
on a shared machine only ever lowers what a measurement sees. A fraction above 1 says the limits were
measured in a busier moment than the engines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from compare_llamacpp import add_engine_options, compare, engine_profiles, make_spec
from isa import ISAS, cpu_name, our_env
from limits import on_threads

from llama_chat.inference import resolve_model
from llama_chat.inference.weights import Prepared, model_info

LIMITS = Path(__file__).with_name("limits.py")
KV_BYTES = 2  # the float16 KV cache, both engines' default
HEADLINE_ENDINGS = ("_of_bandwidth", "_of_compute")
# The first ISA's fractions, at the top of the JSON (None where that engine was not measured).
HEADLINE = (
    "ours_decode_fraction_of_bandwidth",
    "llamacpp_decode_fraction_of_bandwidth",
    "ours_prefill_fraction_of_compute",
    "llamacpp_prefill_fraction_of_compute",
)


def last_json(text: str) -> dict:
    """The JSON object on the last line of a script's output."""
    return json.loads(text.strip().splitlines()[-1])


def read_output(parser: argparse.ArgumentParser, file: str, *keys: str) -> dict:
    """A script's saved output, with `keys` in its JSON; else one line on what is wrong, exit status 2."""
    try:
        result = last_json(Path(file).read_text())
    except (OSError, ValueError, IndexError) as error:
        parser.error(f"{file}: no JSON output of a benchmark ({error})")
    missing = [key for key in keys if key not in result]
    if missing:
        parser.error(f"{file}: its JSON has no {', '.join(missing)}")
    return result


def best_limits(runs: list[dict]) -> dict:
    """{isa: limits} with each figure the highest of the runs' (the runs: {isa: limits.py's result})."""
    best: dict = {}
    for run in runs:
        for isa, limits in run.items():
            mine = best.setdefault(isa, {})
            for key, value in limits.items():
                keep = isinstance(value, float) and isinstance(mine.get(key), float)
                mine[key] = max(mine[key], value) if keep else mine.get(key, value)
    return best


def measure_limits(isas: list[str], threads: int) -> dict:
    """{isa: limits.py's result} in a process per ISA; the bandwidth once, with the first."""
    limits = {}
    for i, isa in enumerate(isas):
        cmd = [sys.executable, str(LIMITS), "--threads", str(threads), *(["--no-bandwidth"] if i else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, env=our_env(isa))
        if done.returncode != 0:
            raise SystemExit(f"{LIMITS.name} ({isa}) failed:\n{done.stderr[-3000:]}")
        limits[isa] = last_json(done.stdout)
    return limits


def sliding(info: Prepared, layer: int, context: int) -> int:
    """The positions a token at `context` attends to in `layer` (a sliding window keeps its last ones)."""
    cfg = info.config
    return min(context, cfg.sliding_window) if cfg.is_sliding(layer) else context


def weight_bytes(info: Prepared) -> int:
    """The bytes of the weights a decoded token reads, as the GGUF stores them."""
    tied = "output.weight" not in info.tensors
    return sum(t.nbytes for name, t in info.tensors.items() if tied or name != "token_embd.weight")


def kv_bytes(info: Prepared, context: int) -> int:
    """The float16 keys and values one token's attention reads at `context` cached positions."""
    cfg = info.config
    per_position = 2 * cfg.n_head_kv * cfg.head_dim * KV_BYTES
    return per_position * sum(sliding(info, layer, context) for layer in range(cfg.n_layer))


def prefill_ops(info: Prepared, tokens: int) -> float:
    """Operations (a multiply or an add) a token of a `tokens`-token prompt does, on average."""
    cfg = info.config
    layer_weights = sum(
        t.shape[0] * t.shape[1]
        for name, t in info.tensors.items()
        if name.startswith("blk.") and len(t.shape) == 2
    )
    attention = sum(
        4 * cfg.n_head * cfg.head_dim * sliding(info, layer, position)
        for layer in range(cfg.n_layer)
        for position in range(1, tokens + 1)
    )
    return 2 * layer_weights + attention / tokens + 2 * cfg.n_vocab * cfg.n_embd / tokens


def model_needs(info: Prepared, prefill_tokens: int, decode_tokens: int) -> dict:
    """What a decoded token reads (at the mean context of a decode after a `prefill_tokens` prompt) and
    what a prefill token does."""
    context = prefill_tokens + decode_tokens // 2
    needs = {
        "weight_bytes": weight_bytes(info),
        "kv_bytes_per_token": kv_bytes(info, context),
        "decode_context": context,
        "prefill_ops_per_token": round(prefill_ops(info, prefill_tokens)),
        "prefill_tokens": prefill_tokens,
    }
    return {**needs, "decode_bytes_per_token": needs["weight_bytes"] + needs["kv_bytes_per_token"]}


def fractions(measured: dict, limits: dict, bandwidth_gb_s: float, needs: dict, activations: str) -> dict:
    """Each engine's decode (bytes moved a second) and prefill (operations a second) against the limits."""
    out = {}
    peaks = {"ours": limits["fma_gflop_s"] if activations == "f32" else limits["int8_gop_s"]}
    peaks["llamacpp"] = limits["int8_gop_s"]
    for engine in ("ours", "llamacpp"):
        side = measured.get(engine, {})
        if "decode" in side:
            gb_s = side["decode"] * needs["decode_bytes_per_token"] / 1e9
            out[f"{engine}_decode_gb_s"] = round(gb_s, 2)
            out[f"{engine}_decode_fraction_of_bandwidth"] = round(gb_s / bandwidth_gb_s, 3)
        if "prefill_long" in side:
            gop_s = side["prefill_long"] * needs["prefill_ops_per_token"] / 1e9
            out[f"{engine}_prefill_gop_s"] = round(gop_s, 1)
            out[f"{engine}_prefill_fraction_of_compute"] = round(gop_s / peaks[engine], 3)
    out["ours_compute_limit"] = "fma" if activations == "f32" else "int8"
    return out


def print_report(result: dict, isas: list[str]) -> None:
    gb = result["decode_bytes_per_token"] / 1e9
    print(
        f"machine: {result['cpu']}; read bandwidth {result['bandwidth_gb_s_1_thread']} GB/s (1 thread), "
        f"{result[on_threads('bandwidth_gb_s', result['threads'])]} GB/s ({result['threads']} threads): "
        f"the limit {result['bandwidth_gb_s']} GB/s"
    )
    print(
        f"model: {Path(result['model']).name}: a decoded token reads {gb:.3f} GB (weights "
        f"{result['weight_bytes'] / 1e9:.3f} GB, KV at {result['decode_context']} "
        f"{result['kv_bytes_per_token'] / 1e6:.1f} MB); a prefill token does "
        f"{result['prefill_ops_per_token'] / 1e9:.2f} GOP ({result['prefill_tokens']} tokens); the weights "
        + ("mapped from their files" if result["use_mmap"] else "read into each engine's memory (--no-mmap)")
    )
    for isa in isas:
        limits, row = result["limits"][isa], result[isa]
        print(
            f"-- {isa} ({limits['isa']}, {limits['byte_dot']}): float32 FMA {limits['fma_gflop_s']} GFLOP/s, "
            f"8-bit dot {limits['int8_gop_s']} GOP/s; llama-chat's prefill against "
            f"{row['ours_compute_limit']}"
        )
        print(f"{'':30}{'llama-chat':>12}{'llama.cpp':>12}")
        for key, name in (
            ("decode_gb_s", "decode GB/s"),
            ("decode_fraction_of_bandwidth", "decode / bandwidth"),
            ("prefill_gop_s", "prefill GOP/s"),
            ("prefill_fraction_of_compute", "prefill / compute limit"),
        ):
            cells = [row.get(f"{engine}_{key}", "–") for engine in ("ours", "llamacpp")]
            print(f"{name:30}{cells[0]:>12}{cells[1]:>12}")
        if any(isinstance(v, float) and v > 1 for k, v in row.items() if k.endswith(HEADLINE_ENDINGS)):
            print("a fraction above 1: the limits were measured in a busier moment than that engine")


def engines(args, path: str, profiles: dict) -> dict:
    """compare_llamacpp.py's result: measured now (no turn, no code edit) unless read from --from-compare."""
    spec = make_spec(
        path, args.threads, args.prefill_long, 0, args.decode_tokens, 0, args.activations, not args.no_mmap
    )
    return {
        "model": path,
        "threads": args.threads,
        "activations": args.activations,
        "use_mmap": not args.no_mmap,
        "prefill_long": args.prefill_long,
        "decode_tokens": args.decode_tokens,
        **compare(spec, profiles, args.rounds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser)
    parser.add_argument(
        "--from-compare", metavar="FILE", help="compare_llamacpp.py's output, instead of running it"
    )
    parser.add_argument(
        "--limits",
        action="append",
        default=[],
        metavar="FILE",
        help="an earlier roofline.py output whose limits to use (repeatable: the best of each)",
    )
    args = parser.parse_args()
    if args.from_compare:
        needs = ("model", "threads", "activations", "prefill_long", "decode_tokens")
        measured = read_output(parser, args.from_compare, *needs)
    else:
        measured = engines(args, str(resolve_model(args.model)), engine_profiles(parser, args))
    isas = [key for key in measured if key in ISAS]  # those measured, in their order
    threads = measured["threads"]
    earlier = [read_output(parser, file, "limits")["limits"] for file in args.limits]
    limits = best_limits(earlier) if earlier else measure_limits(isas, threads)
    if missing := [isa for isa in isas if isa not in limits]:
        parser.error(f"no limits for {', '.join(missing)} in {', '.join(args.limits)}")
    first = limits[isas[0]]
    info = model_info(Path(measured["model"]))
    result = {
        "model": measured["model"],
        "cpu": cpu_name(),
        "threads": threads,
        "activations": measured["activations"],
        "use_mmap": measured.get("use_mmap", True),
        **{key: value for key, value in first.items() if key.startswith("bandwidth_gb_s")},
        **model_needs(info, measured["prefill_long"], measured["decode_tokens"]),
        "limits": limits,
    }
    for isa in isas:
        result[isa] = fractions(
            measured[isa], limits[isa], first["bandwidth_gb_s"], result, result["activations"]
        )
    print_report(result, isas)
    result |= {key: result[isas[0]].get(key) for key in HEADLINE}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
