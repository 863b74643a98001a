"""MCP tools in `chat`: the servers config.toml names (tests/mcp_server.py, written with the `mcp` SDK,
over stdio), their tools called after a y/n, each answer stored as a tool message; a server that
hangs, never starts or prints garbage is one line and a timeout."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from llama_chat.app.chat.mcp_tools import MCPTools, ServerConfig, ToolError, server_configs
from llama_chat.app.chat.sessions import Sessions
from llama_chat.app.chat_lines import answer_calls, folded_answer
from llama_chat.app.cli import main
from llama_chat.app.config import ConfigError, UserConfig
from llama_chat.app.tui.dialogs import ConfirmScreen
from llama_chat.inference.tool_calls import ToolCall, split_offered_calls
from llama_chat.storage import ChatStore
from tiny_models import write_tiny_model
from tui_pilot import aio, idle, say, stored_path, until

SERVER = str(Path(__file__).parent / "mcp_server.py")
START_S = 120.0  # for a server that does start: a Python process importing the SDK, on a busy machine
ENDED_S = 30.0  # for a server's processes to be gone once the chat is: a few seconds, on a busy machine


def server(mode: str, timeout: float = START_S, pid_file: Path | None = None) -> ServerConfig:
    env = {"PID_FILE": str(pid_file)} if pid_file else {}
    return ServerConfig("test", sys.executable, [SERVER, mode], env=env, timeout=timeout)


def running(pid_file: Path, within: float = 0.0) -> list[int]:
    """The processes that wrote their ids to pid_file (servers, and their children) still running
    after at most `within` seconds of waiting for them to end."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid in map(int, pid_file.read_text().split()) if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Running: in /proc and not a zombie (a process ended, whose parent has not read its status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def leftovers(tmp_path):
    """A pid file for the servers a test starts; whatever of them is still running at its end is killed."""
    pid_file = tmp_path / "pids"
    pid_file.touch()
    yield pid_file
    for pid in running(pid_file):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tools():
    opened = []

    def open_(*configs):
        opened.append(MCPTools(list(configs)))
        return opened[-1]

    yield open_
    for t in opened:
        t.close()


def test_a_server_s_tools_are_offered_and_called(tools):
    mcp = tools(server("well"))
    assert mcp.connect() == ["MCP server 'test': 2 tool(s): get_weather, add"]
    weather = next(t["function"] for t in mcp.tools if t["function"]["name"] == "get_weather")
    assert weather["parameters"]["required"] == ["city"]
    assert mcp.call("get_weather", {"city": "Paris"}) == "Sunny, 21 °C in Paris."
    assert mcp.call("add", {"a": 2, "b": 3}) == "5"
    assert mcp.call("add", {"a": "two"}).startswith("error: ")  # the model reads why
    with pytest.raises(ToolError, match="no MCP server offers a tool 'rm'"):
        mcp.call("rm", {})


def test_a_call_that_hangs_times_out_in_one_line_and_its_server_is_stopped(tools, tmp_path):
    mcp = tools(server("hang", timeout=START_S, pid_file=tmp_path / "pids"))
    mcp.connect()
    mcp.servers["test"].config.timeout = 2  # started; now each call gets 2 s
    with pytest.raises(ToolError) as e:
        mcp.call("get_weather", {"city": "Paris"})
    assert str(e.value) == "MCP tool 'get_weather' (server 'test') did not answer within 2 s; it was stopped"
    assert mcp.tools == []
    with pytest.raises(ToolError, match="MCP server 'test' is stopped"):
        mcp.call("add", {"a": 1, "b": 2})
    mcp.close()
    assert running(tmp_path / "pids") == []  # its process ended with it, hung as it was


def test_a_server_at_a_url_is_called_the_same_way(tools):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, SERVER, "well", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        mcp = tools(ServerConfig("web", url=f"http://127.0.0.1:{port}/mcp", timeout=START_S))
        assert mcp.connect() == ["MCP server 'web': 2 tool(s): get_weather, add"]
        assert mcp.call("add", {"a": 20, "b": 22}) == "42"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("mode", ["slow-start", "garbage"])
def test_a_server_that_never_answers_or_prints_garbage_is_one_line(tools, mode, capfd, leftovers):
    # on a busy machine the server may be stopped before it has imported the SDK and written its id
    mcp = tools(server(mode, timeout=3, pid_file=leftovers), ServerConfig("missing", "/no/such/mcp-server"))
    lines = mcp.connect()
    assert lines[0] == "MCP server 'test' did not answer within 3 s; it was stopped"
    assert lines[1].startswith("MCP server 'missing' failed to start: ") and "\n" not in lines[1]
    assert mcp.tools == []
    assert capfd.readouterr().err == ""  # nothing of the SDK's own logging reaches the terminal
    mcp.close()
    assert running(leftovers) == []


def test_a_server_s_children_end_with_the_chat(tools, leftovers):
    """A server that exits when its stdin closes, leaving children of its own: they end with it."""
    mcp = tools(server("children", pid_file=leftovers))
    assert mcp.connect() == ["MCP server 'test': 2 tool(s): get_weather, add"]
    assert len(running(leftovers)) == 4  # the server and its three `sleep`s
    mcp.close()
    assert running(leftovers, within=ENDED_S) == []


KILLED_CHAT = """
import sys, time
from llama_chat.app.chat.mcp_tools import MCPTools, ServerConfig
server, pid_file, timeout = sys.argv[1:]
config = ServerConfig(
    "test", sys.executable, [server, "children"], {"PID_FILE": pid_file}, timeout=float(timeout)
)
print(MCPTools([config]).connect()[0], flush=True)
time.sleep(3600)
"""


def test_a_server_and_its_children_end_when_the_chat_is_killed(leftovers):
    child = [sys.executable, "-c", KILLED_CHAT, SERVER, str(leftovers), str(START_S)]
    chat = subprocess.Popen(child, stdout=subprocess.PIPE, text=True)
    try:
        assert chat.stdout.readline() == "MCP server 'test': 2 tool(s): get_weather, add\n"
        assert len(running(leftovers)) == 4
        chat.kill()  # SIGKILL: nothing of the chat's own runs after it
        chat.wait()
        assert running(leftovers, within=ENDED_S) == []
    finally:
        chat.kill()
        chat.wait()


@pytest.mark.parametrize(
    "table, says",
    [
        ({"a": "python"}, "[mcp_servers.a]: must be a table"),
        ({"a": {"command": "x", "url": "http://h"}}, "either 'command'"),
        ({"a": {"command": "x", "args": "-v"}}, "'args' must be a list"),
        ({"a": {"url": "http://h", "timeout": 0}}, "'timeout' must be a positive number"),
        ({"a": {"command": "x", "cwd": "/"}}, "unknown key 'cwd'"),
    ],
)
def test_a_server_written_wrongly_is_one_line(table, says):
    with pytest.raises(ToolError, match=says.replace("[", r"\[").replace("]", r"\]")):
        server_configs(table)


def test_config_toml_with_a_server_written_wrongly_is_one_line(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[mcp_servers.a]\ncommand = "x"\nargs = "-v"\n')
    with pytest.raises(ConfigError, match="'args' must be a list of strings"):
        UserConfig.load(path)


def chat(monkeypatch, tmp_path, model: Path, mode: str, timeout: float, lines: str) -> int:
    config = Path(tmp_path / "config" / "llama-chat" / "config.toml")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"[mcp_servers.test]\ncommand = {str(sys.executable)!r}\nargs = [{SERVER!r}, {mode!r}]\ntimeout = "
        f"{timeout}\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return main(["chat", "--model", str(model), "--db", str(tmp_path / "chat.db"), "--temp", "0",
                 "--max-tokens", "60", "--cache-ram", "256"])


@pytest.mark.real_model
def test_chat_calls_a_tool_after_a_yes_and_stores_its_answer(monkeypatch, tmp_path, qwen_model_path, capsys):
    assert (
        chat(monkeypatch, tmp_path, qwen_model_path, "well", START_S, "What is the weather in Paris?\ny\n")
        == 0
    )
    out = capsys.readouterr()
    assert 'run the tool call get_weather({"city": "Paris"})? [y/N]' in out.out
    assert "get_weather answered:\n  Sunny, 21 °C in Paris.\n" in out.out
    assert "MCP server 'test': 2 tool(s): get_weather, add" in out.err
    store = ChatStore(tmp_path / "chat.db")
    (session,) = store.list_sessions()
    roles = [(m.role, m.content) for m in store.path(session.head_id)]
    assert roles[0] == ("user", "What is the weather in Paris?")
    assert roles[1][0] == "assistant" and "get_weather" in roles[1][1]
    assert roles[2] == ("tool", "Sunny, 21 °C in Paris.")
    assert roles[3][0] == "assistant"  # the model went on with the answer in front of it


@pytest.mark.real_model
def test_chat_with_a_tool_that_hangs_says_so_in_one_line_and_goes_on(
    monkeypatch, tmp_path, qwen_model_path, capsys
):
    code = chat(
        monkeypatch, tmp_path, qwen_model_path, "hang", 20, "What is the weather in Paris?\ny\nn\nn\n"
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "MCP tool 'get_weather' (server 'test') did not answer within 20 s; it was stopped\n" in err
    assert "Traceback" not in err
    store = ChatStore(tmp_path / "chat.db")
    (session,) = store.list_sessions()
    told = [m.content for m in store.path(session.head_id) if m.role == "tool"]
    assert (
        told[0] == "error: MCP tool 'get_weather' (server 'test') did not answer within 20 s; it was stopped"
    )


def test_the_docs_example_server_serves_chat_as_written(monkeypatch, tmp_path, capsys):
    """docs/tools.md's config.toml and weather_server.py, copied as a user copies them (`python` the
    one llama-chat runs in), run with the `mcp` version pyproject allows, and `chat` offers its tool."""
    from test_tool_formats import LLAMA_SPECIALS, LLAMA_TEMPLATE, TEMPLATES

    docs = (Path(__file__).parent.parent / "docs" / "tools.md").read_text()
    code = docs.split("```python\n")[1].split("```")[0]
    config = docs.split("connected with the official `mcp` SDK:\n\n")[1].split("\n\n")[0]
    (tmp_path / "weather_server.py").write_text(code)
    toml = tmp_path / "config" / "llama-chat" / "config.toml"
    toml.parent.mkdir(parents=True)
    toml.write_text("\n".join(line.removeprefix("    ") for line in config.splitlines()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    model = write_tiny_model(  # a chat template that takes tools
        tmp_path / "tiny-llama3.gguf", "llama", chat_template=(TEMPLATES / LLAMA_TEMPLATE).read_text(),
        specials=LLAMA_SPECIALS, context_length=2048,
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", "--model", str(model), "--db", str(tmp_path / "chat.db"), "--cache-ram", "64"]) == 0
    assert "MCP server 'weather': 1 tool(s): get_weather" in capsys.readouterr().err
    mcp = MCPTools(server_configs(UserConfig.load(toml).mcp_servers))
    try:
        mcp.connect()
        assert mcp.call("get_weather", {"city": "Paris"}) == "Sunny, 21 °C in Paris."
    finally:
        mcp.close()


def test_chat_shows_a_tool_s_answer_after_a_yes_folded_past_a_few_lines(tools, tmp_path, capsys):
    sessions = Sessions(tmp_path / "chat.db")
    store = sessions.store
    session = store.create_session("weather")
    store.add_message(session.id, "user", "What is the weather in Paris?")
    store.add_message(
        session.id, "assistant", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    )
    mcp = tools(server("well"))
    mcp.connect()

    def reply(session):
        store.add_message(session.id, "assistant", "It is sunny in Paris.")
        return store.get_session(session.id), 0

    def answer_tool(session, answer):
        store.add_message(session.id, "tool", answer)
        return store.get_session(session.id)

    engine = types.SimpleNamespace(answer_tool=answer_tool, tools=None)
    answer_calls(engine, sessions, store.get_session(session.id), mcp, reply, lambda question: True)
    assert capsys.readouterr().out == "get_weather answered:\n  Sunny, 21 °C in Paris.\n"

    long = "\n".join(f"line {i}" for i in range(1, 41)) + "\n" + "x" * 500
    shown = folded_answer("read_file", long).splitlines()
    assert shown[1:3] == ["  line 1", "  line 2"] and shown[-1] == "  … 35 more line(s)" and len(shown) == 8
    assert len(folded_answer("dump", "y" * 500).splitlines()[1]) < 200  # a long line is cut
    # no control reaches the terminal
    assert folded_answer("t", "a\x1b[2Jb").splitlines()[1] == "  a\\x1b[2Jb"

def test_a_call_in_a_json_fence_counts_only_for_a_tool_offered():
    fenced = 'Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    assert split_offered_calls(fenced, {"get_weather"}) == (
        "Let me look.",
        [ToolCall("get_weather", {"city": "Paris"})],
    )
    assert split_offered_calls(fenced, {"add"}) is None  # JSON someone asked for, not a call
    tagged = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert split_offered_calls(tagged, set()) == ("", [ToolCall("add", {"a": 1, "b": 2})])
    assert split_offered_calls("```json\n{not json}\n```", {"get_weather"}) is None


@pytest.mark.real_model
@aio
async def test_the_app_asks_before_a_tool_call_and_goes_on_with_its_answer(open_chat, qwen_model_path):
    servers = {"test": {"command": sys.executable, "args": [SERVER, "well"], "timeout": START_S}}
    async with open_chat(model=qwen_model_path, max_tokens=60, mcp_servers=servers) as pilot:
        app = pilot.app
        await say(pilot, "What is the weather in Paris?")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
        assert 'get_weather({"city": "Paris"})' in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: len(stored_path(app)) >= 4, what="the answer and the next reply")
        await idle(pilot)
        roles = stored_path(app)
        assert roles[2] == ("tool", "Sunny, 21 °C in Paris.")
        assert roles[3][0] == "assistant"
