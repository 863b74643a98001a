"""How far replies from a resumed KV cache lie from the live cache's, for every KV codec (not CI).

    .venv/bin/python benchmarks/kv_quality.py [--tokens N] [--models NAME ...] [--codecs C ...] \\
        [--texts T ...]

For each model and each text below (code, prose, chat turns, JSON, one of ~2,000 tokens): the text
is run on a live float cache, then N tokens are decoded greedily from it. Its KV (all but the last
token) is put through each codec, 64-token blocks and the tail as KVStore stores them, and decoded
into a fresh sequence. Both caches are then fed the same tokens (the last one of the text and the
live greedy reply) in one pass; at each of the N positions the KL divergence of the resumed next-token
distribution from the live one and whether their best tokens agree are recorded. Agreeing at all N
positions is the same as the resumed cache's own greedy continuation being the live one, token for
token: that is `greedy_identical`. Bytes per token are the stored blocks' bytes over the text's tokens.

The last line printed is one JSON object: for each codec `bytes_per_token` (the default model's,
first of --models; every model's under `bytes_per_token_by_model`), `greedy_identical` ("N/M"
continuations over every model's texts), worst `kl` over every position and `mean_kl`, and
`worst_flipped_margin`: where a resumed cache's best token was not the live one's, the largest gap in
log-probability between the two that the live cache had (a codec that only flips near-ties has a
small one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from llama_chat.app.bench.samples import SAMPLE_TEXT, sample_text
from llama_chat.inference import chat_prompt_ids, load_model
from llama_chat.storage.codec import CODECS, PLANNED_CODECS, KVPlan, decode_kv, encode_kv
from llama_chat.storage.kv_plan import allocate, estimates, model_plan, plan_of, plan_path

MODELS = ("qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")
LONG_TOKENS = 2000

JSON_RECORDS = json.dumps(
    {
        "status": "ok",
        "page": 2,
        "results": [
            {
                "id": 48213,
                "name": "Harbour Lights Ltd",
                "email": "accounts@harbourlights.example",
                "created": "2024-03-18T09:41:07Z",
                "tags": ["wholesale", "priority"],
                "balance": {"currency": "EUR", "amount": 1289.5},
                "active": True,
            },
            {
                "id": 48214,
                "name": "Okonkwo & Daughters",
                "email": None,
                "created": "2024-03-19T15:02:44Z",
                "tags": [],
                "balance": {"currency": "NGN", "amount": 0},
                "active": False,
            },
        ],
        "next": "/v2/customers?page=3&per_page=2",
    },
    indent=2,
)

JSON_CONFIG = """{
  "name": "lighthouse-dashboard",
  "version": "3.4.1",
  "private": true,
  "scripts": {
    "dev": "vite --port 5173",
    "build": "tsc -b && vite build",
    "test": "vitest run --coverage",
    "lint": "eslint . --max-warnings 0"
  },
  "dependencies": {
    "react": "^18.3.1",
    "react-dom": "^18.3.1",
    "zod": "^3.23.8"
  },
  "devDependencies": {
    "typescript": "~5.5.4",
    "vite": "^5.4.2",
    "vitest": "^2.0.5"
  },
  "engines": {"node": ">=20"},
  "browserslist": ["last 2 versions", "not dead"]
}"""

JAVASCRIPT = """// Debounce a function: call it once the calls have stopped for `wait` milliseconds.
export function debounce(fn, wait = 200) {
  let timer = null;
  return function debounced(...args) {
    clearTimeout(timer);
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, wait);
  };
}

export async function fetchJson(url, { retries = 3, signal } = {}) {
  for (let attempt = 1; ; attempt++) {
    try {
      const response = await fetch(url, { signal });
      if (!response.ok) throw new Error(`HTTP ${response.status} for ${url}`);
      return await response.json();
    } catch (err) {
      if (attempt >= retries || signal?.aborted) throw err;
      await new Promise((resolve) => setTimeout(resolve, 250 * 2 ** attempt));
    }
  }
}
"""

CHAT_TRIP = [
    {"role": "system", "content": "You are a helpful travel assistant. Answer briefly."},
    {"role": "user", "content": "I have three days in Lisbon in November. What should I not miss?"},
    {
        "role": "assistant",
        "content": "Day one: Alfama and the castle, then fado in the evening. Day two: Belém (the tower, "
        "the monastery and the custard tarts). Day three: a train to Sintra for the palaces.",
    },
    {"role": "user", "content": "Is it going to rain a lot? And do I need to book Sintra in advance?"},
]

CHAT_CODE = [
    {
        "role": "user",
        "content": "Why does this print 3 three times?\n\n"
        "fns = [lambda: i for i in range(3)]\nprint([f() for f in fns])",
    },
    {
        "role": "assistant",
        "content": "Each lambda looks `i` up when it is called, not when it is made; by then the loop has "
        "finished and `i` is 2, so you get [2, 2, 2].",
    },
    {"role": "user", "content": "Right, [2, 2, 2]. How do I make each one keep its own value?"},
]


def module_text(name: str, chars: int) -> str:
    """The start of a standard-library module's source: real code, comments and docstrings."""
    import importlib

    with open(importlib.import_module(name).__file__, encoding="utf-8") as f:
        return f.read()[:chars]


def topic_text(name: str, chars: int) -> str:
    """Prose: a page of Python's reference documentation (pydoc's topics)."""
    from pydoc_data.topics import topics

    return topics[name][:chars]


def texts(model) -> list[tuple[str, list[int]]]:
    """(name, token ids) of every text, for this model's tokenizer and chat template."""
    tok = model.tokenizer

    def plain(text: str) -> list[int]:
        return tok.encode(text, add_bos=tok.add_bos)

    long_ids = plain(sample_text()[: LONG_TOKENS * 6])[:LONG_TOKENS]
    return [
        ("code:heapq", plain(module_text("heapq", 1200))),
        ("code:json.encoder", plain(module_text("json.encoder", 1500)[400:])),
        ("code:javascript", plain(JAVASCRIPT)),
        ("prose:story", plain(SAMPLE_TEXT)),
        ("prose:exceptions", plain(topic_text("exceptions", 1200))),
        ("prose:execmodel", plain(topic_text("execmodel", 1200))),
        ("chat:trip", chat_prompt_ids(model, CHAT_TRIP)),
        ("chat:code", chat_prompt_ids(model, CHAT_CODE)),
        ("json:records", plain(JSON_RECORDS)),
        ("json:config", plain(JSON_CONFIG)),
        ("long:argparse", long_ids),
    ]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def greedy(model, seq, first: int, n: int) -> list[int]:
    """n tokens decoded greedily, one at a time, after `first` (fed, not returned)."""
    out = []
    token = first
    for _ in range(n):
        token = int(np.argmax(model.forward([token], seq)[-1]))
        out.append(token)
    return out


def codec_and_plan(model, name: str) -> tuple[str, KVPlan | None]:
    """A codec named on the command line, and its plan: a planned codec's is the model's (kv_plan.py);
    `auto-h@4` gives every head 4 bits (any of PLAN_BITS), `auto-h@1e-4` the plan allocated at that KL
    budget from the per-head KLs measured for the model's plan (without its final check)."""
    codec, _, at = name.partition("@")
    if codec not in PLANNED_CODECS:
        return codec, None
    plan = model_plan(model, codec=codec)
    if not at:
        return codec, plan
    if at.isdigit():
        return codec, KVPlan.uniform(*plan.shape, int(at))
    report = json.loads(plan_path(model.fingerprint, codec).read_text())
    measured = {
        (unit[0] == "k", *map(int, unit[1:].split("."))): {int(b): kl for b, kl in by_bits.items()}
        for unit, by_bits in report["unit_kl"].items()
    }
    return codec, plan_of(allocate(estimates(measured), float(at)), *plan.shape)


def stored(
    k: np.ndarray, v: np.ndarray, codec: str, block: int, plan
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """The cache [L, H, T, D] through a codec as KVStore stores it (full blocks, then the tail as one
    piece): the decoded pieces and their bytes."""
    pieces, n_bytes = [], 0
    for start in range(0, k.shape[2], block):
        data = encode_kv(k[:, :, start : start + block], v[:, :, start : start + block], codec, plan)
        n_bytes += len(data)
        pieces.append(decode_kv(data))
    return pieces, n_bytes


def measure_text(model, ids: list[int], n: int, codecs: dict) -> dict:
    """For one text: per codec (name -> (codec, plan)), KL and top-1 agreement at each of n positions,
    and stored bytes."""
    context, last = ids[:-1], ids[-1]
    live = model.new_sequence(len(ids) + n + 1)
    try:
        model.forward(context, live)
        reply = greedy(model, live, last, n)
        k, v = live.gather(0, len(context))
        fed = [last, *reply[:-1]]
        live.truncate(len(context))
        reference = log_softmax(model.forward(fed, live, all_logits=True))
    finally:
        live.free()
    best = reference.argmax(axis=-1)
    out = {}
    for codec, (stored_as, plan) in codecs.items():
        pieces, n_bytes = stored(k, v, stored_as, model.pool.block_size, plan)
        # private: keep the decoded KV (sharing by prefix key would hand back the live blocks)
        seq = model.new_sequence(len(ids) + n + 1, private=True)
        try:
            at = 0
            for dk, dv in pieces:
                seq.append_kv(context[at : at + dk.shape[2]], dk, dv)
                at += dk.shape[2]
            resumed = log_softmax(model.forward(fed, seq, all_logits=True))
        finally:
            seq.free()
        kl = (np.exp(reference) * (reference - resumed)).sum(axis=-1)
        top = resumed.argmax(axis=-1)
        agree = top == best
        # where the best tokens differ: how far apart the live cache put them (log-probability): the
        # codec's error flipped a choice the live cache made by that margin
        flipped = reference[np.arange(len(best)), best] - reference[np.arange(len(best)), top]
        out[str(codec)] = {
            "bytes": n_bytes,
            "tokens": len(context),
            "kl_max": float(kl.max()),
            "kl_mean": float(kl.mean()),
            "top1": float(agree.mean()),
            "identical": bool(agree.all()),
            "first_miss": int(np.argmin(agree)) if not agree.all() else None,
            "flipped_margin": float(flipped[~agree].max()) if not agree.all() else 0.0,
        }
    return out


def run(model_names, codecs, n: int, log=print, only=None, cache_type: str = "f16") -> dict:
    per_codec = {
        str(c): {
            "bytes": {},
            "tokens": {},
            "identical": 0,
            "runs": 0,
            "kl": 0.0,
            "kl_sum": 0.0,
            "kl_n": 0,
            "flipped": 0.0,
        }
        for c in codecs
    }
    for name in model_names:
        model = load_model(name, cache_type=cache_type)
        t0 = time.perf_counter()
        resolved = {c: codec_and_plan(model, c) for c in codecs}  # plans measured at a model's first use
        for codec, (_, plan) in resolved.items():
            if plan is not None:
                log(
                    f"{name}: {codec} plan {plan.bits_per_value():.2f} bits/value, "
                    f"keys {plan.k_bits}, values {plan.v_bits}"
                )
        for text_name, ids in texts(model):
            if only and text_name not in only:
                continue
            t = time.perf_counter()
            result = measure_text(model, ids, n, resolved)
            cells = []
            for codec, r in result.items():
                c = per_codec[codec]
                c["bytes"][name] = c["bytes"].get(name, 0) + r["bytes"]
                c["tokens"][name] = c["tokens"].get(name, 0) + r["tokens"]
                c["identical"] += r["identical"]
                c["runs"] += 1
                c["kl"] = max(c["kl"], r["kl_max"])
                c["kl_sum"] += r["kl_mean"] * n
                c["kl_n"] += n
                c["flipped"] = max(c["flipped"], r["flipped_margin"])
                miss = "=" if r["identical"] else f"x@{r['first_miss']}({r['flipped_margin']:.3f})"
                cells.append(
                    f"{codec} {r['bytes'] / r['tokens']:6.0f}B {r['kl_max']:.1e} {r['top1']:.2f}{miss}"
                )
            log(
                f"{name[:12]} {text_name:18} {len(ids):5d} tok {time.perf_counter() - t:5.1f}s | "
                + " | ".join(cells)
            )
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
        del model
    summary = {}
    for codec, c in per_codec.items():
        by_model = {m: round(c["bytes"][m] / c["tokens"][m], 1) for m in c["bytes"]}
        summary[codec] = {
            "bytes_per_token": by_model[model_names[0]],
            "bytes_per_token_by_model": by_model,
            "greedy_identical": f"{c['identical']}/{c['runs']}",
            "kl": float(f"{c['kl']:.3g}"),
            "mean_kl": float(f"{c['kl_sum'] / max(c['kl_n'], 1):.3g}"),
            "worst_flipped_margin": float(f"{c['flipped']:.3g}"),
        }
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per text (default 32)")
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), help="model names (default: both real models)"
    )
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=[*CODECS, *PLANNED_CODECS],
        help="codecs to compare (default: all; auto and auto-h under the model's plans; "
        "auto-h@4: every head at 4 bits; auto-h@1e-4: the plan at that KL budget)",
    )
    parser.add_argument("--texts", nargs="+", help="only these texts (names as logged; default: all)")
    parser.add_argument(
        "--cache-type",
        default="f16",
        choices=("f16", "f32"),
        help="the live cache's element type (f32: what the f16 codec, the f16 arena's rounding, changes)",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    summary = run(
        args.models,
        args.codecs,
        args.tokens,
        log=lambda s: print(s, file=sys.stderr, flush=True),
        only=args.texts,
        cache_type=args.cache_type,
    )
    for codec, s in summary.items():
        print(
            f"{codec:6} {s['bytes_per_token']:8.0f} B/token  greedy identical {s['greedy_identical']:>6}  "
            f"worst KL {s['kl']:.2e}  mean KL {s['mean_kl']:.2e}  flipped margins up to "
            f"{s['worst_flipped_margin']:.3f}",
            file=sys.stderr,
        )
    print(f"{time.perf_counter() - t0:.0f} s, {args.tokens} tokens per text", file=sys.stderr)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
