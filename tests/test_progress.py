"""The progress lines on stderr: whole on a narrow terminal, and nothing at all in a file or a pipe."""

from __future__ import annotations

import io
import re

from llama_chat.app.chat.compile_progress import ESTIMATE
from llama_chat.app.progress import ProgressBar

LONG_LABEL = "assembling " + "qwen2.5-coder-0.5b-instruct-q4_k_m-" * 3 + ".gguf"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen_lines(output: str) -> list[str]:
    """What was written, without the escape sequences that move the cursor and colour the text."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output)
    return [line for line in re.split(r"[\r\n]", plain) if line.strip()]


def test_each_step_fits_a_narrow_terminal_with_its_percent(monkeypatch):
    monkeypatch.setenv("COLUMNS", "48")
    terminal = Terminal()
    with ProgressBar(terminal) as bar:
        bar(LONG_LABEL, 0, 1000)
        bar(LONG_LABEL, 1000, 1000)
        bar("preparing weights", 3, 0)  # a step whose size is not known
    lines = screen_lines(terminal.getvalue())
    assert lines and all(len(line) <= 48 for line in lines)  # nothing wraps or is cut by the terminal
    assert any(
        line.startswith("✓ assembling qwen") and " 100% " in line for line in lines
    )  # the label gave way
    assert "preparing weights" in lines[-1] and " 100% " in lines[-1]  # shown as done when it ended


def test_a_step_that_counts_stays_on_its_line():
    terminal = Terminal()
    with ProgressBar(terminal) as bar:
        for n in range(3):
            bar(f"compiling kernels ({ESTIMATE}): {n} compiled", 0, 0)
        bar("loading the KV codec", 3, 3)
        steps = [task.description for task in bar.progress.tasks]  # a line each on the screen
    assert steps == [f"compiling kernels ({ESTIMATE}): 2 compiled", "loading the KV codec"]


def test_nothing_is_drawn_into_a_file_or_a_pipe():
    log = io.StringIO()
    with ProgressBar(log) as bar:
        bar(LONG_LABEL, 500, 1000)
        bar.clear()
        bar("reading the prompt", 512, 1024)
    assert log.getvalue() == ""


# -- making the kernels ready: what numba really does, as it does it -----------------------------------


def test_a_warm_start_says_it_loads_and_a_first_start_counts_what_it_compiles():
    import numba

    from llama_chat.app.chat.compile_progress import CompileProgress

    shown = []
    with CompileProgress(lambda *step: shown.append(step)) as progress:
        progress("compiling kernels (first start only)", 0, 4)  # the cache's guess: nothing compiles here
        progress("compiling kernels (first start only)", 1, 4)
        assert shown == [("loading compiled kernels", 1, 4)]  # (not at 0: a compile may begin first)
        progress("compiling the KV codec (first start only)", 3, 3)
        assert shown[-1] == ("loading the KV codec", 3, 3)

        progress("compiling kernels (first start only)", 0, 4)
        numba.njit(lambda x: x + 1)(1)  # a kernel no cache holds: numba compiles it now
        numba.njit(lambda x: x * 2.0)(1.0)
    compiling = [label for label, done, total in shown if label.startswith("compiling") and total == 0]
    assert compiling[0] == f"compiling kernels ({ESTIMATE}): 0 compiled"  # at once, not after it
    assert f"compiling kernels ({ESTIMATE}): 2 compiled" in compiling  # it moves per kernel
    count = len(shown)
    numba.njit(lambda x: x - 1)(1)  # after the load: nobody is told
    assert len(shown) == count


def test_a_start_that_compiles_nothing_never_says_compiling(monkeypatch):
    """The kernels' own step guesses from the cache, per part ("compiling kernels (first start only):
    unpacking"), and guessed "compiling" on every start while one kernel was never cached (the attention
    of a process that ended before its thread compiled it): what numba does is what is shown."""
    from llama_chat.app.chat.compile_progress import CompileProgress
    from llama_chat.inference import warmup

    warmup.compile_kernels()  # compiled or loaded now: the start below compiles nothing
    monkeypatch.setattr(warmup, "in_cache", lambda kernel: False)  # the cache's guess: everything compiles
    shown = []
    with CompileProgress(lambda *step: shown.append(step[0])) as progress:
        warmup.compile_kernels(progress)
    assert shown and not [label for label in shown if label.startswith("compiling")]
    assert "loading compiled kernels" in shown
