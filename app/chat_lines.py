"""What `chat` does besides sending a line: `/attach FILE`, and the tool calls of the MCP servers in
config.toml — each shown and run only when the user answers y, its answer stored as a tool message."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable

from llama_chat.inference.tool_calls import split_offered_calls, takes_tools
from llama_chat.storage import Session

from .chat.attachments import Attachment, AttachmentError, read_attachment, with_attachments
from .chat.mcp_tools import MCPTools, ToolError, server_configs
from .terminal import say

MAX_TOOL_ROUNDS = 8  # replies in a row that call tools, after one message: a model in a loop stops here


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
    """The MCP servers of config.toml ([mcp_servers]) started, their tools offered in every prompt;
    None when there are none, or the model's template cannot take them (said in one line)."""
    if not servers:
        return None
    model = engine.model
    if not (model.has_chat_template and takes_tools(model.chat_template)):
        say(f"{model.name}'s chat template takes no tools: the MCP servers of config.toml are not started")
        return None
    tools = MCPTools(server_configs(servers))
    for line in tools.connect():
        say(line)
    engine.tools = tools.tools or None
    return tools


def answer_calls(engine, session: Session, tools: MCPTools, reply: Callable[[Session], tuple[Session, int]],
                 confirm: Callable[[str], bool]) -> tuple[Session, int]:
    """While the session's last reply calls tools: each call shown and, if confirm(question) says so,
    run; its answer (or why there is none) stored as a tool message; then the model replies again —
    unless the user declined every call: then the user's next message comes first (a small model
    asks again and again). Returns the session and the exit code reply() asked for (0: none)."""
    for _ in range(MAX_TOOL_ROUNDS):
        head = engine.store.message(session.head_id)
        known = set(tools.server_of)  # (a stopped server's too: calling one says it stopped)
        parsed = split_offered_calls(head.content, known) if head.role == "assistant" else None
        if parsed is None:
            return session, 0
        ran = 0
        for call in parsed[1]:
            shown = f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})"
            if confirm(f"run the tool call {shown}? [y/N] "):
                ran += 1
                try:
                    answer = tools.call(call.name, call.arguments)
                except ToolError as e:
                    say(str(e))
                    answer = f"error: {e}"
            else:
                answer = "error: the user declined this call"
            engine.store.add_message(session.id, "tool", answer)
        session = engine.store.get_session(session.id)
        if not ran:
            return session, 0
        engine.tools = tools.tools or None  # without those of a server that stopped
        session, code = reply(session)
        if code:
            return session, code
    say(f"stopped after {MAX_TOOL_ROUNDS} replies in a row that call tools")
    return session, 0


def ask_yes(question: str) -> bool:
    """y/n on the terminal; anything but y (or Ctrl+D, Ctrl+C) is no."""
    try:
        return input(question).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        print()
        return False
