"""A first prompt after the machine started: the GGUF's embedding table not yet in the page cache, its
rows read ahead at the start (gguf_tensors.read_ahead) or each read from the disk as the prompt needs it.

    python benchmarks/cold_prompt.py --model PATH [--tokens 32] [--rounds 3] [--all]

Each round runs both ways in turn, each in a process of its own: the GGUF dropped from the page cache
(posix_fadvise DONTNEED; --all: every packed file too, as figures.py's runs start), then `load_model`,
one token (as compare_llamacpp.py warms up), and a timed forward of --tokens tokens of text. The table is
read from the GGUF only where it is not the output matrix (the default model's is in its packed file:
nothing to measure there). Prints each process's figures and JSON on the last line: the best of each way.
Linux only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

TEXT = (
    "Write a Python function that reads a CSV file of orders, groups them by customer, and prints each"
    " customer's total, the largest order and the date of the last one, sorted by total."
)


def drop_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(path: str, tokens: int, read_ahead: bool, everything: bool) -> dict:
    from llama_chat.inference import catalog, gguf_tensors

    packed = glob.glob(str(catalog.cache_dir() / "prepared" / "*.packed")) if everything else []
    drop_from_page_cache([path, *packed])
    if not read_ahead:
        gguf_tensors.read_ahead = lambda *_: None  # the start as it was before it read ahead
    t = time.perf_counter()
    from llama_chat.inference import load_model

    model = load_model(path)
    load_s = time.perf_counter() - t
    ids = model.tokenizer.encode(TEXT)[:tokens]
    warm_up = model.new_sequence(2)
    model.forward(ids[:1], warm_up)
    warm_up.free()
    seq = model.new_sequence(len(ids) + 1)
    t = time.perf_counter()
    model.forward(ids, seq)
    tok_s = len(ids) / (time.perf_counter() - t)
    return {"load_s": round(load_s, 3), "prompt_tokens": len(ids), "tok_s": round(tok_s, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF whose embedding table is its own")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--all", action="store_true", help="drop every packed file from the page cache too")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.tokens, args.child == "on", args.all)))
        return 0
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for way in ("on", "off"):
            command = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens)]
            command += ["--child", way] + (["--all"] if args.all else [])
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr.strip().splitlines()[-1], file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            load_s, tokens, tok_s = result["load_s"], result["prompt_tokens"], result["tok_s"]
            print(f"read ahead {way:3}: load {load_s} s, {tokens} tokens at {tok_s} tok/s", flush=True)
            if result["tok_s"] > best.get(way, {}).get("tok_s", 0):
                best[way] = result
    print(json.dumps({"model": args.model, "read_ahead": best["on"], "without": best["off"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
