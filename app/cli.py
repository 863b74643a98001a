"""The `llama-chat` command line: global options, sub-commands, and one-line errors instead of tracebacks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from llama_chat import __version__

EXIT_USAGE = 2


class UsageError(Exception):
    """Input on the command line or stdin that cannot be used (empty, not UTF-8): one line, exit 2."""


def default_db_path() -> Path:
    if os.environ.get("LLAMA_CHAT_DB"):
        return Path(os.environ["LLAMA_CHAT_DB"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "llama-chat" / "chat.db"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-chat", description="Chat with local LLMs in the terminal.")
    parser.add_argument("--version", action="version", version=f"llama-chat {__version__}")
    parser.add_argument("--db", type=Path, default=None, help="conversation database (default: %(default)s)")
    parser.add_argument("--model", default=None, help="a known model name or the path of a .gguf file")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for matrix maths")
    parser.add_argument(
        "--cache-ram",
        type=int,
        default=1024,
        metavar="MB",
        help="RAM for the KV block pool (default %(default)s)",
    )
    parser.add_argument(
        "--no-lookup",
        action="store_true",
        help="decode one token at a time (no prompt lookup: the replies are the same, only slower or faster)",
    )
    parser.add_argument(
        "--kv-remote",
        metavar="URL",
        default=os.environ.get("LLAMA_CHAT_KV_REMOTE"),
        help="share KV blocks with other servers: redis://HOST:PORT[/DB], rediss://..., redis+cluster://HOST:PORT",
    )
    parser.add_argument(
        "--kv-secret",
        metavar="S",
        default=os.environ.get("LLAMA_CHAT_KV_SECRET"),
        help="the secret that signs blocks in --kv-remote (better: LLAMA_CHAT_KV_SECRET)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("models", help="list known models: installed, assembled, verified").add_argument(
        "--json", action="store_true", help="print JSON"
    )

    ask = sub.add_parser("ask", help="ask one question and stream the reply to stdout")
    ask.add_argument("prompt", help="the question; '-' reads it from stdin")
    where = ask.add_mutually_exclusive_group()
    where.add_argument("--session", metavar="ID", help="continue a stored session (id or unique prefix)")
    where.add_argument("--new-session", action="store_true", help="start a stored session (prints its id)")
    add_sampling_options(ask)

    chat = sub.add_parser("chat", help="chat in the terminal, line by line (Ctrl+D ends)")
    chat.add_argument("--session", metavar="ID", help="continue a stored session instead of starting one")
    add_sampling_options(chat)

    tui = sub.add_parser("tui", help="the full-screen chat (what no command opens)")
    tui.add_argument("--session", metavar="ID", help="open this session (default: the last one)")

    sessions = sub.add_parser(
        "sessions", help="stored conversations: list, show, fork, rename, rm, search, gc, check"
    )
    ssub = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    ssub.add_parser("list", help="newest first").add_argument("--json", action="store_true")
    show = ssub.add_parser("show", help="the messages of a session")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    fork = ssub.add_parser("fork", help="a new session sharing this one's messages and KV")
    fork.add_argument("id")
    fork.add_argument("--at", type=int, metavar="MESSAGE_ID", help="fork at this message (default: the head)")
    fork.add_argument("--title")
    rename = ssub.add_parser("rename", help="give a session a new title")
    rename.add_argument("id")
    rename.add_argument("title")
    ssub.add_parser("rm", help="delete a session (messages other sessions reach stay)").add_argument("id")
    ssub.add_parser("search", help="full-text search over messages").add_argument("text")
    check = ssub.add_parser("check", help="check the database file; recover what can be read if damaged")
    check.add_argument("-o", "--output", type=Path, metavar="FILE", help="recover into (default: beside it)")
    verify = ssub.add_parser(
        "verify", help="recompute an imported session's KV; blocks that match are shared from then on"
    )
    verify.add_argument("id")
    verify.add_argument(
        "--ctx", type=int, default=4096, help="context window in tokens (default %(default)s)"
    )
    gc = ssub.add_parser("gc", help="drop stored KV no session needs")
    gc.add_argument("--budget", type=int, metavar="MB", help="then keep at most this many MB of KV")

    tok = sub.add_parser("tokenize", help="print the token ids of a text as JSON")
    tok.add_argument("text", help="the text; '-' reads it from stdin")
    tok.add_argument("--special", action="store_true", help="parse special tokens such as <|im_start|>")
    tok.add_argument("--bos", action="store_true", help="add the BOS token when the model uses one")

    bench = sub.add_parser("bench", help="measure load, prefill and decode speed on the model")
    bench.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    bench.add_argument("--quick", action="store_true", help="fewer tokens: a smoke test, not a measurement")

    export = sub.add_parser("export", help="write a session, with its KV, to a .llamachat file")
    export.add_argument("id", help="session id or unique prefix")
    export.add_argument("-o", "--output", type=Path, metavar="FILE", help="default: <title>-<id>.llamachat")
    kv = export.add_mutually_exclusive_group()
    kv.add_argument("--with-kv", dest="with_kv", action="store_true", default=True, help="with KV (default)")
    kv.add_argument("--no-kv", dest="with_kv", action="store_false", help="messages only: a small file")
    export.add_argument("--codec", metavar="C", help="re-encode KV: f32, f16, q8, q6 or q4 (default: kept)")
    scope = export.add_mutually_exclusive_group()
    scope.add_argument(
        "--branch", dest="tree", action="store_false", default=False, help="this branch (default)"
    )
    scope.add_argument("--tree", dest="tree", action="store_true", help="every session on its message tree")
    export.add_argument(
        "--markdown", action="store_true", help="a Markdown transcript, to stdout (-o FILE writes it)"
    )

    imp = sub.add_parser("import", help="add the session(s) of a .llamachat file; prints the new id")
    imp.add_argument("file", type=Path)
    return parser


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    # None means "not given": a stored session keeps its own settings
    p.add_argument("--temp", type=float, help="temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, help="default 40; 0 is off")
    p.add_argument("--top-p", type=float, help="default 0.95; 1 is off")
    p.add_argument("--min-p", type=float, help="default 0.05; 0 is off")
    p.add_argument("--repeat-penalty", type=float, help="default 1.0 (off)")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--ctx", type=int, default=4096, help="context window in tokens (default %(default)s)")
    p.add_argument("--title", default=None, help="title of a new session")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no command: the full-screen chat on the default model
        args = parser.parse_args([*argv, "tui"])
    if args.threads:
        # Must be set before NumPy loads its BLAS and numba its thread pool, which is why inference is
        # imported below.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    args.db = args.db or default_db_path()
    from llama_chat.inference import ModelError
    from llama_chat.storage import StoreError

    try:
        return run_command(args)
    except (ModelError, StoreError, UsageError) as e:
        print(f"llama-chat: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def run_command(args) -> int:
    from . import commands

    if args.command == "tui":
        from .tui import cmd_tui as handler
    else:
        handler = getattr(commands, f"cmd_{args.command}")
    return handler(args) or 0


def print_json(value) -> None:
    print(json.dumps(value, ensure_ascii=False))
