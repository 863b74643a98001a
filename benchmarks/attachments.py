"""A file attached to a new conversation that another conversation attached first (not CI): time to
first token of each, and the file's rows in the database.

    .venv/bin/python benchmarks/attachments.py [--tokens 2000] [--model NAME] [--json]

Conversation A attaches a file of about --tokens tokens (prose from docs/) and asks a question; B,
in the same process, attaches the same file and asks another (its blocks come from the RAM pool); C,
in a fresh process over the same database, does the same (its blocks come from SQLite). For
comparison, D puts its question before the file (the order `ask -f` does not use): nothing is shared.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_chat.app.chat.attachments import Attachment, with_attachments
from llama_chat.app.chat.build import load_chat_model
from llama_chat.app.chat.engine import ChatEngine
from llama_chat.app.chat.jobs import stream_text
from llama_chat.inference import SamplingParams
from llama_chat.storage import ChatStore

DOCS = Path(__file__).resolve().parent.parent / "docs"
QUESTIONS = (
    "Summarize this file in one sentence.",
    "What is the first section about?",
    "Name one limit it gives.",
)


def file_text(model, n_tokens: int) -> str:
    """About n_tokens of the project's own docs, cut at a line."""
    lines, total = [], 0
    for page in sorted(DOCS.glob("*.md")):
        for line in page.read_text().splitlines(keepends=True):
            total += len(model.tokenizer.encode(line))
            if total > n_tokens:
                return "".join(lines)
            lines.append(line)
    return "".join(lines)


def timed_reply(engine: ChatEngine, text: str) -> dict:
    """A new conversation's first reply (4 tokens, greedy): time to its first token, and its prefill."""
    session = engine.new_session("attachments benchmark")
    t0 = time.perf_counter()
    job = engine.reply(session, text, sampling=SamplingParams(temperature=0.0), max_tokens=4)
    ttft = None
    for _ in stream_text(job):
        ttft = ttft or time.perf_counter() - t0
    stats = job.stats[0]
    return {
        "ttft_s": round(ttft, 3),
        "prompt_tokens": stats.prompt_tokens,
        "prefilled": stats.prefilled_tokens,
    }


def run(db: Path, model_name: str | None, file: Path, cases: list[tuple[str, bool, int]]) -> dict:
    """Each case (name, whether the file comes first, which question) as a new conversation."""
    model = load_chat_model(model_name)
    engine = ChatEngine(model, ChatStore(db))
    attached = Attachment("notes.md", file.read_text())
    out = {}
    for name, files_first, asked in cases:
        question = QUESTIONS[asked]
        text = (
            with_attachments(question, [attached]) if files_first else question + "\n\n" + attached.inline()
        )
        out[name] = timed_reply(engine, text)
    engine.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--second", nargs=2, metavar=("DB", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.second:  # the fresh process: C
        print(json.dumps(run(Path(args.second[0]), args.model, Path(args.second[1]), [("C", True, 2)])))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="attach-bench-"))
    db, file = folder / "chat.db", folder / "notes.md"
    model = load_chat_model(args.model)
    file.write_text(file_text(model, args.tokens))
    del model
    results = run(db, args.model, file, [("A", True, 0), ("B", True, 1)])
    child = [sys.executable, __file__, "--second", str(db), str(file)] + (
        ["--model", args.model] if args.model else []
    )
    results |= json.loads(
        subprocess.run(child, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    )
    results |= {"D": run(folder / "other.db", args.model, file, [("D0", False, 0), ("D", False, 1)])["D"]}
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(content)), 0) FROM fragments").fetchone()
    summary = {
        "file_chars": len(file.read_text()),
        "fragments_rows": rows[0],
        "fragments_chars": rows[1],
        "conversations": results,
        "B_over_A": round(results["B"]["ttft_s"] / results["A"]["ttft_s"], 3),
        "C_over_A": round(results["C"]["ttft_s"] / results["A"]["ttft_s"], 3),
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    for name, what in (
        ("A", "first to attach the file"),
        ("B", "same file, same process (RAM pool)"),
        ("C", "same file, fresh process (SQLite)"),
        ("D", "question before the file, second time"),
    ):
        r = results[name]
        print(
            f"{name} {what:40} TTFT {r['ttft_s']:7.3f} s  prefilled {r['prefilled']:5} of "
            f"{r['prompt_tokens']}"
        )
    print(f"B/A {summary['B_over_A']:.1%}  C/A {summary['C_over_A']:.1%}")
    print(
        f"the file ({summary['file_chars']:,} chars) is stored {rows[0]} time(s): "
        f"{rows[1]:,} chars in `fragments`"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
