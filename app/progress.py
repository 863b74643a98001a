"""Progress of long work on stderr (model assembly and load, a long prompt), drawn by rich.progress."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column


class ProgressBar:
    """Callable as progress(label, done, total): a line per step (label, bar, percent, time), the
    current one moving even while the work reports nothing; a total of 0 means not known. A label
    "step: detail" stays the same step as its detail changes. Draws on a
    terminal only: a file or a pipe gets nothing, so an error that follows stays one line."""

    def __init__(self, stream=None):
        self.console = Console(file=stream or sys.stderr)
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.label: str | None = None

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.console.is_terminal:
            return
        if self.progress is None:
            self.progress = Progress(
                SpinnerColumn(finished_text="✓"),
                # on a narrow terminal the label and the bar give way, never the percent sign
                TextColumn(
                    "{task.description}", table_column=Column(ratio=2, no_wrap=True, overflow="ellipsis")
                ),
                BarColumn(bar_width=None, table_column=Column(ratio=1)),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self.console,
                expand=True,
                redirect_stdout=False,  # a reply streams to stdout meanwhile
                redirect_stderr=False,
            )
            self.progress.start()
        step = label.split(": ")[0]  # "compiling kernels (…): 5 compiled" goes on one line as it counts
        if step != self.label:
            self.finish_step()
            self.task, self.label = self.progress.add_task(label, total=total or None), step
        self.progress.update(self.task, description=label, completed=done, total=total or None)

    def finish_step(self) -> None:
        """The step shown last stays on screen as done: a full bar and a tick."""
        if self.task is not None:
            task = next(t for t in self.progress.tasks if t.id == self.task)
            end = task.total or max(task.completed, 1)  # a step of unknown size ends full too
            self.progress.update(self.task, total=end, completed=end)

    def clear(self) -> None:
        """Erase every line drawn, so that what follows starts on a clean line."""
        if self.progress is not None:
            self.progress.live.transient = True
            self.progress.stop()
        self.progress, self.task, self.label = None, None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.finish_step()
            self.progress.stop()
        self.progress, self.task, self.label = None, None, None
