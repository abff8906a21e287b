"""An MCP server that ignores SIGTERM, so that only SIGKILL stops it."""

from __future__ import annotations

import signal

from mcp.server.mcpserver import MCPServer

server = MCPServer("stubborn", log_level="WARNING")


@server.tool()
def ping() -> str:
    """Answer pong."""
    return "pong"


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.run("stdio")
