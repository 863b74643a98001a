"""A session's branch as a Markdown transcript, for people (not for re-import)."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

from .store import ChatStore


def markdown_transcript(store: ChatStore, session_id: str) -> str:
    """The session's branch as Markdown for people, with YAML front matter (not for re-import)."""
    session = store.get_session(session_id)
    messages = store.path(session.head_id)

    def when(ts: float) -> str:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")

    # JSON strings and objects are valid YAML scalars and flow mappings, with every escape YAML needs.
    front = {
        "title": session.title,
        "session": session.id,
        "model": session.model_name,
        "model_fingerprint": session.model_fingerprint,
        "created": when(session.created),
        "exported": when(time.time()),
        "system_prompt": session.system_prompt,
        "sampling": session.sampling,
        "messages": len(messages),
    }
    lines = ["---", *(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in front.items()), "---", ""]
    lines += [f"# {session.title}", ""]
    if session.system_prompt:
        lines += ["## System", "", session.system_prompt, ""]
    for m in messages:
        heading = f"## {m.role.capitalize()}" + (" (stopped)" if m.stopped else "")
        lines += [heading, ""]
        if m.reasoning:  # folded, as the app shows it
            lines += ["<details><summary>Thinking</summary>", "", *quoted(m.reasoning), "", "</details>", ""]
        lines += [close_fences(m.content), ""]
    return "\n".join(lines)


def quoted(text: str) -> list[str]:
    """Text as a Markdown block quote: a heading or an open fence it holds stays inside it."""
    return ["> " + line if line else ">" for line in close_fences(text).split("\n")]


FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")  # a code fence's line, as CommonMark reads it


def close_fences(text: str) -> str:
    """The text with the code block it leaves open (a reply stopped mid-block) closed, so that what
    follows it in a transcript is not read as code."""
    fence = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m is None:
            continue
        rest = line[m.end() :]
        if fence is None and not (m[1][0] == "`" and "`" in rest):  # backticks after ``` open no block
            fence = m[1]
        elif fence is not None and m[1][0] == fence[0] and len(m[1]) >= len(fence) and not rest.strip():
            fence = None
    return text if fence is None else text.rstrip("\n") + "\n" + fence


def export_markdown(store: ChatStore, session_id: str, path: str | Path) -> int:
    """Write markdown_transcript() to `path`, whole or not at all; returns its size in bytes."""
    from .exchange.writer import write_whole  # (the exchange loads the KV codecs: only when writing)

    return write_whole(Path(path), [markdown_transcript(store, session_id).encode()])
