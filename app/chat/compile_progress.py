"""What a start says while the compiled kernels are made ready: numba's own compile events tell it.

The steps that make kernels ready (inference's and the KV codec's compile_kernels) report a step per
format, and on a first start one format's step compiles nearly everything: a minute at 0 %. Their label
guesses from the cache whether they compile. numba knows: it announces each kernel (each signature) it
compiles, and nothing for code it loads from its cache.
"""

from __future__ import annotations

from collections.abc import Callable

from numba.core import event

Progress = Callable[[str, int, int], None]

# a first start's compiling on 2 cores (13 s quiet, more when busy); later starts load it
ESTIMATE = "10–60 s, once"


def kernel_step(label: str) -> str | None:
    """What a step makes ready ("kernels", "the KV codec"), if it is one that may compile; else None.
    Its label may name a part after a colon ("compiling kernels (first start only): Q4_K weights")."""
    head = label.split(": ")[0].removesuffix(" (first start only)")
    for what in ("kernels", "the KV codec"):
        if head.startswith(("compiling", "loading")) and head.endswith(what):
            return what
    return None


class CompileProgress(event.Listener):
    """progress(label, done, total) around another: a step that makes kernels ready is shown as what
    happens — "loading compiled kernels" while nothing compiles, else "compiling kernels (about a minute,
    once): N compiled", told again as each kernel is compiled, with a bar of unknown length (it moves).
    Other steps pass as they are. Use as a context manager: it listens to numba while open."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.step: tuple[str, int, int] | None = None
        self.started = self.compiled = 0  # compiles begun and ended in this step

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.step is None or self.step[0] != label:
            self.started = self.compiled = 0
        self.step = (label, done, total)
        if kernel_step(label) is None or done or self.started:
            # (a kernel step's start is not: the first compile, or the next format, tells which it is)
            self.show()

    def show(self) -> None:
        label, done, total = self.step
        what = kernel_step(label)
        if what is None:
            compiling = f" (compiling, {ESTIMATE}: {self.compiled} compiled)" if self.started else ""
            self.progress(label + compiling, *((0, 0) if compiling else (done, total)))
        elif self.started:
            self.progress(f"compiling {what} ({ESTIMATE}): {self.compiled} compiled", 0, 0)
        else:
            self.progress(f"loading compiled {what}" if what == "kernels" else f"loading {what}", done, total)

    # numba's events, on the thread that compiles
    def on_start(self, _event) -> None:
        self.started += 1
        if self.step is not None and self.started == 1:
            self.show()

    def on_end(self, _event) -> None:
        self.compiled += 1
        if self.step is not None:
            self.show()

    def __enter__(self) -> CompileProgress:
        event.register("numba:compile", self)
        return self

    def __exit__(self, *exc) -> None:
        event.unregister("numba:compile", self)
