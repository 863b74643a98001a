"""What an archive of many conversations costs (not CI): a database filled with N conversations of six
messages each, then the time of a search, of the newest page of sessions, of one session's messages
(what a resume reads), of opening the file (as llama-chat left it, and changed by another program: every
page checked for damage), of `llama-chat sessions list --limit 50`: its own work (in this process)
and as a person runs it (a new process, which imports the command line first), and of the app's start
to its window ready: the newest chats in the sidebar and the last one's messages on screen (its model,
a file that is not there, fails to load at once: `llama-chat bench` times a model's load).

    .venv/bin/python benchmarks/archive.py [--conversations 10000,100000] [--keep DIR] [--json]

The conversations are written in bulk (one transaction, executemany; the full-text index filled by
the schema's own triggers), as the store lays them out. Their text is words of a made-up vocabulary
drawn with Zipf's law, so a search can ask for a rare word, a common one, or two at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_chat.app import cli
from llama_chat.storage import ChatStore

MESSAGES = 6  # a conversation: three questions and their answers
WORDS = 20_000  # the vocabulary
SEED = 43
# Words by their rank in the vocabulary: how many conversations a search for them finds grows with N.
QUERIES = {"rare word": [15_000], "common word": [40], "two words": [300, 800]}
PAGE = 50
APP_CHILD = """
import asyncio, sys, time
started = time.perf_counter()
from pathlib import Path
from llama_chat.app.config import UserConfig
from llama_chat.app.tui import ChatApp
from llama_chat.app.tui.sidebar import SessionTree

async def main():
    folder = Path(sys.argv[2])
    config = UserConfig(path=folder / "config.toml")
    app = ChatApp(Path(sys.argv[1]), model=str(folder / "no-model.gguf"), config=config)
    async with app.run_test(size=(110, 34)):
        tree = app.chat.query_one(SessionTree)
        while not (tree.root.children and app.chat.conversation.views()):
            await asyncio.sleep(0.002)
        print(time.perf_counter() - started)

asyncio.run(main())
"""


def vocabulary() -> list[str]:
    rng = random.Random(SEED)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = set()
    while len(words) < WORDS:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
    return sorted(words, key=lambda w: (len(w), w))


def fill(store: ChatStore, start: int, end: int, words: list[str]) -> float:
    """Conversations start to end (their numbers) written in one transaction; the seconds it took."""
    rng = random.Random(SEED + start)
    zipf = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))  # s = 1
    conn = store.db.conn
    first_id = (conn.execute("SELECT max(id) FROM messages").fetchone()[0] or 0) + 1
    now = time.time() - 1_000_000  # conversation c updated at now + c: the last is the newest
    t0 = time.perf_counter()
    sessions, messages = [], []
    for c in range(start, end):
        base = first_id + (c - start) * MESSAGES
        for k in range(MESSAGES):
            length = rng.randint(30, 200) if k % 2 else rng.randint(5, 40)  # an answer, a question
            text = " ".join(rng.choices(words, cum_weights=zipf, k=length))
            role = "assistant" if k % 2 else "user"
            messages.append((base + k, base + k - 1 if k else None, role, text, now + c))
        sessions.append((f"{c:012x}", f"conversation {c}", base + MESSAGES - 1, now + c, now + c))
    with store.transaction():
        conn.executemany(
            "INSERT INTO messages (id, parent_id, role, content, created) VALUES (?, ?, ?, ?, ?)", messages
        )
        conn.executemany(
            "INSERT INTO sessions (id, title, head_id, created, updated) VALUES (?, ?, ?, ?, ?)", sessions
        )
    return time.perf_counter() - t0


def conversations_in(db: Path) -> int:
    store = ChatStore(db)
    try:
        return store.connection.rows("SELECT count(*) AS n FROM sessions")[0]["n"]
    finally:
        store.close()


def best_of(repeat: int, run) -> float:
    """The fastest of `repeat` runs, in ms (the machine is shared: the slower ones waited for others)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1000, 2)


def command_ms(db: Path, args: list[str], repeat: int = 3) -> dict:
    """`llama-chat --db db …` as a process: its wall time (best and median of `repeat`, ms)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "llama_chat", "--db", str(db), *args], check=True, capture_output=True
        )
        times.append(time.perf_counter() - t0)
    return {"best_ms": round(min(times) * 1000), "median_ms": round(statistics.median(times) * 1000)}


def app_ready_ms(db: Path, repeat: int = 3) -> dict:
    """The app in a process of its own (Textual's test driver, no terminal): ms from its first import
    to its window ready (best and median of `repeat`)."""
    times = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "XDG_CONFIG_HOME": folder, "XDG_STATE_HOME": folder}
            args = [sys.executable, "-c", APP_CHILD, str(db), folder]
            run = subprocess.run(args, check=True, capture_output=True, text=True, env=env, timeout=600)
            out = run.stdout
            times.append(float(out.split()[-1]))
    return {"best_ms": round(min(times) * 1000), "median_ms": round(statistics.median(times) * 1000)}


def measure(db: Path, n: int, words: list[str]) -> dict:
    store = ChatStore(db)
    out = {}
    for name, ranks in QUERIES.items():
        query = " ".join(words[r] for r in ranks)
        found = store.search(query)
        out[f"search {name}"] = {"ms": best_of(5, lambda q=query: store.search(q)), "results": len(found)}
    out[f"newest {PAGE} sessions"] = {"ms": best_of(5, lambda: store.list_sessions(limit=PAGE))}
    # the sidebar's search of titles; no title holds the word: every one is read
    titled = best_of(5, lambda: store.list_sessions(limit=100, titled=words[15_000]))
    out["titles holding a word (none does)"] = {"ms": titled}
    out["every session"] = {"ms": best_of(2, store.list_sessions)}
    (middle,) = store.list_sessions(limit=1, offset=n // 2)
    out["one session's messages"] = {
        "ms": best_of(5, lambda: store.path(store.get_session(middle.id).head_id))
    }
    store.close()
    listing = ["--db", str(db), "sessions", "list", "--limit", str(PAGE)]
    ChatStore(db).close()  # (checked: the file is new to it)
    out["opening the database"] = {"ms": best_of(3, lambda: ChatStore(db).close())}

    def changed_then_opened():
        os.utime(db)  # as another program's write would leave it
        ChatStore(db).close()

    out["opening it, changed by another program"] = {"ms": best_of(3, changed_then_opened)}
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        out[f"sessions list --limit {PAGE}, its work"] = {"ms": best_of(3, lambda: cli.main(listing))}
    gc.collect()  # the stores main() opened: closed, so that the next fill's -wal is this process's only
    out[f"sessions list --limit {PAGE}, a process"] = command_ms(db, listing[2:])
    out["llama-chat --version, a process"] = command_ms(db, ["--version"])
    out["the app's window ready, a process"] = app_ready_ms(db)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", default="10000,100000", help="sizes to measure, ascending")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR",
        help="keep the database there (else a temp dir); one kept there before is filled on, not again",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.conversations.split(","))
    folder = args.keep or Path(tempfile.mkdtemp(prefix="llama-chat-archive-"))
    db = folder / "archive.db"
    words, results = vocabulary(), {}
    filled = conversations_in(db) if db.exists() else 0
    for n in sizes:
        if n < filled:
            print(f"{n:,} conversations: left out (the database kept in {folder} holds {filled:,})")
            continue
        store = ChatStore(db)
        seconds = fill(store, filled, n, words)
        store.close()
        filled = n
        result = {
            "fill_s": round(seconds, 1),
            "db_mb": round(db.stat().st_size / 1e6),
            **measure(db, n, words),
        }
        results[n] = result
        print(f"{n:,} conversations ({result['db_mb']} MB, filled in {result['fill_s']} s)")
        for name, figure in result.items():
            if isinstance(figure, dict):
                print(f"  {name:32} " + ", ".join(f"{k} {v}" for k, v in figure.items()))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
