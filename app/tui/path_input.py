"""A box for a file's path (attach, import, export): completed as it is typed, the rest of the name
shown dimmed and taken with Tab (or →), as a shell completes one; what it starts with is not selected,
so typing goes on from the folder it shows."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from textual.actions import SkipAction
from textual.binding import Binding
from textual.suggester import Suggester
from textual.widgets import Input


def completions(value: str) -> list[str]:
    """`value` completed by each entry of its folder whose name starts with its last part, a folder's
    with "/" after it, sorted; hidden entries only when that part starts with "."."""
    folder, slash, start = value.rpartition(os.sep)
    try:
        with os.scandir(Path(folder + slash or ".").expanduser()) as entries:
            names = [
                entry.name + (os.sep if entry.is_dir() else "")
                for entry in entries
                if entry.name.startswith(start) and (start.startswith(".") or not entry.name.startswith("."))
            ]
    except OSError:  # no such folder (yet), or not one we may read: nothing to offer
        return []
    return sorted(value + name[len(start) :] for name in names)


def complete_path(value: str) -> str | None:
    """`value` completed as far as every entry it may name agrees (the one entry, or their common
    beginning), else to the first of them; None when there is nothing to add."""
    if not value:
        return None
    found = completions(value)
    if not found:
        return None
    common = os.path.commonprefix(found)
    completed = common if len(common) > len(value) else found[0]
    return completed if completed != value else None


class PathSuggester(Suggester):
    """Suggests complete_path's completion, read off the UI thread (a folder on a slow disk)."""

    def __init__(self):
        super().__init__(use_cache=False, case_sensitive=True)  # the folder changes; names are exact

    async def get_suggestion(self, value: str) -> str | None:
        return await asyncio.to_thread(complete_path, value)


class PathInput(Input):
    """A path: the completion shown as it is typed, Tab takes it; the value it starts with is not
    selected, the cursor after it."""

    BINDINGS = [Binding("tab", "complete", "Complete the path", id="complete_path", show=False)]

    def __init__(self, value: str = "", **kwargs):
        super().__init__(value, suggester=PathSuggester(), select_on_focus=False, **kwargs)

    def on_mount(self) -> None:
        self.cursor_position = len(self.value)

    def action_complete(self) -> None:
        """Tab: the path completed (nothing to complete: Tab moves on, as elsewhere)."""
        completed = complete_path(self.value)
        if completed is None:
            raise SkipAction()
        self.value = completed
        self.cursor_position = len(completed)
