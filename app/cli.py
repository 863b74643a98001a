"""The `llama-chat` command line: global options, sub-commands, and one-line errors instead of tracebacks."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from llama_chat import __version__

EXIT_USAGE = 2
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def default_db_path() -> Path:
    if os.environ.get("LLAMA_CHAT_DB"):
        return Path(os.environ["LLAMA_CHAT_DB"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "llama-chat" / "chat.db"


def add_global_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """The options of every command. Before the command they have their defaults; after it (as users
    type them: `llama-chat ask --model X …`) one not given leaves what came before the command. Their
    choices and the defaults their help names are read from the modules that own them only when the
    flag is given or help is shown (`Later`, `Help`)."""

    def default(value):
        return argparse.SUPPRESS if after_command else value

    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument("--db", type=Path, default=default(None), help="conversation database")
    group.add_argument(
        "--model", default=default(None), help="a known model name or the path of a .gguf file"
    )
    add_threads_option(group, default(None))
    group.add_argument(
        "--cache-ram",
        type=int,
        default=default(None),
        metavar="MB",
        help="RAM for the KV block pool (default {settings.CACHE_RAM_MB})",
    )
    group.add_argument(
        "--block-size",
        type=positive,
        default=default(None),
        metavar="N",
        help="tokens per KV block, the unit KV is shared and stored in "
        "(default {kv_cache.DEFAULT_BLOCK_SIZE})",
    )
    group.add_argument(
        "--cache-type",
        choices=Later("llama_chat.inference.kv_arena", "CACHE_TYPES"),
        default=default(None),
        help="element type of the live KV cache in RAM (default {kv_arena.DEFAULT_CACHE_TYPE}, as "
        "llama.cpp's; f32 keeps the KV exactly as computed, in twice the RAM)",
    )
    group.add_argument(
        "--activations",
        choices=Later("llama_chat.inference.kernels", "ACTIVATIONS"),
        default=default(None),
        help="what matrix products take their inputs as (default {activation_modes.DEFAULT_ACTIVATIONS}; "
        "q8: bytes, a scale per 32, as llama.cpp: the fastest, logits nearer the exact model's than "
        "llama.cpp's; mixed: bytes only for inputs that come from a norm, prompts slower; f32: exactly as "
        "computed, prompts slowest)",
    )
    group.add_argument(
        "--kv-codec",
        choices=Later("llama_chat.storage.codec", "CODECS", "PLANNED_CODECS"),
        default=default(None),
        help="what new KV snapshots are stored in (default {settings.CODEC}: its resumed replies match "
        "live ones)",
    )
    group.add_argument(
        "--no-lookup",
        action="store_true",
        default=default(False),
        help="decode one token at a time (no prompt lookup: the replies are the same, only slower or faster)",
    )
    group.add_argument(
        "--no-mmap",
        action="store_true",
        default=default(False),
        help="read the weights into memory instead of mapping them from their packed file, as llama.cpp's "
        "--no-mmap: a longer start and memory no other process shares; decode faster where the page "
        "cache reads slower than a process's own memory (some virtual machines)",
    )
    group.add_argument(
        "--kv-remote",
        metavar="URL",
        default=default(os.environ.get("LLAMA_CHAT_KV_REMOTE")),
        help="share KV blocks with other servers: redis://HOST:PORT[/DB], rediss://..., redis+cluster://HOST:PORT",
    )
    group.add_argument(
        "--kv-fetch",
        choices=("measured", "always"),
        default=default("measured"),
        help="read the KV blocks a conversation lacks from --kv-remote where its measured round trips "
        "beat computing them (measured), or whenever it holds them (always: a fast store on a machine "
        "busy enough to misjudge it; a read then waits up to 2 s, not 0.25 s)",
    )
    group.add_argument(
        "--kv-secret",
        metavar="S",
        default=default(os.environ.get("LLAMA_CHAT_KV_SECRET")),
        help="the secret that signs blocks in --kv-remote (better: LLAMA_CHAT_KV_SECRET)",
    )


class Later(Sequence):
    """A flag's choices, read from the module that owns them only when the flag is given or help is
    shown: the modules load NumPy or numba (a second or more), which most commands never need."""

    def __init__(self, module: str, *names: str):
        self.module, self.names = module, names

    def values(self) -> tuple[str, ...]:
        owner = importlib.import_module(self.module)
        return tuple(value for name in self.names for value in getattr(owner, name))

    def __getitem__(self, i):
        return self.values()[i]

    def __len__(self) -> int:
        return len(self.values())


class Help(argparse.HelpFormatter):
    """Help whose texts name the defaults of the modules that own them, as `{kv_cache.DEFAULT_BLOCK_SIZE}`:
    those modules load only when help is shown."""

    OWNERS = {
        "settings": "llama_chat.app.chat.settings",
        "kv_cache": "llama_chat.inference.kv_cache",
        "kv_arena": "llama_chat.inference.kv_arena",
        "activation_modes": "llama_chat.inference.activation_modes",
    }

    class _Owners(dict):
        def __missing__(self, name: str):
            return importlib.import_module(Help.OWNERS[name])

    def _get_help_string(self, action) -> str:
        return action.help.format_map(self._Owners())


def positive(text: str, least: int = 1) -> int:
    """argparse's `type` for a count that must be 1 (`least`) or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {least} or more")
    return value


def natural(text: str) -> int:
    """argparse's `type` for a count that may be 0."""
    return positive(text, 0)


def add_threads_option(parser, default=None) -> None:
    parser.add_argument("--threads", type=int, default=default, help="CPU threads for matrix maths")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """The flags of a reply, one per setting of chat/settings.py (a flag not given is None: a stored
    session keeps its own settings), and whether its thinking is shown."""
    from .chat.settings import REPLY_MAX_TOKENS, REPLY_SETTINGS

    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--show-thinking", action="store_true", help="a thinking model's thinking on stderr (else not shown)"
    )
    for setting in REPLY_SETTINGS:
        default = "" if setting.default is None else f" (default: the model's, else {setting.default})"
        if setting is REPLY_MAX_TOKENS:
            default = f" (default {setting.default})"
        choices = "{" + ",".join(setting.choices) + "}"
        parser.add_argument(
            setting.option,
            dest=setting.key,
            type=flag_type(setting),
            metavar=choices if setting.choices else setting.kind.__name__.upper(),
            help=setting.help + default,
        )
    add_context_option(parser)
    parser.add_argument("--title", default=None, help="title of a new session")


def flag_type(setting):
    """argparse's `type` for a setting: its value, or the setting's own one-line complaint."""

    def parse(text: str):
        try:
            return setting.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_context_option(parser: argparse.ArgumentParser) -> None:
    from .chat.settings import N_CTX

    parser.add_argument(
        "--ctx", type=int, default=N_CTX, help="context window in tokens (default %(default)s)"
    )


def lazy(module: str, function: str):
    """A command's function, imported when that command runs: `sessions list` need not load the
    inference core, Textual or the server (seconds of imports on every command). NumPy and numba load
    after main() has set the thread count, as they read it once."""

    def run(args):
        return getattr(importlib.import_module(f"llama_chat.app.{module}"), function)(args)

    run.__name__ = function
    return run


def build_parser() -> argparse.ArgumentParser:
    c, s = partial(lazy, "commands"), partial(lazy, "commands_sessions")
    parser = argparse.ArgumentParser(
        prog="llama-chat", description="Chat with local LLMs in the terminal.", formatter_class=Help
    )
    parser.add_argument("--version", action="version", version=f"llama-chat {__version__}")
    add_global_options(parser)
    parser.set_defaults(handler=None)
    after = argparse.ArgumentParser(add_help=False)
    add_global_options(after, after_command=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, handler, help: str, parent=sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, parents=[after], formatter_class=Help)
        p.set_defaults(handler=handler)
        return p

    models = command("models", c("cmd_models"), "list known models: installed, assembled, verified")
    models.add_argument("--json", action="store_true", help="print JSON")
    models.add_argument(
        "--prune",
        action="store_true",
        help="remove prepared files of other machine profiles and of models gone",
    )
    models.add_argument("--dry-run", action="store_true", help="with --prune: only list them")
    models.add_argument("files", nargs="*", metavar="GGUF", help="what these files need and whether they run")

    ask = command("ask", c("cmd_ask"), "ask one question and stream the reply to stdout")
    ask.add_argument("prompt", help="the question; '-' reads it from stdin")
    ask.add_argument(
        "-f", "--file", dest="files", action="append", default=[], metavar="FILE",
        help="attach a text file, inlined with its name before the question (repeatable; '-' reads stdin)",
    )
    where = ask.add_mutually_exclusive_group()
    where.add_argument("--session", metavar="ID", help="continue a stored session (id or unique prefix)")
    where.add_argument("--new-session", action="store_true", help="start a stored session (prints its id)")
    shape = ask.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="the reply is a JSON object (constrained)")
    shape.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid under this schema")
    add_sampling_options(ask)

    chat = command("chat", c("cmd_chat"), "chat in the terminal, line by line (Ctrl+D ends)")
    chat.add_argument("--session", metavar="ID", help="continue a stored session instead of starting one")
    add_sampling_options(chat)

    tui = command("tui", c("cmd_tui"), "the full-screen chat (what no command opens)")
    tui.add_argument("--session", metavar="ID", help="open this session (default: the last one)")

    sessions = sub.add_parser(
        "sessions",
        help="stored conversations: list, show, fork, rename, rm, search, gc, check",
        parents=[after],
        formatter_class=Help,
    )
    actions = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = command("list", s("list_sessions"), "newest first", actions)
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--limit", type=positive, metavar="N", help="the newest N (default: all)")
    listing.add_argument("--offset", type=natural, default=0, metavar="N", help="after the newest N")
    show = command("show", s("show_session"), "the messages of a session", actions)
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    fork = command("fork", s("fork_session"), "a new session sharing this one's messages and KV", actions)
    fork.add_argument("id")
    fork.add_argument(
        "--at", type=int, metavar="N", help="fork after message N, as `show` numbers them (default: the end)"
    )
    fork.add_argument("--title")
    rename = command("rename", s("rename_session"), "give a session a new title", actions)
    rename.add_argument("id")
    rename.add_argument("title")
    rm = command("rm", s("remove_session"), "delete a session (messages other sessions reach stay)", actions)
    rm.add_argument("id")
    command("search", s("search_sessions"), "full-text search over messages", actions).add_argument("text")
    check = command(
        "check",
        s("check_database_file"),
        "check the database file; recover what can be read if damaged",
        actions,
    )
    check.add_argument("-o", "--output", type=Path, metavar="FILE", help="recover into (default: beside it)")
    verify = command(
        "verify",
        c("verify_session"),
        "recompute an imported session's KV; blocks that match are shared from then on",
        actions,
    )
    verify.add_argument("id")
    add_context_option(verify)
    gc = command("gc", s("collect_garbage"), "drop stored KV no session needs", actions)
    gc.add_argument("--budget", type=int, metavar="MB", help="then keep at most this many MB of KV")

    tok = command("tokenize", c("cmd_tokenize"), "print the token ids of a text as JSON")
    tok.add_argument("text", help="the text; '-' reads it from stdin")
    tok.add_argument("--special", action="store_true", help="parse special tokens such as <|im_start|>")
    tok.add_argument("--bos", action="store_true", help="add the BOS token when the model uses one")

    bench = command("bench", c("cmd_bench"), "measure load, prefill and decode speed on the model")
    bench.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="few tokens, no first start nor `ask`: a smoke test, not a measurement",
    )

    export = command("export", s("cmd_export"), "write a session, with its KV, to a .llamachat file")
    export.add_argument("id", help="session id or unique prefix")
    export.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="a file or folder (default: <title>-<id>.llamachat in ~/Downloads, else in the data folder)",
    )
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
    export.add_argument("--force", action="store_true", help="overwrite the file if it exists")

    imp = command("import", s("cmd_import"), "add the session(s) of a .llamachat file; prints the new id")
    imp.add_argument("file", type=Path)

    serve = command(
        "serve", c("cmd_serve"), "an OpenAI-compatible HTTP server sharing one persistent KV cache"
    )
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1; others need --api-key)")
    serve.add_argument("--port", type=int, help="default 8080; 0 takes a free port (printed)")
    serve.add_argument("--parallel", type=int, metavar="N", help="replies decoded together (default 4)")
    serve.add_argument("--queue", type=int, metavar="N", help="requests waiting beyond those (default 64)")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        help="require 'Authorization: Bearer KEY' (or LLAMA_CHAT_API_KEY); several, or @FILE of "
        "name:key lines: one tenant each, with sessions and KV of its own",
    )
    serve.add_argument(
        "--allowed-host", action="append", metavar="NAME",
        help="also answer requests whose Host header names NAME (repeatable; '*' any): loopback names and "
        "the --host address are always answered",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000) call the API (repeatable); "
        "other pages are refused",
    )
    serve.add_argument(
        "--max-connections", type=int, metavar="N", help="connections open at once (default 256)"
    )
    serve.add_argument(
        "--drain-seconds", type=float, metavar="S",
        help="on SIGTERM, how long replies under way may take to finish before they are cut "
        "(default 30; 0: at once)",
    )
    add_context_option(serve)
    return parser


class _Lenient(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)  # the whole command line's parse says what is wrong


def use_threads(argv: list[str]) -> None:
    """--threads N, wherever it is on the command line, into the environment before NumPy loads:
    OpenBLAS and numba read their thread count once, when they load (the commands import them)."""
    early = _Lenient(add_help=False)
    add_threads_option(early)
    try:
        threads = early.parse_known_args(argv)[0].threads
    except ValueError:
        return
    if threads:
        for var in THREAD_VARIABLES:
            os.environ[var] = str(threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    use_threads(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.handler is None:  # no command: the full-screen chat on the default model
        args = parser.parse_args([*argv, "tui"])
    args.db = args.db or default_db_path()
    from llama_chat.inference import ModelError
    from llama_chat.storage import StoreError

    from .terminal import UsageError, escaped

    try:
        return args.handler(args) or 0
    except (ModelError, StoreError, UsageError) as e:
        print(f"llama-chat: error: {escaped(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
