"""llama-chat's activation modes against each other: which is fastest, on this machine, for each ISA.

    python benchmarks/modes.py [--model NAME|PATH] [--modes q8,mixed] [--isa native --isa avx2] [--rounds 2]

The same child as compare_llamacpp.py's (a fresh process for each run: a 32- and a 512-token prefill,
decode at 512, the 64-token turn after 1,024 cached tokens, prompt lookup on the code edit), for each
mode and ISA in turn, after a first start of each; the best of each measure over alternating rounds.
The default mode is the fastest whose fidelity holds (tests/test_real_models.py checks it): this is how
"fastest" is measured. A 7B's turn and code edit take minutes on 2 cores: --turn-cached 0 --lookup-tokens 0.
"""

from __future__ import annotations

import argparse
import json
import sys

from compare_llamacpp import OURS_CHILD, keep_best, make_spec, rounded, run_child
from isa import ISAS, cpu_name, our_env

from llama_chat.inference import resolve_model
from llama_chat.inference.activation_modes import ACTIVATIONS

SHOWN = ("prefill_short", "prefill_long", "decode", "turn_ms", "lookup")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model name or a GGUF file (default: the default model)"
    )
    parser.add_argument("--modes", default="q8,mixed", help="comma-separated (default %(default)s)")
    parser.add_argument("--isa", action="append", choices=ISAS, help="repeatable (default: native)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turn-cached", type=int, default=1024)
    parser.add_argument("--lookup-tokens", type=int, default=160)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in ACTIVATIONS]:
        parser.error(f"unknown mode {unknown[0]!r} (known: {', '.join(ACTIVATIONS)})")
    path = str(resolve_model(args.model))
    spec = make_spec(path, args.threads, turn_cached=args.turn_cached, lookup_tokens=args.lookup_tokens)
    runs = [(isa, mode) for isa in args.isa or ["native"] for mode in modes]
    for isa, mode in runs:  # a first start each: compiles, packs, reads the file into the page cache
        run_child(
            sys.executable, OURS_CHILD, {**spec, "activations": mode, "warm_up_only": True}, our_env(isa)
        )
    best: dict = {run: {} for run in runs}
    for _ in range(args.rounds):
        for isa, mode in runs:
            out = run_child(sys.executable, OURS_CHILD, {**spec, "activations": mode}, our_env(isa))
            print(json.dumps({"isa": isa, "mode": mode, **rounded(out)}), file=sys.stderr, flush=True)
            keep_best(best[isa, mode], out)
    print(f"{path}, {cpu_name()}, {args.threads} threads, best of {args.rounds}")
    print(f"{'isa':8}{'mode':7}" + "".join(f"{k:>15}" for k in SHOWN))
    for (isa, mode), figures in best.items():
        print(
            f"{isa:8}{mode:7}"
            + "".join(f"{round(figures[k], 1) if k in figures else '-':>15}" for k in SHOWN)
        )
    print(json.dumps({f"{isa}_{mode}": rounded(figures) for (isa, mode), figures in best.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
