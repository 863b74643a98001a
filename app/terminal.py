"""The terminal side of the headless commands: input checked before use, a reply streamed with its stats."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import TYPE_CHECKING

from llama_chat.storage import StoreError

if TYPE_CHECKING:  # (what a reply needs loads with the reply: `sessions list` prints text only)
    from llama_chat.inference import GenerationStats

    from .chat.jobs import JobView
    from .signals import ReplySignals


class UsageError(Exception):
    """Input on the command line or stdin that cannot be used (empty, not UTF-8): one line, exit 2."""


# The characters a terminal obeys instead of showing: C0 (ESC starts `ESC ] 0 ; title BEL`, which sets the
# window's title, and `ESC [ 2 J`, which clears the screen), DEL, and C1 (U+009B and U+009D are CSI and
# OSC on their own).
_CONTROLS = (*range(0x20), 0x7F, *range(0x80, 0xA0))
_AS_LINE = {c: f"\\x{c:02x}" for c in _CONTROLS}
_AS_TEXT = {c: e for c, e in _AS_LINE.items() if chr(c) not in "\n\t"}
_AS_JSON = {c: f"\\u{c:04x}" for c in _CONTROLS if c >= 0x7F}  # json.dumps escapes C0 but not these


def escaped(text: str, lines: bool = False) -> str:
    """Text this program did not write (a title, a message, a name, an error naming either) as it is
    printed on a terminal: each control character as `\\xNN`, so none moves the cursor, clears the
    screen or sets the window's title. `lines`: newlines and tabs kept (a message's body)."""
    return text.translate(_AS_TEXT if lines else _AS_LINE)


def on_stdout(text: str) -> str:
    """Text (a reply, a transcript) as it goes to stdout: escaped() where that is a terminal, exactly
    as it is into a pipe or a file (JSON a reply wrote may hold a carriage return)."""
    return escaped(text, lines=True) if sys.stdout.isatty() else text


def print_json(value) -> None:
    print(json.dumps(value, ensure_ascii=False).translate(_AS_JSON))


def say(line: str) -> None:
    """A line on stderr, where a closed terminal (SIGHUP) must not turn a stored reply into a traceback."""
    with contextlib.suppress(OSError):
        print(escaped(line, lines=True), file=sys.stderr, flush=True)


def write(text: str) -> bool:
    """A reply's text on stdout (on_stdout); False once no one reads it (a closed terminal or pipe)."""
    try:
        sys.stdout.write(on_stdout(text))
        sys.stdout.flush()
        return True
    except OSError:
        return False


def write_err(text: str) -> None:
    """Text as it comes (a reply's thinking) on stderr, escaped there as on_stdout() escapes stdout's."""
    with contextlib.suppress(OSError):
        sys.stderr.write(escaped(text, lines=True) if sys.stderr.isatty() else text)
        sys.stderr.flush()


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


def prefill_bar():
    """on_prefill for a terminal: a bar on stderr while a long prompt is read, erased before the reply."""
    if not sys.stderr.isatty():
        return None
    from .progress import ProgressBar

    bar = ProgressBar()

    def report(done: int, total: int) -> None:
        bar("reading the prompt", done, total)
        if done >= total:
            bar.clear()

    return report


def stream_reply(job: JobView, signals: ReplySignals, show_thinking: bool = False) -> None:
    """One reply on the terminal: a bar on stderr while its prompt is read, its answer on stdout as it
    comes (its thinking on stderr, with `show_thinking`; else not at all), then a line of stats on
    stderr. The job should stop at `signals.cancel`. However the writing ends (the reply's end, a
    cancel, a closed terminal, a second signal), the job is cancelled and waited for, so it keeps what
    it made; what it made beyond what was written is written then, so a stored reply is the one shown."""
    from .chat.jobs import stream_text

    shown, thinking = 0, [False]  # thinking: its line on stderr is open

    def think(text: str) -> None:
        thinking[0] = True
        write_err(text)

    def end_thinking() -> None:
        if thinking[0]:
            thinking[0] = False
            write_err("\n")

    try:
        try:
            for piece in stream_text(job, prefill_bar(), think if show_thinking else None):
                end_thinking()
                if not write(piece):
                    break
                shown += len(piece)
        finally:
            end_thinking()
            if job.state.ended and len(job.text()) > shown:
                write(job.text()[shown:])
            write("\n")
    except KeyboardInterrupt:
        pass  # a second signal: the caller says what became of the reply
    except StoreError:
        if signals.received is None:
            raise
        # a signal gave up waiting for the database: the caller says what became of the reply
    stats = job.stats[0]
    print_stats(stats, signals.stop_reason(stats.stop_reason))


def print_stats(stats: GenerationStats, stop: str | None = None) -> None:
    # a rate only where there was something to time: one token comes with the prompt, none is decoded
    prefill = f" at {stats.prefill_tok_s:.1f} tok/s" if stats.prefill_tok_s else ""
    decode = f" at {stats.decode_tok_s:.1f} tok/s" if stats.decode_tok_s else ""
    say(
        f"[{stats.prompt_tokens} prompt tokens, {stats.prefilled_tokens} prefilled{prefill}; "
        f"{stats.generated_tokens} generated{decode}{lookup_text(stats)}; "
        f"stop: {stop or stats.stop_reason}]"
    )


def lookup_text(stats: GenerationStats) -> str:
    """How prompt lookup did, when it guessed anything: tokens drafted and accepted."""
    if not stats.drafted_tokens:
        return ""
    return f" ({stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted)"
