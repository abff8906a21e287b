"""An MCP server that leaves descendants behind, as careless servers do.

At start it spawns two grandchildren that sleep forever: one stays in the server's
process group, the other escapes into a new session (setsid). Their pids are appended, one
a line, to the files named by SPAWNER_GROUP_PID_FILE and SPAWNER_ESCAPED_PID_FILE. Tool
`ping` answers; tool `quit` ends the server cleanly, leaving the grandchildren.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from mcp.server.mcpserver import MCPServer

SLEEP = "import time\nwhile True: time.sleep(60)"

server = MCPServer("spawner", log_level="WARNING")


def spawn(pid_var: str, *, escape: bool) -> None:
    # It keeps the server's stdin, stdout and stderr open, as careless children do.
    child = subprocess.Popen([sys.executable, "-c", SLEEP], start_new_session=escape)
    if path := os.environ.get(pid_var):
        with open(path, "a") as out:
            out.write(f"{child.pid}\n")


@server.tool()
def ping() -> str:
    """Answer pong."""
    return "pong"


@server.tool()
def quit() -> str:
    """End the server with exit status 0, shortly after answering."""
    threading.Timer(0.1, os._exit, args=(0,)).start()
    return "bye"


if __name__ == "__main__":
    spawn("SPAWNER_GROUP_PID_FILE", escape=False)
    spawn("SPAWNER_ESCAPED_PID_FILE", escape=True)
    server.run("stdio")
