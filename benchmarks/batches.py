"""The batch figures of `llama-chat bench` on their own: eight conversations replying at once against
one (`eight_jobs_aggregate_decode`) and decode at context 4,096 against 512 (`decode_ctx4096_vs_512`),
with where the time of a decode step goes (matrices, attention, KV writes, norms, RoPE, sampling, the
rest: Python per step and per sequence), and a change against its base checkout, run in turn.

    python benchmarks/batches.py                       # this checkout: figures, rounds 3
    python benchmarks/batches.py --parts               # and the parts of a step (1, 8 at 512; 1 at 4,096)
    python benchmarks/batches.py --against /work/main  # this checkout and that one's, alternating

On a shared machine a figure moves with whatever else runs: --against runs one round of each checkout
after the other, in fresh processes, and prints each one's best and spread. JSON on the last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llama_chat.inference.activation_modes import DEFAULT_ACTIVATIONS


def figures(model, rounds: int) -> dict[str, list[float]]:
    """Each round: the two ratios as `bench` measures them (same functions, same sizes), and the decode
    speeds of the second."""
    from llama_chat.app.bench.forward import measure_decode_contexts, measure_jobs_at_once

    out: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        at_once = measure_jobs_at_once(model, 512, 32, counts=(8,))
        out["eight_jobs_aggregate_decode"].append(round(8 / at_once[8], 3))
        short, long = measure_decode_contexts(model, (512, 4096), 24)
        out["decode_ctx4096_vs_512"].append(round(long / short, 3))
        out["decode_tok_s_ctx512"].append(round(short, 2))
        out["decode_tok_s_ctx4096"].append(round(long, 2))
    return out


def step_parts(model, n_seqs: int, context: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step of n_seqs sequences forked from one context, each with a token of
    its own, by part: the forward pass's functions timed where they are called, the rest as `other`."""
    from llama_chat.app.bench.samples import sample_tokens
    from llama_chat.inference import forward, kv_cache

    spent: collections.Counter = collections.Counter()
    timed = [
        (forward, "linear", "matrices"),
        (forward, "attend", "attention"),
        (forward, "one_token_attentions", "attention"),
        (kv_cache.KVSequence, "write", "kv_write"),
        (forward, "rope", "rope"),
        (forward, "rms_norm", "norm"),
    ]
    # (what a checkout has: a base without one_token_attentions times its rows in attend)
    originals = [
        (owner, name, part, getattr(owner, name)) for owner, name, part in timed if hasattr(owner, name)
    ]

    def timing(f, part):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t

        return call

    for owner, name, part, f in originals:
        setattr(owner, name, timing(f, part))
    ids = sample_tokens(model.tokenizer, context)
    base = model.new_sequence(context + steps + 2)
    model.forward(ids[:-1], base)
    seqs = [base.fork() for _ in range(n_seqs)]
    tokens = [ids[-1] + i for i in range(n_seqs)]
    try:
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            rows = model.verify_rows([(s, [t]) for s, t in zip(seqs, tokens, strict=True)])
            t = time.perf_counter()
            for seq, token in zip(seqs, tokens, strict=True):
                seq.commit([token])
            tokens = [int(np.argmax(r[0])) for r in rows]
            spent["sampling"] += time.perf_counter() - t
        total = time.perf_counter() - t0
    finally:
        for owner, name, _, f in originals:
            setattr(owner, name, f)
        for seq in [*seqs, base]:
            seq.free()
    parts = {part: round(1000 * s / steps, 2) for part, s in spent.items()}
    parts["other"] = round(1000 * total / steps - sum(parts.values()), 2)
    parts["total"] = round(1000 * total / steps, 2)
    return parts


def summary(values: list[float]) -> dict:
    return {"best": max(values), "median": statistics.median(values), "spread": [min(values), max(values)]}


def alternate(other: Path, rounds: int) -> dict:
    """One round of this checkout's figures, then one of `other`'s (its .venv's python running this
    file), `rounds` times; each process loads the model anew."""
    pythons = {"this": sys.executable, "other": str(other / ".venv" / "bin" / "python")}
    runs: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in pythons}
    for i in range(rounds):
        for name, python in pythons.items():
            done = subprocess.run(
                [python, __file__, "--rounds", "1", "--json"], capture_output=True, text=True, check=True
            )
            for key, values in json.loads(done.stdout.strip().splitlines()[-1])["rounds"].items():
                runs[name][key] += values
            print(f"round {i + 1} {name}: {dict(runs[name])}", file=sys.stderr, flush=True)
    return {name: {key: summary(v) for key, v in found.items()} for name, found in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="time the parts of a decode step")
    parser.add_argument("--against", type=Path, help="another checkout, run in turn with this one")
    parser.add_argument("--activations", default=DEFAULT_ACTIVATIONS)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args()
    if args.against:
        result = {"against": str(args.against), **alternate(args.against, args.rounds)}
        print(json.dumps(result))
        return 0
    from llama_chat.inference import load_model
    from llama_chat.inference.cpu import PROFILE

    model = load_model(None, activations=args.activations)
    result: dict = {"kernel_profile": PROFILE.key, "activations": args.activations}
    if args.parts:
        result["parts_ms"] = {
            f"{n} at {ctx}": step_parts(model, n, ctx, 16) for n, ctx in ((1, 512), (8, 512), (1, 4096))
        }
        if not args.json:
            for name, parts in result["parts_ms"].items():
                print(f"{name:>10}: " + "  ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    rounds = figures(model, args.rounds)
    result["rounds"] = rounds
    result.update({key: summary(values) for key, values in rounds.items()})
    if not args.json:
        for key, values in rounds.items():
            print(f"{key}: best {max(values)}, all {values}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
