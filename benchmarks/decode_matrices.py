"""Where a decoded token's time goes, matrix by matrix: each kind of matrix's share of a token, and the
rate it reads its bytes at, against the machine's read bandwidth.

    python benchmarks/decode_matrices.py [--model PATH] [--tokens 12] [--activations f32|q8] [--context N]
        [--no-mmap] [--json]

Every product of a decode (kernels.matmul, and a mixture's experts all in one call:
expert_products.grouped_product) is timed by the wall clock and by the process's CPU time (all
threads): on a machine shared with other work the CPU time says what the product costs when it has
the cores. Each kind's figure is its best token of --tokens (a busy machine only makes one slower).
A mixture's experts count the bytes of the k a token chooses. `GB/s` is the kind's bytes over its
wall time, `cpu GB/s` over its CPU time divided by the threads. The rest of the token (norms,
attention, sampling) is `other`; --context N decodes after a prompt of N tokens (attention's share).
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np

KINDS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down", "output")


def matrix_kinds(weights, n_expert_used: int) -> dict[int, tuple[str, int]]:
    """id of each matrix the forward pass multiplies → (its kind, the bytes a token reads of it): of a
    mixture's experts, each expert's share of the k a token chooses."""
    kinds = {id(weights.output): ("output", weights.output.nbytes)}
    for layer in weights.layers:
        for kind in KINDS[:-1]:
            w = getattr(layer, kind)
            if w is not None:
                kinds[id(w)] = (kind, w.nbytes)
        experts = layer.experts
        if experts is not None:
            kinds[id(experts.router)] = ("ffn_gate_inp", experts.router.nbytes)
            grouped = experts.grouped or (None, None)  # (all experts in one call: expert_products.py)
            for kind, matrices, together in (
                ("expert_gate_up", experts.gate_up, grouped[0]), ("expert_down", experts.down, grouped[1])
            ):
                for w in matrices:
                    kinds[id(w)] = (kind, w.nbytes * n_expert_used // len(matrices))
                if together is not None:
                    kinds[id(together)] = (kind, 0)  # (its bytes counted above)
    return kinds


def measure(path: str, tokens: int, activations: str, context: int = 0, use_mmap: bool = True) -> dict:
    from llama_chat.inference import expert_products, kernels, load_model

    model = load_model(path, activations=activations, use_mmap=use_mmap)
    kinds = matrix_kinds(model.weights, model.config.n_expert_used)
    token_totals: dict[str, list[float]] = {}
    depth = [0]
    multiply = kernels.matmul

    grouped_product = expert_products.grouped_product

    def timed_matmul(x, w, *plan, product=multiply):
        if depth[0]:  # a StackedMatrix's parts: timed with the whole
            return product(x, *plan, w)
        depth[0] += 1
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return product(x, *plan, w)
        finally:
            depth[0] -= 1
            kind = kinds.get(id(w), ("unnamed", 0))[0]
            spent = token_totals.setdefault(kind, [0.0, 0.0])
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu

    ids = model.tokenizer.encode("The history of the printing press begins in")
    ids = (ids * (context // len(ids) + 1))[: max(context, len(ids))]
    seq = model.new_sequence(len(ids) + tokens + 2)
    logits = model.forward(ids, seq)[-1]
    kernels.matmul = timed_matmul
    expert_products.grouped_product = lambda x, plan, w: timed_matmul(x, w, plan, product=grouped_product)
    best: dict[str, list[float]] = {}
    token_walls = []
    try:
        for _ in range(tokens):
            token_totals.clear()
            wall = time.perf_counter()
            logits = model.forward([int(np.argmax(logits))], seq)[-1]
            token_walls.append(time.perf_counter() - wall)
            token_totals["other"] = [token_walls[-1] - sum(w for w, _ in token_totals.values()), 0.0]
            for kind, (w, c) in token_totals.items():
                kept = best.setdefault(kind, [float("inf"), float("inf")])
                kept[0], kept[1] = min(kept[0], w), min(kept[1], c)
    finally:
        kernels.matmul, expert_products.grouped_product = multiply, grouped_product
    threads = numba.config.NUMBA_NUM_THREADS
    per_kind_bytes: dict[str, int] = {}
    for kind, nbytes in kinds.values():
        per_kind_bytes[kind] = per_kind_bytes.get(kind, 0) + nbytes
    table = {}
    for kind, (w, c) in best.items():
        nbytes = per_kind_bytes.get(kind, 0)
        row = {"ms": round(w * 1000, 2), "cpu_ms": round(c * 1000, 2), "mb": round(nbytes / 1e6, 1)}
        if nbytes:
            row["gb_s"] = round(nbytes / w / 1e9, 1)
            row["cpu_gb_s"] = round(nbytes / (c / threads) / 1e9, 1) if c > 0 else None
        table[kind] = row
    total = sum(per_kind_bytes.values())
    return {
        "model": str(path),
        "activations": activations,
        "threads": threads,
        "token_ms_best": round(min(token_walls) * 1000, 1),
        "tok_s_best": round(1 / min(token_walls), 2),
        "matrix_gb": round(total / 1e9, 3),
        "matrices_gb_s": round(total / sum(best[k][0] for k in best if k != "other") / 1e9, 1),
        "kinds": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF path (default: the default model)")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--activations", choices=("f32", "q8", "mixed"), default="f32")
    parser.add_argument("--context", type=int, default=0, help="tokens before the decoded ones (as a prompt)")
    parser.add_argument("--no-mmap", action="store_true", help="the weights read into memory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.model, args.tokens, args.activations, args.context, not args.no_mmap)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']} ({result['activations']}, {result['threads']} threads): best token "
          f"{result['token_ms_best']} ms ({result['tok_s_best']} tok/s), matrices {result['matrix_gb']} GB "
          f"at {result['matrices_gb_s']} GB/s")
    print(f"{'kind':12}{'ms':>9}{'cpu ms':>9}{'MB':>9}{'GB/s':>8}{'cpu GB/s':>10}")
    for kind, row in result["kinds"].items():
        print(f"{kind:12}{row['ms']:9.2f}{row['cpu_ms']:9.2f}{row['mb']:9.1f}"
              f"{row.get('gb_s') or 0:8.1f}{row.get('cpu_gb_s') or 0:10.1f}")


if __name__ == "__main__":
    main()
