"""The sub-commands on stored conversations: `sessions …` (list, show, fork, rename, rm, search, gc,
check; verify, which needs the model, is in commands.py), and export and import of .llamachat files."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING

from llama_chat.storage import ChatStore, StoreError

from .chat import sessions as chat_sessions  # (its file readers load on first use)
from .chat.sessions import Sessions, export_file_name
from .terminal import escaped, on_stdout, print_json, say

if TYPE_CHECKING:
    from .signals import ReplySignals

# What a reply needs (the model, its kernels), the app's settings (Textual) and progress bars (Rich)
# load with the commands that use them: listing, reading and searching chats take a fraction of a
# second, on an archive of any size.


def open_sessions(args) -> Sessions:
    """The conversations of --db, saying so while another process holds them; a file an older
    llama-chat wrote is upgraded, with a progress bar."""
    bars = []  # made (Rich loaded) only where an upgrade tells its progress
    with contextlib.ExitStack() as done:

        def progress(label: str, step: int, total: int) -> None:
            if not bars:
                from .progress import ProgressBar

                bars.append(done.enter_context(ProgressBar()))
            bars[0](label, step, total)

        sessions = Sessions(args.db, progress)
    sessions.on_wait = waiting_notice(sessions)
    return sessions


def waiting_notice(store: ChatStore | Sessions, signals: ReplySignals | None = None):
    """on_wait for the conversations: say once that another process holds the write lock; with `signals`
    (while a reply is stored), a signal during the wait gives up waiting."""
    seen = None

    def on_wait(waited: float) -> None:
        nonlocal seen
        if seen is None:
            seen = signals.count if signals else 0
            say(f"waiting for {store.db_path}: another process is writing to it (Ctrl+C gives up)")
        elif signals is not None and signals.count > seen:
            raise StoreError("stopped while waiting for it")  # on the scheduler's thread: the job fails

    return on_wait


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def list_sessions(args) -> int:
    sessions = open_sessions(args).list(limit=args.limit, offset=args.offset)
    if args.json:
        print_json([s.to_json() for s in sessions])
        return 0
    if sessions:
        print(f"{'ID':12}  {'UPDATED':16}  {'TOKENS':>6}  TITLE")
    for s in sessions:
        fork = f"  (fork of {s.forked_from})" if s.forked_from else ""
        api = "  (API)" if s.origin == "api" else ""
        print(f"{s.id}  {when(s.updated)}  {s.n_tokens:>6}  {escaped(s.title)}{fork}{api}")
    return 0


def show_session(args) -> int:
    session, messages = open_sessions(args).read(args.id)
    if args.json:
        print_json({**session.to_json(), "messages": [asdict(m) for m in messages]})
        return 0
    print(escaped(f"{session.title} ({session.id}, {session.model_name or 'no model yet'})"))
    if session.system_prompt:
        print(f"  system: {escaped(session.system_prompt, lines=True)}")
    for number, m in enumerate(messages, 1):  # numbered in the conversation, as `fork --at` takes them
        stopped = " [stopped]" if (m.stats or {}).get("stop_reason") == "cancelled" else ""
        print(f"  [{number}] {escaped(m.role)}: {escaped(m.content, lines=True)}{stopped}")
    return 0


def fork_session(args) -> int:
    sessions = open_sessions(args)
    session, messages = sessions.read(args.id)
    at = None
    if args.at is not None:
        if not 1 <= args.at <= len(messages):
            raise StoreError(f"session {session.id} has messages 1 to {len(messages)}, not {args.at}")
        at = messages[args.at - 1].id
    print(sessions.fork(session, at, args.title).id)
    return 0


def rename_session(args) -> int:
    sessions = open_sessions(args)
    sessions.rename(sessions.get(args.id).id, args.title)
    return 0


def remove_session(args) -> int:
    sessions = open_sessions(args)
    session = sessions.get(args.id)
    removed = sessions.delete(session.id)
    print(f"deleted session {session.id} and {removed} message(s) only it reached")
    return 0


def search_sessions(args) -> int:
    """A line per match: the session, the message's number in it, and the text around the words."""
    sessions = open_sessions(args)
    found = sessions.search(args.text)
    if not found:
        print(f"nothing found for {escaped(repr(args.text))}", file=sys.stderr)
        return 1
    for session, message in found:
        number = next(i for i, m in enumerate(sessions.messages(session), 1) if m.id == message.id)
        found_at = f"[{number}] {message.role}: {snippet(message.content, args.text)}"
        print(f"{session.id}  {escaped(session.title)}  {escaped(found_at)}")
    return 0


def snippet(text: str, query: str, width: int = 100) -> str:
    """One line of `text` around the first word of `query` it holds (code fences and newlines gone)."""
    line = " ".join(text.replace("```", " ").split())
    words = [w.lower() for w in query.split()]
    at = min((i for i in (line.lower().find(w) for w in words) if i >= 0), default=0)
    start = max(0, at - width // 3)
    cut = line[start : start + width]
    return ("…" if start else "") + cut + ("…" if start + width < len(line) else "")


def collect_garbage(args) -> int:
    budget = None if args.budget is None else args.budget * 2**20
    result = open_sessions(args).collect_garbage(budget)
    print(
        f"removed {result['blocks_removed']} block(s), {result['bytes_freed'] / 2**20:.1f} MB; "
        f"{result['blocks']} block(s), {result['bytes'] / 2**20:.1f} MB kept"
    )
    return 0


def check_database_file(args) -> int:
    """`sessions check`: 0 when the file is sound; 1 when damaged, with what could be read recovered.
    The database is not opened as a store: a damaged one is only read."""
    from llama_chat.storage.repair import check_database

    db = args.db
    report = check_database(db, args.output)
    if not report.problems:
        print(f"{db}: ok (integrity check passed)")
        return 0
    for problem in report.problems[:10]:
        print(f"{db}: damaged: {problem}")
    print(
        f"recovered {report.sessions} session(s), {report.messages} message(s) into {report.recovered_to}, "
        f"by {report.method}; the damaged file was left as it was"
    )
    return 1


def cmd_export(args) -> int:
    from .config import export_dir
    from .progress import ProgressBar

    sessions = Sessions(args.db)
    session = sessions.get(args.id)
    # a transcript is text for people: to the terminal (or a pipe) unless -o names a file
    to_stdout = str(args.output) == "-" or (args.markdown and args.output is None)
    if args.markdown and (args.tree or args.codec):
        raise StoreError("--markdown writes one branch as text: --tree and --codec do not apply")
    if to_stdout and not args.markdown:
        raise StoreError("a .llamachat file is binary: give -o FILE (only --markdown goes to stdout)")
    if args.markdown and to_stdout:
        sys.stdout.write(on_stdout(sessions.transcript(session.id)))
        return 0
    name = export_file_name(session, args.markdown)
    out = args.output or export_dir() / name
    if out.is_dir():
        out = out / name
    if out.exists() and not args.force:
        raise StoreError(f"{out}: already exists; --force overwrites it")
    out.parent.mkdir(parents=True, exist_ok=True)  # (the default folder, the first time)
    if args.markdown:
        sessions.export_markdown(session.id, out)
        print(out)
        return 0
    with ProgressBar() as bar:
        summary = sessions.export(
            session.id, out, with_kv=args.with_kv, codec=args.codec, tree=args.tree, progress=bar
        )
    print(summary.describe(), file=sys.stderr)
    print(out)
    return 0


def model_here(args) -> tuple[str | None, str | None]:
    """The fingerprint of the model this command line chats with (--model, or the default), read
    without building a model; (None, why) when there is no usable one."""
    from llama_chat.inference import ModelError, locate_model
    from llama_chat.inference.weights import model_info

    from .progress import ProgressBar

    try:
        with ProgressBar() as bar:  # draws only when the model must first be assembled or read
            return model_info(locate_model(args.model, bar), bar).fingerprint, None
    except ModelError as e:
        return None, str(e)


def cmd_import(args) -> int:
    from .progress import ProgressBar

    with ProgressBar() as bar:
        # checked whole before the database opens
        exported = chat_sessions.read_session_file(args.file, progress=bar)
    fingerprint, why = model_here(args) if exported.has_kv else (None, None)
    sessions = Sessions(args.db)
    try:
        result = sessions.import_file(exported, model_fingerprint=fingerprint)
    finally:
        sessions.close()
    print(result.describe(), file=sys.stderr)
    if why and result.kv == "recompute":
        print(f"(no usable model here: {why})", file=sys.stderr)
    print("\n".join(result.session_ids))
    return 0
