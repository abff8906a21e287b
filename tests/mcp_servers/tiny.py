"""A minimal MCP server without the SDK, for tests about processes, not about MCP.

It starts in milliseconds (the SDK takes seconds to import), which matters when a test
runs 16 of them. It speaks just enough of the protocol over stdio (one JSON-RPC message a
line): initialize, tools/list (one tool, `ping`), tools/call and ping.

    python -m tests.mcp_servers.tiny [--ignore-term] [--spawn-escaped FILE]

--ignore-term ignores SIGTERM, as a stubborn server does; --spawn-escaped starts a
grandchild in a new session (setsid) that sleeps forever, and appends its pid to FILE.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys


def answer(message: dict[str, object]) -> dict[str, object] | None:
    method = message.get("method")
    if "id" not in message:
        return None  # a notification
    params = message.get("params") or {}
    assert isinstance(params, dict)
    if method == "initialize":
        result: dict[str, object] = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "tiny", "version": "1"},
        }
    elif method == "tools/list":
        result = {
            "tools": [
                {
                    "name": "ping",
                    "description": "Answer pong.",
                    "inputSchema": {"type": "object"},
                    "annotations": {"readOnlyHint": True},
                }
            ]
        }
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": "pong"}], "isError": False}
    elif method == "ping":
        result = {}
    else:
        return {
            "jsonrpc": "2.0",
            "id": message["id"],
            "error": {"code": -32601, "message": f"unknown method {method}"},
        }
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


def main(argv: list[str]) -> None:
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--spawn-escaped" in argv:
        path = argv[argv.index("--spawn-escaped") + 1]
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        with open(path, "a") as out:
            out.write(f"{child.pid}\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line))
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
