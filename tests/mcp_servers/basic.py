"""An MCP server with one tool for each behaviour the client has to handle.

`add` (read-only, idempotent), `slow` (sleeps), `fail` (an error result), `whoami`
(selected environment variables, to check what the client passed on), `big` (a result
of the size asked for) and `die` (the process exits in the middle of the call, without
answering).

When the file named by BASIC_REFUSE_IF_EXISTS exists, the server exits at once with
status 2 instead of starting (a crash loop, without the cost of importing the SDK).
"""

from __future__ import annotations

import os
import sys

if (refuse := os.environ.get("BASIC_REFUSE_IF_EXISTS")) and os.path.exists(refuse):
    print("basic: refusing to start", file=sys.stderr, flush=True)
    sys.exit(2)

import asyncio
import json

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

server = MCPServer("basic", log_level="WARNING")


@server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
def add(a: float, b: float) -> str:
    """Add two numbers."""
    total = a + b
    return str(int(total) if total == int(total) else total)


@server.tool()
async def slow(seconds: float) -> str:
    """Wait `seconds`, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def fail() -> str:
    """Always fails, with a message for the model."""
    raise ToolError("fail always fails")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def whoami(names: list[str]) -> str:
    """The values of the environment variables `names` (null when unset) and all names."""
    return json.dumps(
        {
            "pid": os.getpid(),
            "env": {name: os.environ.get(name) for name in names},
            "names": sorted(os.environ),
        }
    )


@server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
def big(size: int) -> str:
    """`size` characters ("y"), for the cut of large results."""
    return "y" * size


@server.tool()
def die(code: int = 3) -> str:
    """Exit the process at once, mid-call."""
    print("basic: dying on request", file=sys.stderr, flush=True)
    os._exit(code)


if __name__ == "__main__":
    server.run("stdio")
