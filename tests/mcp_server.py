"""An MCP server for the tests, written with the `mcp` SDK and spoken to over stdio:

    python tests/mcp_server.py [well | hang | slow-start | garbage | children] [PORT]

`well`: get_weather(city) and add(a, b) answer at once; `hang`: get_weather never answers;
`slow-start`: nothing answers the handshake; `garbage`: prints lines that are not JSON-RPC, then hangs;
`children`: as `well`, after starting three `sleep` processes it leaves running (they keep its stdin
and stdout), as a server with helpers of its own. With a PORT, it serves streamable HTTP on
127.0.0.1:PORT/mcp instead of stdio. With PID_FILE in its environment, it adds its process id (and its
children's) to that file first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mcp.server.mcpserver import MCPServer

MODE = sys.argv[1] if len(sys.argv) > 1 else "well"
server = MCPServer("llama-chat test server")


@server.tool()
def get_weather(city: str) -> str:
    """The weather in a city, now."""
    if MODE == "hang":
        time.sleep(3600)
    return f"Sunny, 21 °C in {city}."


@server.tool()
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


if __name__ == "__main__":
    pids = [os.getpid()]
    if MODE == "children":
        pids += [subprocess.Popen(["sleep", "3600"]).pid for _ in range(3)]
    if os.environ.get("PID_FILE"):
        with open(os.environ["PID_FILE"], "a") as f:
            f.write("".join(f"{pid}\n" for pid in pids))
    if MODE == "slow-start":
        time.sleep(3600)
    if MODE == "garbage":
        for _ in range(50):
            print("this is not JSON-RPC {{{", flush=True)
        time.sleep(3600)
    if len(sys.argv) > 2:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
