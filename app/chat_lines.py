"""What `chat` does besides sending a line: `/attach FILE`, and the tool calls of the MCP servers in
config.toml — each shown and run only when the user answers y, its answer shown (its first lines) and
stored as a tool message."""

from __future__ import annotations

import shlex
from collections.abc import Callable

from llama_chat.storage import Session

from .chat.attachments import Attachment, AttachmentError, read_attachment, with_attachments
from .chat.mcp_tools import MAX_TOOL_ROUNDS, MCPTools, shown, start_tools
from .chat.sessions import Sessions
from .terminal import escaped, say, write

RESULT_LINES = 6  # of a tool's answer, shown in `chat` after a y: the model reads all of it
RESULT_WIDTH = 160  # characters of each line shown


class PendingFiles:
    """The files `/attach` named, sent with the next message."""

    def __init__(self) -> None:
        self.files: list[Attachment] = []

    def command(self, line: str) -> bool:
        """Handle `/attach FILE...` (quotes for names with spaces); False for any other line."""
        if line.split(maxsplit=1)[:1] != ["/attach"]:
            return False
        try:
            paths = shlex.split(line)[1:]
        except ValueError as e:
            say(f"/attach: {e}")
            return True
        if not paths:
            say("/attach FILE...: attach text files to your next message")
        for path in paths:
            if path == "-":
                say("/attach: stdin is where the chat reads your lines; give a file's path")
                continue
            try:
                attachment = read_attachment(path)
            except AttachmentError as e:
                say(str(e))
                continue
            self.files.append(attachment)
            say(f"attached {path} ({len(attachment.text):,} characters): it goes with your next message")
        return True

    def message(self, text: str) -> str:
        """The next message: the files attached since the last one, then the text."""
        files, self.files = self.files, []
        return with_attachments(text, files)


def open_tools(engine, servers: dict) -> MCPTools | None:
    """start_tools, each server's line said on stderr."""
    tools, lines = start_tools(engine, servers)
    for line in lines:
        say(line)
    return tools


def answer_calls(
    engine, sessions: Sessions, session: Session, tools: MCPTools,
    reply: Callable[[Session], tuple[Session, int]], confirm: Callable[[str], bool],
) -> tuple[Session, int]:
    """While the session's last reply (read in `sessions`) calls tools: each call shown and, if
    confirm(question) says so, run; its answer (or why there is none) stored as a tool message (the
    engine's answer_tool); then the model replies again —
    unless the user declined every call: then the user's next message comes first (a small model
    asks again and again). Returns the session and the exit code reply() asked for (0: none)."""
    for _ in range(MAX_TOOL_ROUNDS):
        head = sessions.message(session.head_id)
        calls = tools.calls_in(head.content) if head.role == "assistant" else []
        if not calls:
            return session, 0
        ran = 0
        for call in calls:
            confirmed = confirm(f"run the tool call {shown(call)}? [y/N] ")
            answer, problem = tools.answer(call, confirmed)
            if problem:
                say(problem)
            elif confirmed:
                write(folded_answer(call.name, answer))
            session = engine.answer_tool(session, answer)
            ran += confirmed
        if not ran:
            return session, 0
        engine.tools = tools.tools or None  # without those of a server that stopped
        session, code = reply(session)
        if code:
            return session, code
    say(f"stopped after {MAX_TOOL_ROUNDS} replies in a row that call tools")
    return session, 0


def folded_answer(tool: str, answer: str) -> str:
    """A tool's answer as `chat` shows it: its first RESULT_LINES lines, each cut at RESULT_WIDTH, and
    how many more there are (the model reads them all); what a server wrote escaped, as all such text."""
    lines = [escaped(line) for line in answer.splitlines()] or [""]
    shown = [
        line if len(line) <= RESULT_WIDTH else line[: RESULT_WIDTH - 1] + "…" for line in lines[:RESULT_LINES]
    ]
    more = len(lines) - RESULT_LINES
    fold = [f"  … {more} more line(s)"] if more > 0 else []
    return "\n".join([f"{escaped(tool)} answered:", *(f"  {line}" for line in shown), *fold]) + "\n"


def ask_yes(question: str) -> bool:
    """y/n on the terminal; anything but y (or Ctrl+D, Ctrl+C) is no."""
    try:
        return input(escaped(question)).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        print()
        return False
