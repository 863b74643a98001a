"""The app's side of MCP tools: the servers of config.toml started with the first model, and each call
a stored reply makes asked about in a dialog (y runs it, n or Esc declines) before it runs. Answers
are stored as tool messages and the model goes on, as in `chat` (app/chat_lines.py), unless every
call was declined, and at most MAX_TOOL_ROUNDS replies in a row.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from llama_chat.storage import Message, Session

from ..chat.mcp_tools import MAX_TOOL_ROUNDS, MCPTools, shown, start_tools
from .dialogs import ConfirmScreen
from .replies import Reply, ReplyFlow
from .widgets import MessageView

if TYPE_CHECKING:  # (the engine loads with the model, after the window is drawn; the call parser with it)
    from llama_chat.inference.tool_calls import ToolCall

    from ..chat.engine import ChatEngine


class ToolCalls:
    """The chat's MCP servers (`servers`, from config.toml), and the calls waiting for the user's answer;
    the model goes on through the reply flow."""

    def __init__(self, flow: ReplyFlow, servers: dict) -> None:
        self.flow, self.chat, self.servers = flow, flow.chat, servers
        self.tools: MCPTools | None = None
        self.rounds = 0  # replies in a row that called tools

    def offer(self, engine: ChatEngine) -> None:
        """On the worker that made `engine`: the servers started (the first time), their tools offered
        to its model; each server's line a notice."""
        if self.tools is None:
            self.tools, lines = start_tools(engine, self.servers)
            for line in lines:
                self.chat.notify(line, title="MCP tools", timeout=8)
        else:
            engine.tools = self.tools.tools or None

    def after_reply(self, session: Session, path: list[Message]) -> None:
        """A reply was stored at the end of `path`: ask about each call it makes, if it makes any."""
        last = path[-1] if path else None
        calls = self.tools.calls_in(last.content) if self.tools and last and last.role == "assistant" else []
        if not calls or self.rounds >= MAX_TOOL_ROUNDS:
            self.rounds = 0
            return
        self.rounds += 1
        self.ask(session, calls, ran=0)

    def ask(self, session: Session, calls: list[ToolCall], ran: int) -> None:
        if not calls:
            if ran:
                self.chat.run(partial(self.chat.sessions.read, session.id), self.go_on)
            return

        def answered(yes: bool | None) -> None:
            store_answer = partial(self.store_answer, session, calls[0], bool(yes))
            self.chat.run(store_answer, lambda _: self.ask(session, calls[1:], ran + bool(yes)))

        question = f"Run the tool call {shown(calls[0])}?"
        self.chat.ask(ConfirmScreen("Tool call", question, yes="Run"), answered)

    def store_answer(self, session: Session, call: ToolCall, confirmed: bool) -> None:
        """On a worker: run the call (if confirmed), store its answer as a tool message."""
        answer, problem = self.tools.answer(call, confirmed)
        if problem:
            self.chat.notify(problem, title="Tool call failed", severity="error", timeout=10)
        self.chat.model.engine.answer_tool(session, answer)

    async def go_on(self, opened: tuple[Session, list[Message]]) -> None:
        """The answers are stored: show them, and let the model reply with them in front of it."""
        session, path = opened
        engine = self.chat.model.engine
        if engine is not None:
            engine.tools = self.tools.tools or None  # without those of a server that stopped
        await self.chat.show(session, path)
        reply = Reply(session, None, self.flow.max_tokens(session))
        reply.view = MessageView("assistant")
        await self.chat.conversation.add(reply.view)
        self.flow.submit(reply)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
