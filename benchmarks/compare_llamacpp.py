"""Run llama-chat and llama.cpp (through llama-cpp-python) on the same GGUF, in one run, for each ISA asked.

    python benchmarks/compare_llamacpp.py [--model NAME|PATH] [--threads 2] [--rounds 3]
        [--llamacpp ISA=PYTHON ...] [--decode-tokens 16] [--lookup-tokens 160] [--full]
        [--prefill-long 512] [--turn-cached 1024] [--activations f32|q8|mixed] [--no-mmap]

Per engine: warm load (to the first token: llama.cpp maps the file, llama-chat reads its prepared
weights; then one token each, which touches every weight page), prefill of 32 and of 512 tokens, decode at
context 512, a 64-token turn after 1,024 cached tokens (the time to first token of a continued chat; llama.cpp
evaluates the 1,024 then times the 64), peak RSS, and a reply that edits code from its prompt (llama-chat with
prompt lookup against llama.cpp's plain decode, greedy, the token ids compared; --lookup-tokens 0 leaves it
out, as for a synthetic model whose replies are noise). Every measurement runs in a process of its own per
engine (so RSS is that engine's), in alternating rounds, the best of each kept. Prints the ratios
(llama-chat / llama.cpp; `turn_ratio` is ours / theirs in time, lower is better), then one JSON object
on the last line (with --full, the whole `llama-chat bench --json` result too).

ISAs (benchmarks/isa.py): `--llamacpp native=PY --llamacpp avx2=PY` compares both side by side: PY is a
Python with llama-cpp-python built for that ISA, and llama-chat runs with numba compiling for the same
(avx2: NUMBA_CPU_NAME=haswell, no AVX-512 features, its own kernel cache). Without --llamacpp: native,
with this Python's llama-cpp-python. llama-cpp-python is a tool for this script only, never a dependency
of llama-chat; it builds llama.cpp from source (several minutes), one build per ISA in its own venv:

    python3 -m venv ~/llamacpp-native && ~/llamacpp-native/bin/pip install numpy llama-cpp-python
    python3 -m venv ~/llamacpp-avx2 && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \\
        -DGGML_F16C=ON -DGGML_AVX512=OFF" ~/llamacpp-avx2/bin/pip install --no-binary llama-cpp-python \\
        --no-cache-dir numpy llama-cpp-python

Only libggml-cpu is built with ISA flags (ggml-base and llama get none), so a copy of the native venv with
its libggml-cpu.so* replaced by one built with those options (`cmake --build B --target ggml-cpu`, a few
minutes) is the same AVX2 build. A real-size model without a download: benchmarks/synthetic_model.py qwen2-7b
(then --model that file). roofline.py measures through the same functions (make_spec, compare); figures.py
runs this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from isa import ISAS, cpu_name, our_env

from llama_chat.app.bench.samples import sample_tokens
from llama_chat.inference import resolve_model
from llama_chat.inference.activation_modes import ACTIVATIONS, DEFAULT_ACTIVATIONS
from llama_chat.inference.tokenizer import load_tokenizer

PREFILL_SHORT, PREFILL_LONG, TURN_CACHED, TURN = 32, 512, 1024, 64
TURN_REPEATS = 3

# Both children get the same spec (JSON in argv) and print one JSON line of results: seconds for loads,
# tokens/s for prefills and decode, milliseconds for the turn, MB for RSS.
OURS_CHILD = """
import json, resource, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
t = time.perf_counter()
from llama_chat.inference import load_model
import_s = time.perf_counter() - t
t = time.perf_counter()
model = load_model(spec["path"], activations=spec["activations"], use_mmap=spec["use_mmap"])
warm_up = model.new_sequence(2)
model.forward(spec["ids"][:1], warm_up)  # on a first start, compiles the kernels
warm_up.free()
out = {"load_s": time.perf_counter() - t, "import_s": import_s}
if spec["warm_up_only"]:
    print(json.dumps(out))
    raise SystemExit
import numba
avx512f = "+avx512f" in (numba.config.CPU_FEATURES or "+avx512f")
out["build"] = f"numba {numba.config.CPU_NAME or 'host'}, avx512f {avx512f}"
steps = ("ids", "prefill_short", "prefill_long", "turn_cached", "turn")
ids, short, long, cached, turn = (spec[k] for k in steps)
# What a prefill runs (passes of several rows; a mixture's experts each by the rows routed to it) compiles
# on its first use, once per machine: a first start's cost (first_start_s), not a prefill's. A fresh
# cache (a single round) timed it in prefill_short: a 30B-A3B's 26 tok/s where 240 are the steady figure.
warm_up = model.new_sequence(short + 1)
model.forward(ids[:short], warm_up)
warm_up.free()

def timed(tokens, seq):
    t = time.perf_counter()
    logits = model.forward(tokens, seq)[-1]
    return time.perf_counter() - t, logits

seq = model.new_sequence(short + 1)
out["prefill_short"] = short / timed(ids[:short], seq)[0]
seq.free()
seq = model.new_sequence(max(cached + turn, long + spec["decode_tokens"]) + 1)
elapsed, logits = timed(ids[:long], seq)
out["prefill_long"] = long / elapsed
decoding = seq.fork()  # decode at context `long`, then the turn continues the prompt itself
t = time.perf_counter()
for _ in range(spec["decode_tokens"]):
    logits = model.forward([int(np.argmax(logits))], decoding)[-1]
out["decode"] = spec["decode_tokens"] / (time.perf_counter() - t)
decoding.free()
if cached:
    model.forward(ids[long:cached], seq)
    best = float("inf")
    for _ in range(spec["turn_repeats"]):
        fork = seq.fork()
        best = min(best, timed(ids[cached:cached + turn], fork)[0])
        fork.free()
    out["turn_ms"] = best * 1000
seq.free()
if spec["lookup_tokens"]:
    from llama_chat.app.bench.forward import measure_lookup
    from llama_chat.app.bench.samples import CODE_EDIT
    from llama_chat.inference import chat_prompt_ids
    lookup = measure_lookup(model, spec["lookup_tokens"])
    out.update(lookup=lookup["lookup_tok_s"], lookup_same_as_plain=lookup["same_text"],
               code_ids=lookup["token_ids"], code_prompt=chat_prompt_ids(model, CODE_EDIT),
               end_ids=sorted(model.tokenizer.end_of_generation_ids))
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""

LLAMACPP_CHILD = """
import json, resource, sys, time
import numpy as np
spec = json.loads(sys.argv[1])
t = time.perf_counter()
import llama_cpp
from llama_cpp import Llama
import_s = time.perf_counter() - t
t = time.perf_counter()
llm = Llama(
    model_path=spec["path"], n_ctx=4096, n_batch=512, n_threads=spec["threads"], use_mmap=spec["use_mmap"],
    verbose=False,
)
llm.eval(spec["ids"][:1])  # touches every mapped weight page, as llama-server's warm-up does
llm.reset()
out = {"load_s": time.perf_counter() - t, "import_s": import_s}
if spec["warm_up_only"]:
    print(json.dumps(out))
    raise SystemExit
features = [p.strip() for p in llama_cpp.llama_print_system_info().decode().split("|")]
out["build"] = "llama.cpp " + " ".join(
    p for p in features if p.startswith(("AVX", "CPU")) and p.endswith("= 1")
)
steps = ("ids", "prefill_short", "prefill_long", "turn_cached", "turn")
ids, short, long, cached, turn = (spec[k] for k in steps)
llm.eval(ids[:short])  # as the other child warms up: the same prefill before the timed ones
llm.reset()

def last_logits():
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

def timed(tokens):
    t = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - t

out["prefill_short"] = short / timed(ids[:short])
llm.reset()
out["prefill_long"] = long / timed(ids[:long])
t = time.perf_counter()
for _ in range(spec["decode_tokens"]):
    llm.eval([int(np.argmax(last_logits()))])
out["decode"] = spec["decode_tokens"] / (time.perf_counter() - t)
if cached:
    llm.n_tokens = long  # eval drops the KV from n_tokens on: back to the prompt
    llm.eval(ids[long:cached])
    best = float("inf")
    for _ in range(spec["turn_repeats"]):
        llm.n_tokens = cached
        best = min(best, timed(ids[cached:cached + turn]))
    out["turn_ms"] = best * 1000
if spec["lookup_tokens"]:  # the code edit, greedy: plain decode as llama.cpp runs it
    llm.reset()
    llm.eval(spec["code_prompt"])
    code, end_ids = [], set(spec["end_ids"])
    t = time.perf_counter()
    for _ in range(spec["lookup_tokens"]):
        token = int(np.argmax(last_logits()))
        if token in end_ids:
            break
        code.append(token)
        llm.eval([token])
    out.update(code_decode=len(code) / (time.perf_counter() - t), code_ids=code)
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""

# What each engine reports, and whether more (True) or less (False) is better.
MEASURES = {
    "load_s": False,
    "import_s": False,
    "prefill_short": True,
    "prefill_long": True,
    "decode": True,
    "turn_ms": False,
    "peak_rss_mb": False,
    "lookup": True,
    "code_decode": True,
}


def run_child(python: str, code: str, spec: dict, env: dict | None = None) -> dict:
    """One engine's run in a process of its own: its RSS is its own, and llama.cpp's worker threads,
    which spin after each call, cannot take the cores from ours."""
    done = subprocess.run([python, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{python}: the benchmark child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def has_llama_cpp(python: str) -> bool:
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def keep_best(best: dict, result: dict) -> None:
    for key, more_is_better in MEASURES.items():
        if key in result:
            pick = max if more_is_better else min
            best[key] = pick(best[key], result[key]) if key in best else result[key]
    best.update({k: v for k, v in result.items() if k not in MEASURES})


def ratios(ours: dict, theirs: dict) -> dict:
    """ours / theirs for each measure both have; for the lookup, our lookup over their plain decode."""
    out = {}
    for key, name in (
        ("prefill_short", "prefill_32_ratio"),
        ("prefill_long", "prefill_512_ratio"),
        ("decode", "decode_ratio"),
        ("turn_ms", "turn_ratio"),
        ("load_s", "load_ratio"),
        ("peak_rss_mb", "rss_ratio"),
    ):
        if key in ours and key in theirs:
            out[name] = round(ours[key] / theirs[key], 2)
    if "lookup" in ours and "code_decode" in theirs:
        out["lookup_vs_llamacpp_decode"] = round(ours["lookup"] / theirs["code_decode"], 2)
        a, b = ours["code_ids"], theirs["code_ids"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["lookup_tokens_equal_to_llamacpp"] = f"{same}/{len(b)}"
    return out


def rounded(result: dict) -> dict:
    return {
        k: round(v, 3) if isinstance(v, float) else v
        for k, v in result.items()
        if k not in ("code_ids", "code_prompt", "end_ids")
    }


def make_spec(
    path: str,
    threads: int,
    prefill_long: int = PREFILL_LONG,
    turn_cached: int = TURN_CACHED,
    decode_tokens: int = 16,
    lookup_tokens: int = 160,
    activations: str = DEFAULT_ACTIVATIONS,
    use_mmap: bool = True,
) -> dict:
    """What both children measure (JSON in their argv): the model, its sample tokens and the sizes, and
    whether both map the weights (else read into memory: llama-chat's --no-mmap, llama.cpp's)."""
    return {
        "path": path,
        "threads": threads,
        "ids": sample_tokens(load_tokenizer(path), max(turn_cached, prefill_long) + TURN),
        "prefill_short": PREFILL_SHORT,
        "prefill_long": prefill_long,
        "turn_cached": turn_cached,
        "turn": TURN,
        "turn_repeats": TURN_REPEATS,
        "decode_tokens": decode_tokens,
        "lookup_tokens": lookup_tokens,
        "activations": activations,
        "use_mmap": use_mmap,
        "warm_up_only": False,
    }


def compare(spec: dict, profiles: dict[str, str], rounds: int) -> dict:
    """Both engines on the spec's model for each ISA of `profiles` (ISA → a Python with llama-cpp-python;
    llama-chat's column only where it has none): a first start each, then `rounds` alternating rounds,
    the best of each measure kept. Returns {isa: {"ours": …, "llamacpp": …, ratios…}} and each ISA's
    "<isa>_ours_first_start_s"."""
    result: dict = {}
    theirs_python = {isa: py for isa, py in profiles.items() if has_llama_cpp(py)}
    for isa, py in profiles.items():
        if isa not in theirs_python:
            print(f"{isa}: no llama-cpp-python in {py}: llama-chat's column only", file=sys.stderr)
    # A first start of each: prepares the model, compiles the ISA's kernels, reads the file into the page
    # cache, so that the rounds time warm starts.
    for isa in profiles:
        first = run_child(sys.executable, OURS_CHILD, {**spec, "warm_up_only": True}, our_env(isa))
        result[f"{isa}_ours_first_start_s"] = round(first["load_s"], 2)
        if isa in theirs_python:
            run_child(theirs_python[isa], LLAMACPP_CHILD, {**spec, "warm_up_only": True})
    best = {isa: ({}, {}) for isa in profiles}
    # Alternate engines and ISAs so that a busy moment of this shared machine hurts all alike.
    for _ in range(rounds):
        for isa in profiles:
            ours = run_child(sys.executable, OURS_CHILD, spec, our_env(isa))
            print(
                json.dumps({"isa": isa, "engine": "llama-chat", **rounded(ours)}), file=sys.stderr, flush=True
            )
            keep_best(best[isa][0], ours)
            if isa in theirs_python:
                code = {k: ours[k] for k in ("code_prompt", "end_ids") if k in ours}
                theirs = run_child(
                    theirs_python[isa],
                    LLAMACPP_CHILD,
                    {**spec, **code, "lookup_tokens": spec["lookup_tokens"] if code else 0},
                )
                print(
                    json.dumps({"isa": isa, "engine": "llama.cpp", **rounded(theirs)}),
                    file=sys.stderr,
                    flush=True,
                )
                keep_best(best[isa][1], theirs)
    for isa, (ours, theirs) in best.items():
        result[isa] = {"ours": rounded(ours), "llamacpp": rounded(theirs), **ratios(ours, theirs)}
    return result


def print_table(isa: str, measured: dict) -> None:
    """One ISA's entry of compare(): both engines' measures side by side, then the ratios."""
    ours, theirs = measured["ours"], measured["llamacpp"]
    print(f"-- {isa}: {ours.get('build')} | {theirs.get('build', 'no llama.cpp')}")
    print(f"{'':22}{'llama-chat':>12}{'llama.cpp':>12}")
    for key in MEASURES:
        if key in ours or key in theirs:
            cells = [f"{side[key]:12.2f}" if key in side else f"{'–':>12}" for side in (ours, theirs)]
            print(f"{key:22}{''.join(cells)}")
    for key, value in measured.items():
        if key not in ("ours", "llamacpp"):
            print(f"{key:22}{value:>12}")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The options that say what compare() runs: the model, the threads, the rounds, llama.cpp per ISA,
    the sizes and llama-chat's activations (roofline.py takes them too)."""
    parser.add_argument(
        "--model", default=None, help="a model name or a GGUF file (default: the default model)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is kept")
    parser.add_argument(
        "--llamacpp",
        action="append",
        metavar="ISA=PYTHON",
        default=[],
        help=f"an ISA ({', '.join(ISAS)}) and a Python with llama-cpp-python built for it (repeatable)",
    )
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument(
        "--prefill-long", type=int, default=PREFILL_LONG, help="the long prefill, and decode's context"
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=DEFAULT_ACTIVATIONS,
        help="what llama-chat's products take their inputs as (default %(default)s; q8: bytes, as "
        "llama.cpp's; f32: exactly)",
    )
    parser.add_argument(
        "--no-mmap",
        action="store_true",
        help="both engines read the weights into memory instead of mapping them (llama-chat's --no-mmap, "
        "llama.cpp's use_mmap=False)",
    )


def engine_profiles(parser: argparse.ArgumentParser, args) -> dict[str, str]:
    """ISA → the Python whose llama-cpp-python runs it, from --llamacpp (native, this one, without)."""
    profiles = dict(item.split("=", 1) for item in args.llamacpp) or {"native": sys.executable}
    for isa in profiles:
        if isa not in ISAS:
            parser.error(f"unknown ISA '{isa}' (known: {', '.join(ISAS)})")
    return profiles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_options(parser)
    parser.add_argument(
        "--turn-cached",
        type=int,
        default=TURN_CACHED,
        help="cached tokens before the timed turn (0: no turn; a 7B's 1,024 take minutes on 2 cores)",
    )
    parser.add_argument(
        "--lookup-tokens", type=int, default=160, help="the code edit's length (0: no code edit)"
    )
    parser.add_argument(
        "--full", action="store_true", help="also run the whole `llama-chat bench --json` (native)"
    )
    args = parser.parse_args()
    profiles = engine_profiles(parser, args)
    path = str(resolve_model(args.model))
    result: dict = {
        "model": path,
        "cpu": cpu_name(),
        "threads": args.threads,
        "activations": args.activations,
        "use_mmap": not args.no_mmap,
    }
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
    spec = make_spec(
        path, args.threads, args.prefill_long, args.turn_cached, args.decode_tokens, args.lookup_tokens,
        args.activations, not args.no_mmap,
    )
    result |= {"prefill_long": args.prefill_long, "decode_tokens": args.decode_tokens}
    result |= compare(spec, profiles, args.rounds)
    for isa in profiles:
        print_table(isa, result[isa])
    for isa in profiles:
        result[f"turn_ratio_{isa}"] = result[isa].get("turn_ratio")
    result["turn_ratio"] = result[next(iter(profiles))].get("turn_ratio")  # the first ISA asked
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
