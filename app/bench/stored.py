"""Measurements of what is kept: the KV codecs on a model's real cache, export and import, resume in a
fresh process, fork, and how soon a stopped reply is stored.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

from llama_chat.inference import SamplingParams, load_model
from llama_chat.storage import ChatStore
from llama_chat.storage.codec import AUTO, CODECS, KVPlan, decode_kv, encode_kv
from llama_chat.storage.exchange import default_file_name, export_session, import_session
from llama_chat.storage.kv_plan import model_plan

from ..chat.engine import ChatEngine
from ..chat.jobs import stream_text
from .processes import child_line
from .samples import sample_tokens

GREEDY = SamplingParams(temperature=0)


def measure_codecs(k: np.ndarray, v: np.ndarray, plan: KVPlan | None = None) -> dict[str, dict]:
    """Each codec (and auto, given the model's plan) on a whole cache [n_layer, n_kv_head, n_tokens,
    head_dim], cut into 64-token blocks as storage cuts it: total bytes, bytes per token, encode/decode
    milliseconds for the whole cache (best of 3 runs), and the largest absolute error in k and in v."""
    block = 64
    n_tokens = k.shape[2]
    pieces = [(k[:, :, t : t + block], v[:, :, t : t + block]) for t in range(0, n_tokens, block)]
    out = {}
    for codec in (*CODECS, AUTO) if plan else CODECS:
        encode_s = decode_s = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            blobs = [encode_kv(bk, bv, codec, plan) for bk, bv in pieces]
            t1 = time.perf_counter()
            decoded = [decode_kv(b) for b in blobs]
            t2 = time.perf_counter()
            encode_s, decode_s = min(encode_s, t1 - t0), min(decode_s, t2 - t1)
        size = sum(len(b) for b in blobs)
        err_k = max(float(np.abs(dk - bk).max()) for (dk, _), (bk, _) in zip(decoded, pieces))
        err_v = max(float(np.abs(dv - bv).max()) for (_, dv), (_, bv) in zip(decoded, pieces))
        out[codec] = {
            "bytes": size,
            "bytes_per_token": size / n_tokens,
            "encode_ms": encode_s * 1000,
            "decode_ms": decode_s * 1000,
            "max_abs_err_k": err_k,
            "max_abs_err_v": err_v,
        }
    return out


def measure_codec_quality(model, n_tokens: int, n_greedy: int) -> dict:
    """Every codec on the model's real KV: size and speed (measure_codecs above), KL divergence
    of the next-token distribution against the live cache, and how many greedy tokens match live."""

    plan = model_plan(model)
    ids = sample_tokens(model.tokenizer, n_tokens + 1)
    live = model.new_sequence(n_tokens + n_greedy + 2)
    model.forward(ids[:n_tokens], live)
    k, v = live.gather(0, n_tokens)
    table = measure_codecs(k, v, plan)

    def greedy(seq, first: int) -> tuple[np.ndarray, list[int]]:
        logits = model.forward([first], seq)[-1]
        out, row = [], logits
        for _ in range(n_greedy):
            out.append(int(np.argmax(row)))
            row = model.forward([out[-1]], seq)[-1]
        return logits, out

    live_logits, live_tokens = greedy(live, ids[n_tokens])
    p = live_logits.astype(np.float64) - live_logits.max()
    p -= np.log(np.exp(p).sum())
    B = model.pool.block_size
    for codec in table:
        # private: keep the decoded KV (sharing by prefix key would hand back the live blocks)
        seq = model.new_sequence(n_tokens + n_greedy + 2, private=True)
        for start in range(0, n_tokens, B):
            dk, dv = decode_kv(encode_kv(k[:, :, start : start + B], v[:, :, start : start + B], codec, plan))
            seq.append_kv(ids[start : start + dk.shape[2]], dk, dv)
        logits, tokens = greedy(seq, ids[n_tokens])
        q = logits.astype(np.float64) - logits.max()
        q -= np.log(np.exp(q).sum())
        same = next((i for i, (a, b) in enumerate(zip(tokens, live_tokens, strict=True)) if a != b), n_greedy)
        table[codec]["kl"] = float((np.exp(p) * (p - q)).sum())
        table[codec]["greedy_match"] = f"{same}/{n_greedy}"
        seq.free()
    live.free()
    return table


def measure_exchange(store: ChatStore, session_id: str, folder: str | Path) -> dict:
    """Export a stored session with its KV, then read and import the file into an empty database in
    `folder`: milliseconds of each, file bytes, and the bytes the session holds in the store (its
    blocks, tail, message text and token ids) for the size ratio."""
    folder = Path(folder)
    session = store.get_session(session_id)
    path = folder / default_file_name(session)
    t0 = time.perf_counter()
    summary = export_session(store, session.id, path)
    t1 = time.perf_counter()
    target = ChatStore(folder / "imported.db")
    t2 = time.perf_counter()
    result = import_session(target, path, model_fingerprint=session.model_fingerprint)
    t3 = time.perf_counter()
    target.close()
    stored = 0
    for key in store.kv.block_keys(session.id):
        block = store.kv.load_block(key, session.model_fingerprint, session.kv_namespace)
        stored += len(block.data) if block else 0
    tail = store.kv.load_tail(session.id, session.model_fingerprint)
    stored += len(tail.data) if tail else 0
    for m in store.path(session.head_id):
        stored += len(m.content.encode()) + 4 * len(m.token_ids or [])
    return {
        "tokens": session.n_tokens,
        "export_ms": (t1 - t0) * 1000,
        "import_ms": (t3 - t2) * 1000,
        "file_bytes": summary.bytes,
        "stored_bytes": stored,
        "size_ratio": summary.bytes / stored if stored else float("nan"),
        "kv": result.kv,
    }


# load_chat_model, as every front end loads a model, then the thread it leaves the KV codec's loops to
# (build.compile_later) joined: the resume is timed on a ready engine, without loading them.
RESUME_CHILD = """
import json, sys, threading, time
from llama_chat.app.chat.build import load_chat_model
from llama_chat.app.chat.engine import ChatEngine
from llama_chat.storage import ChatStore
model = load_chat_model(sys.argv[1])
[t.join() for t in threading.enumerate() if t.name == "compile-later"]
store = ChatStore(sys.argv[2])
engine = ChatEngine(model, store)
session = store.get_session(sys.argv[3])
t = time.perf_counter()
info = engine.resume(session)
resume = time.perf_counter() - t
ids = store.kv.kept_ids(session.id)[1]  # the conversation's tokens, kept by its snapshot
fresh = model.new_sequence(len(ids) + 1)
t = time.perf_counter()
model.forward(ids, fresh)
reprefill = time.perf_counter() - t
print(json.dumps({"resume_ms": resume * 1000, "reprefill_ms": reprefill * 1000, "tokens": info.tokens,
                  "restored": info.restored}))
"""


def measure_sessions(model, text: str, folder: Path) -> dict:
    """A stored conversation of `text` and a short reply: resume in a fresh process vs prefilling it
    again; fork of it (time, bytes added to the database); export and import of it."""
    db = folder / "bench.db"
    store = ChatStore(db)
    engine = ChatEngine(model, store)
    session = engine.new_session("bench")
    "".join(stream_text(engine.reply(session, text, sampling=GREEDY, max_tokens=16)))
    session = store.get_session(session.id)
    result = json.loads(child_line(RESUME_CHILD, str(model.path), str(db), session.id))

    def stored_bytes():
        sizes = store.kv.kv_bytes()
        return sizes["blocks"] + sizes["tails"]

    before = stored_bytes()
    t = time.perf_counter()
    engine.fork(session)
    result["fork_ms"] = (time.perf_counter() - t) * 1000
    result["fork_added_bytes"] = stored_bytes() - before
    result["stored_block_bytes"] = store.kv.kv_bytes()["largest_block"]
    result["exchange"] = measure_exchange(store, session.id, folder)
    store.close()
    return result


def measure_stop(model, text: str, folder: Path, max_tokens: int) -> dict:
    """Esc (or Ctrl+C) during a reply: milliseconds from the cancel to the reply stored with what it
    wrote, for one reply and for regenerate ×3 (three replies decoded together). On a model loaded
    anew: the one given already reads its blocks from measure_sessions' store (a pool has one source)."""
    store = ChatStore(folder / "stop.db")
    engine = ChatEngine(load_model(model.path), store)
    session = engine.new_session("stop")

    def stopped_ms(submit) -> float:
        writing = threading.Event()
        job = submit(on_event=lambda e: e.kind == "text" and writing.set())
        writing.wait()  # the reply is under way
        t = time.perf_counter()
        job.cancel()
        job.wait()
        return (time.perf_counter() - t) * 1000

    one = stopped_ms(
        lambda **kw: engine.reply(session, text, sampling=GREEDY, max_tokens=max_tokens, **kw)
    )
    session = store.get_session(session.id)
    three = stopped_ms(
        lambda **kw: engine.regenerate(session, 3, sampling=GREEDY, max_tokens=max_tokens, **kw)[1]
    )
    engine.close()
    store.close()
    return {"stop_ms": one, "stop_three_ms": three}
