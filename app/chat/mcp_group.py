"""An MCP server started here ends with its whole process group:

    python -I mcp_group.py CHAT_PID COMMAND [ARG...]

The `mcp` SDK starts a stdio server in a session (and process group) of its own, and ends that group
only when the server is still running 2 s after its stdin closed: a server that exits on EOF leaves
its own children running, and a chat killed with SIGKILL leaves all of them. So the SDK starts this
instead, in that group: it runs the server (which takes over its stdin and stdout), waits until the
server exits or the chat is gone (this process's parent is no longer CHAT_PID, SIGKILL included), and
then ends the group: SIGTERM, then, once the server has gone or GRACE_S passed, SIGKILL to whatever is
left, this process with it. Only a process that leaves the group on purpose (a daemon calling setsid)
outlives it. A script of the standard library alone, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5  # how often the chat is looked for: within the SDK's 2 s for a server to end
GRACE_S = 1.5  # for the server to end after SIGTERM; within the SDK's 2 s before its own SIGKILL
NOT_FOUND = 127  # a shell's status for a command it cannot run


def main(argv: list[str]) -> int:
    chat, command = int(argv[1]), argv[2:]
    if os.getpgrp() != os.getpid():  # (the SDK made this a group's leader: otherwise, be one)
        os.setsid()
    try:
        server = subprocess.Popen(command)
    except OSError as e:
        print(f"{command[0]}: {e.strerror}", file=sys.stderr)
        return NOT_FOUND
    let_go_of_stdio()
    while server.poll() is None and os.getppid() == chat:
        time.sleep(POLL_S)
    end_group(server)
    return 0  # (not reached: the group's SIGKILL ends this process too)


def let_go_of_stdio() -> None:
    """The server alone holds the chat's pipes: its exit closes them."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)


def end_group(server: subprocess.Popen) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (this process ends last)
    os.killpg(0, signal.SIGTERM)
    try:
        server.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
