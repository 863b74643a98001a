"""MCP servers' tools for a chat: the servers config.toml names, connected with the official `mcp` SDK,
their tools offered to the model as OpenAI function definitions, and each call run with a timeout.

    [mcp_servers.weather]                 # in config.toml; one table per server
    command = "python"                    # a server started here, spoken to over stdio ...
    args = ["weather_server.py"]
    env = {"API_KEY" = "..."}             # (optional)
    # url = "http://127.0.0.1:8000/mcp"   # ... or one already running (streamable HTTP)
    # timeout = 30                        # seconds for its start and for each call (default 30)

The SDK is async; a chat is not. The servers live on an event loop in a thread of their own, each in
one task that holds its connection (the SDK's contexts must close in the task that opened them) and
serves the calls sent to it. A caller waits for an answer at most the server's timeout: a server that
fails to start, hangs, or prints garbage is one line and a timeout, never a frozen chat, and a server
that did not answer in time is stopped and its tools are no longer offered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:  # (the call parser loads where servers start, not with the config that names them)
    from llama_chat.inference.tool_calls import ToolCall

DEFAULT_TIMEOUT_S = 30.0
MAX_TOOL_ROUNDS = 8  # replies in a row that call tools, after one message: a model in a loop stops here
# for the servers to end with the chat: the SDK gives one 2 s after stdin closes, 2 more after SIGTERM
CLOSE_S = 10.0
MAX_RESULT_CHARS = 16_000  # a tool's answer beyond this is cut: it goes into the context window whole
GROUP_SCRIPT = Path(__file__).with_name("mcp_group.py")  # run as a script: it imports nothing of ours


class ToolError(Exception):
    """A server or a call that failed: one line naming the server or the tool and why."""


@dataclass
class ServerConfig:
    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S


def server_configs(table: dict) -> list[ServerConfig]:
    """config.toml's [mcp_servers] as servers; a server written wrongly is a ToolError naming it."""
    servers = []
    for name, spec in table.items():
        where = f"[mcp_servers.{name}]"
        if not isinstance(spec, dict):
            raise ToolError(f"{where}: must be a table with 'command' (and 'args') or 'url'")
        unknown = set(spec) - {"command", "args", "env", "url", "timeout"}
        if unknown:
            raise ToolError(
                f"{where}: unknown key '{sorted(unknown)[0]}' (known: command, args, env, url, timeout)"
            )
        if (spec.get("command") is None) == (spec.get("url") is None):
            raise ToolError(f"{where}: give either 'command' (a server started here) or 'url', not both")
        args, env, timeout = spec.get("args", []), spec.get("env", {}), spec.get("timeout", DEFAULT_TIMEOUT_S)
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ToolError(f"{where}: 'args' must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ToolError(f"{where}: 'env' must be a table of strings")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ToolError(f"{where}: 'timeout' must be a positive number of seconds")
        for key in ("command", "url"):
            if spec.get(key) is not None and not isinstance(spec[key], str):
                raise ToolError(f"{where}: '{key}' must be a string")
        servers.append(ServerConfig(name, spec.get("command"), args, env, spec.get("url"), float(timeout)))
    return servers


@dataclass
class _Server:
    config: ServerConfig
    calls: asyncio.Queue | None = None  # (tool name, arguments, future) for its task; None: not connected
    task: asyncio.Task | None = None
    # Stops its connection's work: then the SDK ends its process (stdin closed, then SIGTERM, SIGKILL).
    # Not task.cancel(): a task cancelled the asyncio way skips that, leaving the process behind.
    scope: anyio.CancelScope | None = None  # (made on the loop: anyio wants one running)


class MCPTools:
    """The connected servers and their tools. tools: OpenAI function definitions, for the template."""

    def __init__(self, configs: list[ServerConfig]):
        # The SDK logs a server's bad lines with tracebacks; a failure reaches the user as one line here.
        quiet = logging.getLogger("mcp")
        quiet.propagate = False
        quiet.addHandler(logging.NullHandler())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp", daemon=True)
        self.thread.start()
        self.servers = {c.name: _Server(c) for c in configs}
        self.tools: list[dict] = []
        self.server_of: dict[str, str] = {}  # tool name → its server's name
        from llama_chat.inference.tool_calls import HERMES

        self.format = HERMES  # the format the model's chat template asks for calls in

    def connect(self) -> list[str]:
        """Start every server and list its tools; returns a line for each server: its tools, or why it
        is left out. All start at once, so the slowest bounds the wait."""
        started = {name: self._submit(self._open(s)) for name, s in self.servers.items()}
        lines = []
        for name, future in started.items():
            try:
                listed = self._wait(future, name, f"MCP server '{name}'", "to start")
            except ToolError as e:
                self._stop(name)
                lines.append(str(e))
                continue
            offered = []
            for tool in listed:
                if tool.name in self.server_of:
                    continue  # the first server to offer a name keeps it
                self.server_of[tool.name] = name
                self.tools.append(function_definition(tool))
                offered.append(tool.name)
            lines.append(f"MCP server '{name}': {len(offered)} tool(s): {', '.join(offered) or 'none'}")
        return lines

    def call(self, tool: str, arguments: dict) -> str:
        """The text of a tool's answer (a failed call says so in it, for the model to read), or a
        ToolError when the call could not be made or got no answer in time."""
        name = self.server_of.get(tool)
        if name is None:
            raise ToolError(f"no MCP server offers a tool '{tool}'")
        server = self.servers[name]
        if server.calls is None:
            raise ToolError(f"MCP server '{name}' is stopped: '{tool}' cannot be called")
        future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(server.calls.put_nowait, (tool, arguments, future))
        return result_text(self._wait(future, name, f"MCP tool '{tool}' (server '{name}')", "to answer"))

    def calls_in(self, reply: str) -> list[ToolCall]:
        """The calls a reply makes of the servers' tools (a stopped server's too: calling one says so)."""
        from llama_chat.inference.tool_calls import split_offered_calls

        parsed = split_offered_calls(reply, set(self.server_of), self.format)
        return parsed[1] if parsed else []

    def answer(self, call: ToolCall, confirmed: bool) -> tuple[str, str | None]:
        """The tool message for a call: its answer if `confirmed`, else that the user declined it; and
        the line to show the user when it failed (None: it did not)."""
        if not confirmed:
            return "error: the user declined this call", None
        try:
            return self.call(call.name, call.arguments), None
        except ToolError as e:
            return f"error: {e}", str(e)

    def close(self) -> None:
        """Stop every server (a server started here is ended by the SDK), then the loop; once."""
        if not self.thread.is_alive():
            return
        for name in self.servers:
            self._stop(name)
        tasks = [s.task for s in self.servers.values() if s.task is not None]

        async def ended() -> None:
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_S)

        try:
            self._submit(ended()).result(CLOSE_S + 1)
        except (TimeoutError, concurrent.futures.CancelledError):
            pass  # the process ends anyway: its daemon thread does not hold it up
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=CLOSE_S)
        if not self.thread.is_alive():
            self.loop.close()

    # -- on the loop's thread ----------------------------------------------------------------------

    async def _open(self, server: _Server) -> list:
        """Start the server's task; its tools once it listed them."""
        listed: asyncio.Future = self.loop.create_future()
        server.calls, server.scope = asyncio.Queue(), anyio.CancelScope()
        server.task = self.loop.create_task(self._serve(server, listed))
        return await listed

    async def _serve(self, server: _Server, listed: asyncio.Future) -> None:
        from mcp import ClientSession

        calls = server.calls
        try:
            with open(os.devnull, "w") as errlog:  # a server's stderr would break the chat's lines
                async with _transport(server.config, errlog) as streams:
                    with server.scope:
                        async with ClientSession(*streams[:2]) as session:
                            await session.initialize()
                            listed.set_result((await session.list_tools()).tools)
                            while True:
                                tool, arguments, answer = await calls.get()
                                if not answer.set_running_or_notify_cancel():
                                    continue  # its caller gave up waiting
                                try:
                                    answer.set_result(await session.call_tool(tool, arguments))
                                except Exception as e:  # the caller says it in one line
                                    answer.set_exception(e)
        except Exception as e:  # whatever ends the connection, the caller hears of it
            if not listed.done():
                listed.set_exception(e)
        finally:
            server.calls = None
            if not listed.done():
                listed.set_exception(ToolError("stopped"))

    def _submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def _wait(self, future: concurrent.futures.Future, name: str, what: str, doing: str):
        """What server `name` answered within its timeout; a server that did not is stopped (it is
        not asked again)."""
        timeout = self.servers[name].config.timeout
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            self._stop(name)
            raise ToolError(f"{what} did not answer within {timeout:g} s; it was stopped") from None
        except Exception as e:  # a server's failure, whatever its kind, is one line
            raise ToolError(f"{what} failed {doing}: {one_line(e)}") from None

    def _stop(self, name: str) -> None:
        server = self.servers[name]
        server.calls = None
        if server.scope is not None:
            self.loop.call_soon_threadsafe(server.scope.cancel)
        self.tools = [t for t in self.tools if self.server_of[t["function"]["name"]] != name]


def start_tools(engine, servers: dict) -> tuple[MCPTools | None, list[str]]:
    """The MCP servers of config.toml ([mcp_servers]) started and their tools offered in every prompt
    of `engine` (a ChatEngine); a line per server to show. None when there are none, or when the
    model's chat template cannot take tools (a line says so)."""
    if not servers:
        return None, []
    model = engine.model_info
    fmt = model.tool_format
    if fmt is None:
        return None, [
            f"{model.name}'s chat template takes no tools: the MCP servers of config.toml are not started"
        ]
    if fmt.with_id:  # its template refuses a tool's answer without the call's id, which a chat does not keep
        return None, [
            f"{model.name}'s chat template ({fmt.name}) needs call ids the chat does not keep: "
            "the MCP servers of config.toml are not started"
        ]
    tools = MCPTools(server_configs(servers))
    tools.format = fmt
    lines = tools.connect()
    engine.tools = tools.tools or None
    return tools, lines


def _transport(config: ServerConfig, errlog):
    """The SDK's client transport for a server: its streams (read, write, ...) as a context."""
    if config.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(config.url)
    from mcp import StdioServerParameters, stdio_client

    command, args = config.command, config.args
    if os.name == "posix":  # started through mcp_group.py, which ends the server's children with it
        if shutil.which(command, path=config.env.get("PATH")) is None:  # (said here: the SDK starts python)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
        command, args = sys.executable, ["-I", str(GROUP_SCRIPT), str(os.getpid()), command, *args]
    params = StdioServerParameters(command=command, args=args, env=config.env or None)
    return stdio_client(params, errlog=errlog)


def shown(call: ToolCall) -> str:
    """A call as the user is asked about it: name(arguments as JSON)."""
    return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})"


def function_definition(tool) -> dict:
    """An MCP tool as the OpenAI function definition chat templates render."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object", "properties": {}},
        },
    }


def result_text(result) -> str:
    """A tool's answer as the text of a tool message: its text parts (structured content as JSON),
    marked when the tool says it failed, cut at MAX_RESULT_CHARS."""
    parts = [getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]" for c in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    text = "\n".join(parts)
    if result.is_error:
        text = f"error: {text}"
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[cut at {MAX_RESULT_CHARS:,} characters]"
    return text


def one_line(e: BaseException) -> str:
    """An exception as a short line: its message's first line, or its kind. An exception group (anyio's
    task groups raise them) by its first leaf."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:200]
