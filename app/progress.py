"""A one-line progress bar on stderr for long work (model assembly, model load)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """Callable as progress(label, done, total); redraws at most ten times a second."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.label = None
        self.last_draw = 0.0
        self.drawn = False

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if label == self.label and not finished and now - self.last_draw < 0.1:
            return
        if label != self.label and self.drawn:
            self.stream.write("\n")
        self.label, self.last_draw, self.drawn = label, now, True
        if total <= 0:
            self.stream.write(f"\r{label}")
        else:
            filled = int(self.width * done / total)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{label} [{bar}] {100 * done // total:3d}%")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar's line, so that what follows starts on a clean one."""
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self.drawn = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
