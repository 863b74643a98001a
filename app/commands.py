"""The sub-commands that talk to the model: models, ask, chat, tokenize, bench, and the TUI's start."""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from pathlib import Path

from llama_chat.inference import KNOWN_MODELS, ModelError, constrain
from llama_chat.inference.catalog import chunk_files, model_path, model_status, recommended_sampling
from llama_chat.inference.errors import ContextFullError
from llama_chat.inference.support import gguf_needs
from llama_chat.storage import Session, StoreError
from llama_chat.storage.fragments import brief
from llama_chat.storage.remote import RemoteTierError

from .chat import build
from .chat.attachments import AttachmentError, read_attachment, with_attachments
from .chat.conversations import Conversation
from .chat.engine import ChatEngine, SavedReply
from .chat.replies import system_message
from .chat.sessions import Sessions
from .chat.settings import REPLY_SETTINGS, SAMPLING, TEMPLATE_SETTINGS, max_tokens, sampling_defaults
from .chat.titles import NEW_CHAT, title_from_text
from .chat_lines import PendingFiles, answer_calls, ask_yes, open_tools
from .commands_sessions import open_sessions, waiting_notice
from .flags import engine_options
from .progress import ProgressBar
from .signals import ReplySignals
from .terminal import UsageError, escaped, print_json, read_prompt, read_text, say, stream_reply


def cmd_models(args) -> int:
    if args.files:
        return print_needs(args)
    if args.prune or args.dry_run:
        return prune_prepared(args.dry_run)
    from llama_chat.inference.packed_file import holds_model, packed_path  # (numba: not for every command)

    statuses = []
    for model in KNOWN_MODELS.values():
        defaults = sampling_defaults(*recommended_sampling(model_path(model), {}))
        statuses.append(
            model_status(model)
            | {
                "packed": holds_model(model_path(model)),
                "packed_path": str(packed_path(model_path(model))),
                "sampling": defaults.values,
                "sampling_from": defaults.source,
                "system_prompt": model.system_prompt,
            }
        )
    if args.json:
        print_json(statuses)
        return 0
    for s in statuses:
        state = "verified" if s["verified"] else "assembled" if s["assembled"] else "not assembled"
        if not s["packages_installed"] and not s["assembled"]:
            state = "packages not installed"
        if s["packed"]:  # all a start reads is in its packed file
            state, s["path"] = "packed", s["packed_path"]
        print(f"{s['name']:40} {state:22} {s['path']}")
        print(f"  {s['description']}")
        sampling = ", ".join(f"{key} {value}" for key, value in s["sampling"].items() if value is not None)
        print(f"  sampling: {sampling} ({s['sampling_from']})")
        if s["system_prompt"]:
            print(f"  system prompt for new chats: {s['system_prompt']}")
    return 0


def prune_prepared(dry_run: bool) -> int:
    """`models --prune`: the prepared files no start here reads again (and the assembled files of models
    packed here), a line each, removed (or only listed); then the pip packages of assembled models not
    packed here, which only assemble them again."""
    from llama_chat.inference.prepared_files import remove, stale_files

    stale = stale_files()
    for f in stale:
        print(f"{f.bytes / 1e6:10,.1f} MB  {f.path}  ({f.why})")
    total = sum(f.bytes for f in stale) / 1e6
    if not stale:
        print("nothing to remove: every prepared file serves a model here")
    elif dry_run:
        print(f"would remove {len(stale)} file(s), {total:,.1f} MB (without --dry-run)")
    else:
        remove(stale)
        print(f"removed {len(stale)} file(s), {total:,.1f} MB")
    for model in KNOWN_MODELS.values():
        status = model_status(model)
        packed = model_path(model) in {f.path for f in stale}  # the packages are its one source then
        if status["verified"] and status["packages_installed"] and not packed:
            parts = sum(p.stat().st_size for p in chunk_files(model)) / 1e6
            print(
                f"{model.name}: its pip packages ({parts:,.1f} MB) only assemble it again: "
                f"{model.pip_uninstall()}"
            )
    return 0


def print_needs(args) -> int:
    """What each GGUF needs and whether it runs; 1 where one does not."""
    needs = [gguf_needs(Path(f)) for f in args.files]
    if args.json:
        print_json(needs)
    else:
        for n in needs:
            print(n["problem"] or f"{n['path']}: runs")
            print(
                f"  architecture: {n['architecture']}"
                f"{'' if n['architecture_supported'] else ' (not supported)'}"
            )
            print(f"  tokenizer: {n['tokenizer']}")
            for name, f in n["formats"].items():
                print(f"  {name}: {f['tensors']} matrices, {f['kept']}")
    return 1 if any(n["problem"] for n in needs) else 0


def open_model(args):
    with ProgressBar() as bar:
        return build.open_model(engine_options(args), bar)


def flag_settings(args, settings=(*SAMPLING, *TEMPLATE_SETTINGS)) -> dict:
    """The settings given as flags on this command line (a flag not given is None: not set); by
    default those a new session keeps: its sampling and its template's switches."""
    return {s.key: getattr(args, s.key) for s in settings if getattr(args, s.key) is not None}


def reply_settings(args, session: Session | None = None) -> dict:
    """A reply's settings: the session's stored ones, overridden by the flags given on this command line."""
    return {**(session.sampling if session else {}), **flag_settings(args, REPLY_SETTINGS)}


def verify_session(args) -> int:
    """`sessions verify`: the one sessions command that needs the model."""
    sessions = open_sessions(args)
    session = sessions.get(args.id)  # an unknown session fails before the model loads
    print(f"session {session.id}: {open_engine(args, sessions).verify(session).describe()}")
    return 0


def open_engine(args, sessions: Sessions | None = None) -> ChatEngine:
    """The chat engine of this command line's flags, on `sessions` (None: one that keeps nothing)."""
    given = {"sessions": sessions} if sessions else {"db": build.IN_MEMORY}
    options = engine_options(args, **given)
    try:
        with ProgressBar() as bar:
            return build.open_engine(options, bar)
    except RemoteTierError as e:  # a bad --kv-remote URL, a missing secret
        raise UsageError(str(e)) from None


def stored_reply(engine, sessions: Sessions, session: Session, text: str | None, args) -> tuple[Session, int]:
    """Stream a reply that is stored with its question; SIGINT, SIGTERM and SIGHUP stop it and keep it
    (see signals.py). Returns the session that now ends with it (a new branch when the session moved
    on meanwhile) and the exit code a signal asks for (0 if none came)."""
    saved = SavedReply()
    settings = reply_settings(args, session)
    with ReplySignals() as signals:
        sessions.on_wait = waiting_notice(sessions, signals)
        try:
            stream_reply_to(engine, session, text, args, settings, signals, saved=saved)
        finally:
            sessions.on_wait = waiting_notice(sessions)
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


def cmd_ask(args) -> int:
    prompt = question(args)
    if not (args.session or args.new_session):
        return ask_once(args, prompt)
    sessions = open_sessions(args)
    sessions.check_writable()  # a reply that could not be stored is not worth computing
    if args.session:
        session = sessions.get(args.session)  # an unknown session fails before the model loads
    engine = open_engine(args, sessions)
    # before the session is made or changed: a refused prompt leaves nothing behind
    if args.system is not None:
        system = args.system
    else:
        system = engine.system_prompt if args.new_session else session.system_prompt
    engine.check_message(system, prompt)
    if args.new_session:
        title = args.title or title_from_text(prompt)
        session = engine.new_session(title, args.system, flag_settings(args))
        print(f"session {session.id}", file=sys.stderr)
    elif args.system is not None:
        session = sessions.update(session.id, system_prompt=args.system)
    info = engine.resume(session)
    if info.tokens:
        print(f"[{info.describe()}]", file=sys.stderr)
    try:
        return stored_reply(engine, sessions, session, prompt, args)[1]
    finally:
        if args.new_session:
            forget_if_empty(sessions, session)


def question(args) -> str:
    """The question of `ask`, the files of `-f` before it; a file that cannot be attached is one line."""
    if [args.prompt, *args.files].count("-") > 1:
        raise UsageError("stdin can be read once: '-' as the prompt or as one -f, not both")
    prompt = read_prompt(args.prompt)
    try:
        return with_attachments(prompt, [read_attachment(path) for path in args.files])
    except AttachmentError as e:
        raise UsageError(str(e)) from None


def ask_once(args, prompt: str) -> int:
    """A one-off question: the reply streams, nothing is stored (the database is not opened)."""
    engine = open_engine(args)
    system = engine.system_prompt if args.system is None else args.system
    conversation = Conversation(system_message(system) + [{"role": "user", "content": prompt}])
    settings = reply_settings(args)
    try:
        with ReplySignals() as signals:
            stream_reply_to(engine, conversation, None, args, settings, signals, store=False)
    finally:
        engine.close()
    return signals.exit_code


def stream_reply_to(
    engine: ChatEngine, to, text: str | None, args, settings: dict, signals, **options
) -> None:
    """A reply (to a session's turn, or to a conversation) as this command line's flags and `settings`
    ask, streamed on the terminal; `signals` stop it."""
    job = engine.reply(
        to,
        text,
        settings=settings,
        grammar=reply_grammar(args, engine.model_info.tokenizer),
        max_tokens=max_tokens(settings),
        cancel=signals.cancel,
        **options,
    )
    stream_reply(job, signals, getattr(args, "show_thinking", False))


def reply_grammar(args, tokenizer) -> str | None:
    """`ask --json` / `--json-schema FILE` as the grammar a reply follows, compiled against the model's
    vocabulary (a schema that does not compile is a ModelError, one line)."""
    path = getattr(args, "json_schema", None)
    if path is None and not getattr(args, "json", False):
        return None
    schema = constrain.JSON_OBJECT_SCHEMA
    if path is not None:
        try:
            schema = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as e:
            raise ModelError(f"{path}: cannot be read: {getattr(e, 'strerror', None) or e}") from None
    try:
        return constrain.check_grammar(tokenizer, constrain.json_schema_grammar(schema))
    except constrain.GrammarError as e:
        raise ModelError(f"{path or '--json'}: {e}") from None


def forget_if_empty(sessions: Sessions, session: Session) -> None:
    """A session this command made for a reply that was not stored goes again: a failed command
    leaves nothing behind (where the disk lets us: on a full one, even a delete may fail)."""
    with contextlib.suppress(StoreError):
        if sessions.get(session.id).head_id is None:
            sessions.delete(session.id)


def cmd_chat(args) -> int:
    servers = user_config().mcp_servers  # a config.toml that cannot be used fails before the model loads
    sessions = open_sessions(args)
    sessions.check_writable()
    if args.session:
        sessions.get(args.session)  # an unknown session fails before the model loads
    engine = open_engine(args, sessions)
    tools = open_tools(engine, servers)  # before a session's KV is restored: its prompts offer them
    try:
        return chat_loop(engine, sessions, tools, args)
    finally:
        if tools is not None:
            tools.close()


def chat_loop(engine: ChatEngine, sessions: Sessions, tools, args) -> int:
    """The session of `chat` (resumed or new), then its lines until Ctrl+D."""
    if args.session:
        session = sessions.get(args.session)
        info = engine.resume(session)
        say(f"Resumed '{escaped(session.title)}' ({session.id}): {info.describe()}.")
        for m in sessions.messages(session)[-4:]:
            say(f"{m.role}: {brief(m.content)}")  # an attached file by its name
    else:
        # named by its first line
        session = engine.new_session(args.title or NEW_CHAT, args.system, flag_settings(args))
        print(f"New session {session.id} with {engine.model_info.name}.", file=sys.stderr)
    print("Ctrl+D ends, Ctrl+C stops a reply, /attach FILE attaches a file.", file=sys.stderr)
    files = PendingFiles()
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # as a shell's prompt: the line goes, the chat stays (pressed just
            say("\n(Ctrl+D ends the chat)")  # after a reply ended, it used to end the chat)
            continue
        if not line.strip() or files.command(line):
            continue
        try:
            session, code = stored_reply(engine, sessions, session, files.message(line), args)
        except ContextFullError as e:  # e.g. a file too long for the window: nothing was stored
            say(f"llama-chat: {e}")
            continue
        if tools is not None and not code:
            again = partial(stored_reply, engine, sessions, text=None, args=args)
            session, code = answer_calls(engine, sessions, session, tools, again, ask_yes)
        if code and code != 130:  # Ctrl+C stops the reply; SIGTERM and SIGHUP end the chat too
            return code


def user_config():
    """config.toml, for `chat`'s MCP servers; a file that cannot be used is one line."""
    from .config import ConfigError, UserConfig  # loads Textual's key names: only for `chat`

    try:
        return UserConfig.load()
    except ConfigError as e:
        raise UsageError(str(e)) from None


def cmd_tokenize(args) -> int:
    text = read_text(args.text)
    model = open_model(args)
    print_json(
        model.tokenizer.encode(text, add_bos=args.bos and model.tokenizer.add_bos, special=args.special)
    )
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_tui(args) -> int:
    from .tui import cmd_tui as run_app  # Textual is loaded only for the app

    return run_app(args)


def cmd_serve(args) -> int:
    from .serve.server import BindRefused, options_from, serve
    from .terminal import UsageError

    try:
        return serve(*options_from(args))
    except BindRefused as e:
        raise UsageError(str(e)) from None
