"""Measurements for `llama-chat bench` beyond the forward pass: the KV codecs, export and import,
resume in a fresh process, how soon a stopped reply is stored, and how the app starts and answers keys.

Timing lives here and in bench.py, never in unit tests, where a busy machine would fail them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from llama_chat.inference import SamplingParams, load_model
from llama_chat.storage import ChatStore
from llama_chat.storage.codec import AUTO, CODECS, KVPlan, decode_kv, encode_kv
from llama_chat.storage.exchange import default_file_name, export_session, import_session

from .chat.engine import ChatEngine

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


# load_chat_model, as every front end loads a model: the codec's compiled loops (and the model's KV
# plan) are ready before a conversation is opened, so the resume is timed without them.
RESUME_CHILD = """
import json, sys, time
from llama_chat.app.chat.engine import ChatEngine, load_chat_model
from llama_chat.storage import ChatStore
model = load_chat_model(sys.argv[1])
engine = ChatEngine(model, ChatStore(sys.argv[2]))
session = engine.store.get_session(sys.argv[3])
t = time.perf_counter()
seq, info = engine.open(session)
resume = time.perf_counter() - t
ids = engine.conversation_ids(session)
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
    engine = ChatEngine(model, ChatStore(db))
    session = engine.new_session("bench")
    "".join(engine.reply(session, text, sampling=GREEDY, max_tokens=16))
    session = engine.store.get_session(session.id)
    out = subprocess.run(
        [sys.executable, "-c", RESUME_CHILD, str(model.path), str(db), session.id],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])

    def stored_bytes():
        sizes = engine.store.kv.kv_bytes()
        return sizes["blocks"] + sizes["tails"]

    before = stored_bytes()
    t = time.perf_counter()
    engine.fork(session)
    result["fork_ms"] = (time.perf_counter() - t) * 1000
    result["fork_added_bytes"] = stored_bytes() - before
    result["stored_block_bytes"] = engine.store.kv.kv_bytes()["largest_block"]
    result["exchange"] = measure_exchange(engine.store, session.id, folder)
    engine.store.close()
    return result


def measure_stop(model, text: str, folder: Path, max_tokens: int) -> dict:
    """Esc (or Ctrl+C) during a reply: milliseconds from the cancel to the reply stored with what it
    wrote, for one reply and for regenerate ×3 (three replies decoded together). On a model loaded
    anew: the one given already reads its blocks from measure_sessions' store (a pool has one source)."""
    engine = ChatEngine(load_model(model.path), ChatStore(folder / "stop.db"))
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
        lambda **kw: engine.submit_reply(session, text, sampling=GREEDY, max_tokens=max_tokens, **kw)
    )
    session = engine.store.get_session(session.id)
    three = stopped_ms(
        lambda **kw: engine.submit_regenerate(session, 3, sampling=GREEDY, max_tokens=max_tokens, **kw)
    )
    engine.scheduler.close()
    engine.store.close()
    return {"stop_ms": one, "stop_three_ms": three}


APP_CHILD = """
import asyncio, json, sys, time
from pathlib import Path
started = time.perf_counter()
from textual import events
from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.app.tui.widgets import ChatInput

async def main():
    folder = Path(sys.argv[2])
    config = UserConfig(path=folder / "config.toml", max_tokens=200, sampling={"temperature": 0})
    app = ChatApp(folder / "app.db", model=sys.argv[1], config=config)
    async with app.run_test(size=(110, 34)) as pilot:
        screen_s = time.perf_counter() - started
        while app.chat.loading_model is not None:
            await asyncio.sleep(0.01)
        ready_s = time.perf_counter() - started
        await pilot.press(*"Write a story about caches.", "enter")
        views = app.chat.conversation.views
        while not (len(views()) == 2 and views()[1].content):
            await asyncio.sleep(0.01)
        chat_input = app.chat.query_one(ChatInput)
        keys = []
        for ch in "abcdefghij":
            t = time.perf_counter()
            app.post_message(events.Key(ch, ch))  # as the terminal driver sends it
            while not chat_input.text.endswith(ch):
                await asyncio.sleep(0.001)
            keys.append(time.perf_counter() - t)
            await asyncio.sleep(0.1)
        t = time.perf_counter()
        app.chat.action_stop()
        while app.chat.replies:
            await asyncio.sleep(0.005)
        esc_s = time.perf_counter() - t
    print(json.dumps({"screen_s": screen_s, "ready_s": ready_s, "key_ms": max(keys) * 1000,
                      "esc_ms": esc_s * 1000}))

asyncio.run(main())
"""


def measure_app(model_path: Path, folder: Path) -> dict:
    """The full-screen app in a process of its own (Textual's test driver, no terminal): seconds from
    its imports to the chat screen and to the model loaded; while a reply streams, the slowest of ten
    keys to reach the input; and Esc to the reply stopped and stored."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(folder / "config"), "XDG_STATE_HOME": str(folder / "state")}
    out = subprocess.run(
        [sys.executable, "-c", APP_CHILD, str(model_path), str(folder)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
