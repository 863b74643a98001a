"""The headless sub-commands: models, ask, chat, tokenize, sessions, bench, export, import."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from llama_chat.inference import (
    KNOWN_MODELS,
    GenerationStats,
    SamplingParams,
    chat_prompt_ids,
    load_model,
)
from llama_chat.inference.catalog import model_status
from llama_chat.storage import ChatStore, Session, StoreError

from .chat.engine import SavedReply, session_title
from .chat.jobs import Job, stream_text
from .chat.scheduler import Scheduler
from .cli import UsageError, print_json
from .progress import ProgressBar
from .signals import ReplySignals


def prefill_bar():
    """on_prefill for a terminal: a bar on stderr while a long prompt is read, erased before the reply."""
    if not sys.stderr.isatty():
        return None
    bar = ProgressBar()

    def report(done: int, total: int) -> None:
        bar("reading the prompt", done, total)
        if done >= total:
            bar.clear()

    return report


def cmd_models(args) -> int:
    statuses = [model_status(m) for m in KNOWN_MODELS.values()]
    if args.json:
        print_json(statuses)
        return 0
    for s in statuses:
        state = "verified" if s["verified"] else "assembled" if s["assembled"] else "not assembled"
        if not s["packages_installed"] and not s["assembled"]:
            state = "packages not installed"
        print(f"{s['name']:40} {state:22} {s['path']}")
        print(f"  {s['description']}")
    return 0


def open_model(args):
    with ProgressBar() as bar:
        return load_model(
            args.model, progress=bar, cache_ram_mb=args.cache_ram, prompt_lookup=not args.no_lookup
        )


def read_text(value: str) -> str:
    """The argument, or stdin for '-'; bytes that are not UTF-8 are refused here, before anything is
    stored (Python hands them on as lone surrogates, which SQLite and the tokenizer cannot take)."""
    where = "stdin" if value == "-" else "the argument"
    try:
        text = sys.stdin.read() if value == "-" else value
        text.encode("utf-8")
    except UnicodeError:
        raise UsageError(f"{where}: not UTF-8 text") from None
    return text


def read_prompt(value: str) -> str:
    """The text of a question: read_text's, and not empty (an empty turn is not a question)."""
    text = read_text(value)
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


SAMPLING_FLAGS = {
    "temperature": "temp",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "seed": "seed",
}


def sampling_settings(args, stored: dict | None = None) -> dict:
    """The session's stored settings, overridden by the flags given on this command line."""
    settings = {k: v for k, v in (stored or {}).items() if k in SAMPLING_FLAGS}
    settings.update(
        {k: getattr(args, flag) for k, flag in SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    )
    return settings


def print_stats(stats: GenerationStats, stop: str | None = None) -> None:
    say(
        f"[{stats.prompt_tokens} prompt tokens, {stats.prefilled_tokens} prefilled at {stats.prefill_tok_s:.1f} tok/s; "
        f"{stats.generated_tokens} generated at {stats.decode_tok_s:.1f} tok/s{lookup_text(stats)}; "
        f"stop: {stop or stats.stop_reason}]"
    )


def lookup_text(stats: GenerationStats) -> str:
    """How prompt lookup did, when it guessed anything: tokens drafted and accepted."""
    if not stats.drafted_tokens:
        return ""
    return f" ({stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted)"


def say(line: str) -> None:
    """A line on stderr, where a closed terminal (SIGHUP) must not turn a stored reply into a traceback."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def write(text: str) -> bool:
    """Text on stdout; False once no one reads it (a closed terminal or pipe)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except OSError:
        return False


def stream(job: Job) -> None:
    """Write a job's reply to stdout as it comes. However the writing ends (the reply's end, a cancel, a
    closed terminal, a second signal), the job is cancelled and waited for, so it keeps what it made;
    what it made beyond what was written is written then, so the stored reply is the one shown."""
    shown = 0
    try:
        for piece in stream_text(job, prefill_bar()):
            if not write(piece):
                break
            shown += len(piece)
    finally:
        if job.state.ended and len(job.text()) > shown:
            write(job.text()[shown:])
        write("\n")


def open_store(args) -> ChatStore:
    store = ChatStore(args.db)
    store.on_wait = waiting_notice(store)
    return store


def waiting_notice(store: ChatStore, signals: ReplySignals | None = None):
    """on_wait for the store: say once that another process holds the write lock; with `signals`
    (while a reply is stored), a signal during the wait gives up waiting."""
    seen = None

    def on_wait(waited: float) -> None:
        nonlocal seen
        if seen is None:
            seen = signals.count if signals else 0
            say(f"waiting for {store.db_path}: another process is writing to it (Ctrl+C gives up)")
        elif signals is not None and signals.count > seen:
            raise StoreError("stopped while waiting for it")

    return on_wait


def stored_reply(engine, session: Session, text: str | None, args) -> tuple[Session, int]:
    """Stream a reply that is stored with its question; SIGINT, SIGTERM and SIGHUP stop it and keep it
    (see signals.py). Returns the session that now ends with it (a new branch when the session moved
    on meanwhile) and the exit code a signal asks for (0 if none came)."""
    stats, saved = GenerationStats(), SavedReply()
    params = engine.sampling(session, **sampling_settings(args))
    with ReplySignals() as signals:
        engine.store.on_wait = waiting_notice(engine.store, signals)
        try:
            job = engine.submit_reply(
                session,
                text,
                sampling=params,
                max_tokens=args.max_tokens,
                cancel=signals.cancel,
                stats=stats,
                saved=saved,
            )
            stream(job)
        except KeyboardInterrupt:
            pass  # a second signal: whether the reply was stored is said below
        except StoreError:
            if signals.received is None:
                raise
            # a signal gave up waiting for the database: said below
        finally:
            engine.store.on_wait = waiting_notice(engine.store)
    print_stats(stats, signals.stop_reason(stats.stop_reason))
    if saved.session is None:
        say("llama-chat: the reply was not stored: stopped while it was being stored")
        return session, signals.exit_code or 130
    if saved.branched:
        say(
            f"session {session.id} moved on while this reply was written (another reply was stored in it): "
            f"stored on a new branch, session {saved.session.id}"
        )
    if saved.kv_skipped:
        say(f"(its KV cache was not saved: {saved.kv_skipped}; it is recomputed when needed)")
    return saved.session, signals.exit_code


def open_engine(args, store: ChatStore):
    from .chat.engine import ChatEngine

    model = open_model(args)
    return ChatEngine(model, store, n_ctx=args.ctx, remote=open_remote(args, model.fingerprint))


def open_remote(args, fingerprint: str):
    """The remote KV tier of --kv-remote, if one is named; a bad URL or a missing secret is one line."""
    if not args.kv_remote:
        return None
    from llama_chat.storage.remote import RemoteTier, RemoteTierError

    try:
        return RemoteTier.from_url(args.kv_remote, args.kv_secret, fingerprint)
    except RemoteTierError as e:
        raise UsageError(str(e)) from None


def cmd_ask(args) -> int:
    prompt = read_prompt(args.prompt)
    if not (args.session or args.new_session):  # a one-off question, nothing stored
        from .chat.engine import check_fits

        model = open_model(args)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = chat_prompt_ids(model, messages)
        n_ctx = min(args.ctx, model.config.n_ctx_train)
        check_fits(ids, n_ctx)
        job = Job(
            lambda: (ids, model.new_sequence(n_ctx)),
            sampling=SamplingParams(**sampling_settings(args)),
            max_tokens=args.max_tokens,
            finish=lambda job: [seq.free() for seq in job.seqs],
        )
        stream(Scheduler(model).submit(job))
        print_stats(job.stats[0])
        return 0
    store = open_store(args)
    store.check_writable()  # a reply that could not be stored is not worth computing
    if args.session:
        session = store.get_session(args.session)  # an unknown session fails before the model loads
    engine = open_engine(args, store)
    # before the session is made or changed: a refused prompt leaves nothing behind
    system = args.system if args.system is not None or args.new_session else session.system_prompt
    engine.check_message(system, prompt)
    if args.new_session:
        title = args.title or " ".join(prompt.split())[:60] or "New chat"
        session = engine.new_session(title, args.system, sampling_settings(args))
        print(f"session {session.id}", file=sys.stderr)
    elif args.system is not None:
        store.update_session(session.id, system_prompt=args.system)
        session = store.get_session(session.id)
    _, info = engine.open(session)
    if info.tokens:
        print(f"[{info.describe()}]", file=sys.stderr)
    try:
        return stored_reply(engine, session, prompt, args)[1]
    finally:
        if args.new_session:
            forget_if_empty(store, session)


def forget_if_empty(store: ChatStore, session: Session) -> None:
    """A session this command made for a reply that was not stored goes again: a failed command
    leaves nothing behind (where the disk lets us: on a full one, even a delete may fail)."""
    with contextlib.suppress(StoreError):
        if store.get_session(session.id).head_id is None:
            store.delete_session(session.id)


def cmd_chat(args) -> int:
    store = open_store(args)
    store.check_writable()
    if args.session:
        store.get_session(args.session)  # an unknown session fails before the model loads
    engine = open_engine(args, store)
    if args.session:
        session = engine.store.get_session(args.session)
        _, info = engine.open(session)
        print(f"Resumed '{session.title}' ({session.id}): {info.describe()}.", file=sys.stderr)
        for m in engine.store.path(session.head_id)[-4:]:
            print(f"{m.role}: {m.content}", file=sys.stderr)
    else:
        session = engine.new_session(args.title or "Terminal chat", args.system, sampling_settings(args))
        print(f"New session {session.id} with {engine.model.name}.", file=sys.stderr)
    print("Ctrl+D ends, Ctrl+C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        session, code = stored_reply(engine, session, line, args)
        if code and code != 130:  # Ctrl+C stops the reply; SIGTERM and SIGHUP end the chat too
            return code


def cmd_tokenize(args) -> int:
    text = read_text(args.text)
    model = open_model(args)
    print_json(
        model.tokenizer.encode(text, add_bos=args.bos and model.tokenizer.add_bos, special=args.special)
    )
    return 0


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def cmd_sessions(args) -> int:
    action = args.action
    if action == "check":  # before opening the database: a damaged one is not opened at all
        return check_database_file(args.db, args.output)
    store = open_store(args)
    if action == "list":
        sessions = store.list_sessions()
        if args.json:
            print_json([s.to_json() for s in sessions])
        for s in sessions if not args.json else []:
            fork = f"  (fork of {s.forked_from})" if s.forked_from else ""
            print(f"{s.id}  {when(s.updated)}  {s.n_tokens:>6} tok  {s.title}{fork}")
    elif action == "show":
        session = store.get_session(args.id)
        messages = store.path(session.head_id)
        if args.json:
            print_json({**session.to_json(), "messages": [asdict(m) for m in messages]})
            return 0
        print(f"{session.title} ({session.id}, {session.model_name or 'no model yet'})")
        if session.system_prompt:
            print(f"  system: {session.system_prompt}")
        for m in messages:
            print(f"  [{m.id}] {m.role}: {m.content}")
    elif action == "fork":
        title = session_title(args.title) if args.title else None
        child = store.fork_session(store.get_session(args.id).id, args.at, title)
        print(child.id)
    elif action == "rename":
        store.rename_session(store.get_session(args.id).id, session_title(args.title))
    elif action == "rm":
        session = store.get_session(args.id)
        removed = store.delete_session(session.id)
        print(f"deleted session {session.id} and {removed} message(s) only it reached")
    elif action == "search":
        for session, message in store.search(args.text):
            print(f"{session.id}  {session.title}  [{message.id}] {message.role}: {message.content[:100]}")
    elif action == "verify":
        session = store.get_session(args.id)  # an unknown session fails before the model loads
        print(f"session {session.id}: {open_engine(args, store).verify(session).describe()}")
    elif action == "gc":
        budget = None if args.budget is None else args.budget * 2**20
        result = store.gc(budget)
        print(
            f"removed {result['blocks_removed']} block(s), {result['bytes_freed'] / 2**20:.1f} MB; "
            f"{result['blocks']} block(s), {result['bytes'] / 2**20:.1f} MB kept"
        )
    return 0


def check_database_file(db: Path, out: Path | None) -> int:
    """`sessions check`: 0 when the file is sound; 1 when damaged, with what could be read recovered."""
    from llama_chat.storage.repair import check_database

    report = check_database(db, out)
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


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_export(args) -> int:
    from llama_chat.storage.exchange import (
        SUFFIX,
        default_file_name,
        export_markdown,
        export_session,
        markdown_transcript,
    )

    store = ChatStore(args.db)
    session = store.get_session(args.id)
    # a transcript is text for people: to the terminal (or a pipe) unless -o names a file
    to_stdout = str(args.output) == "-" or (args.markdown and args.output is None)
    if args.markdown and (args.tree or args.codec):
        raise StoreError("--markdown writes one branch as text: --tree and --codec do not apply")
    if to_stdout and not args.markdown:
        raise StoreError("a .llamachat file is binary: give -o FILE (only --markdown goes to stdout)")
    if args.markdown and to_stdout:
        sys.stdout.write(markdown_transcript(store, session.id))
        return 0
    name = default_file_name(session, ".md" if args.markdown else SUFFIX)
    out = args.output or Path(name)
    if out.is_dir():
        out = out / name
    if args.markdown:
        export_markdown(store, session.id, out)
        print(out)
        return 0
    with ProgressBar() as bar:
        summary = export_session(
            store, session.id, out, with_kv=args.with_kv, codec=args.codec, tree=args.tree, progress=bar
        )
    print(summary.describe(), file=sys.stderr)
    print(out)
    return 0


def model_here(args) -> tuple[str | None, str | None]:
    """The fingerprint of the model this command line chats with (--model, or the default), read
    without building a model; (None, why) when there is no usable one."""
    from llama_chat.inference import ModelError, resolve_model
    from llama_chat.inference.weights import model_info

    try:
        with ProgressBar() as bar:  # draws only when the model must first be assembled or read
            return model_info(resolve_model(args.model, bar), bar).fingerprint, None
    except ModelError as e:
        return None, str(e)


def cmd_import(args) -> int:
    from llama_chat.storage.exchange import import_session, read_session_file

    with ProgressBar() as bar:
        exported = read_session_file(args.file, progress=bar)  # checked whole before the database opens
    fingerprint, why = model_here(args) if exported.has_kv else (None, None)
    store = ChatStore(args.db)
    try:
        result = import_session(store, exported, model_fingerprint=fingerprint)
    finally:
        store.close()
    print(result.describe(), file=sys.stderr)
    if why and result.kv == "recompute":
        print(f"(no usable model here: {why})", file=sys.stderr)
    print("\n".join(result.session_ids))
    return 0
