"""A minimal MCP server (`tiny`'s protocol, no SDK) whose start is held, and told.

    python -m tests.mcp_servers.gated NAME

It appends what it does, one line each, to the file named by GATED_EVENTS: `start NAME`
when it runs, `initialize NAME` when the client's `initialize` arrives, `answered NAME
METHOD` just before each answer goes out. It answers `initialize` only once it may:

- GATED_GATE: the path of a file that must exist;
- GATED_PEERS: the number of `initialize` lines the events file must hold (every server
  of a group started and was asked to initialize), so that no server of the group
  finishes starting before the client began the start of all;
- GATED_FREE: the number of servers that pass without waiting, taken first come first
  served by creating `free-1`, `free-2`, ... next to the events file.

Without any of these it answers at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.mcp_servers.tiny import answer

POLL = 0.02


def record(events: Path | None, line: str) -> None:
    if events is not None:
        with events.open("a") as out:
            out.write(line + "\n")


def initialized(events: Path) -> int:
    return sum(line.startswith("initialize ") for line in events.read_text().splitlines())


def free_pass(events: Path | None) -> bool:
    free = int(os.environ.get("GATED_FREE", "0"))
    for n in range(1, free + 1):
        assert events is not None
        try:
            (events.parent / f"free-{n}").touch(exist_ok=False)
            return True
        except FileExistsError:
            continue
    return False


def hold(events: Path | None) -> None:
    """Until this server may answer `initialize`."""
    if free_pass(events):
        return
    gate = os.environ.get("GATED_GATE")
    peers = int(os.environ.get("GATED_PEERS", "0"))
    while (gate and not os.path.exists(gate)) or (events and peers and initialized(events) < peers):
        time.sleep(POLL)


def main(name: str) -> None:
    events = Path(os.environ["GATED_EVENTS"]) if "GATED_EVENTS" in os.environ else None
    record(events, f"start {name}")
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if message.get("method") == "initialize":
            record(events, f"initialize {name}")
            hold(events)
        reply = answer(message)
        if reply is not None:
            record(events, f"answered {name} {message.get('method')}")
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
