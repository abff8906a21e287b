"""An agent plug-in for tests: the tool-loop agent, plus commands aimed at its own worker.

/crash              run the `echo` tool, then SIGKILL the worker process running the
                    turn (every time: each continuation runs the tool and dies again)
/crash-at-start     SIGKILL the worker before the turn does anything (every time)
/hang-once PATH     block the worker's event loop for good, unless PATH exists
                    (it is created first, so a continuation of the turn goes on)
/gate PATH T        hold the turn until PATH exists (checked every 50 ms, the event loop
                    free: heartbeats go on), then go on as usual (the echo model answers
                    `echo: /gate PATH T`); a test holds a turn in flight with it
/hold SECONDS       hold the turn SECONDS (the event loop free), then answer as usual
/ask-restart PATH R `await turn.request_restart(R)`, then hold the turn until PATH exists
                    (as /gate), then answer as usual
/raise KIND         fail for real with SystemExit, KeyboardInterrupt, RecursionError
                    (unbounded recursion) or MemoryError (one oversized allocation)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from workers.agent import Turn
from workers.agents.tool_loop import ToolLoopAgent
from workers.models import ToolCall


class ChaosAgent(ToolLoopAgent):
    async def run_turn(self, turn: Turn) -> str:
        users = [m.content for m in turn.messages if m.role == "user" and not m.note]
        last = users[-1] if users else ""
        if last == "/crash":
            await turn.call_tool(ToolCall(f"crash-{uuid.uuid4().hex[:8]}", "echo", {"text": "x"}))
            os.kill(os.getpid(), signal.SIGKILL)
        if last == "/crash-at-start":
            os.kill(os.getpid(), signal.SIGKILL)
        if last.startswith("/raise "):
            _fail(last.split(maxsplit=1)[1])
        if last.startswith("/ask-restart "):
            _, path, reason = last.split(maxsplit=2)
            await turn.request_restart(reason)
            while not Path(path).exists():
                await asyncio.sleep(0.05)
        if last.startswith("/gate "):
            gate = Path(last.split(maxsplit=2)[1])
            while not gate.exists():
                await asyncio.sleep(0.05)
        if last.startswith("/hold "):
            await asyncio.sleep(float(last.split()[1]))
        if last.startswith("/hang-once "):
            marker = Path(last.split(maxsplit=1)[1])
            if not marker.exists():
                marker.touch()
                while True:
                    time.sleep(3600)  # blocks the loop: no more heartbeats
        return await super().run_turn(turn)


def _fail(kind: str) -> None:
    if kind == "SystemExit":
        sys.exit(3)
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "RecursionError":

        def down(depth: int) -> int:
            return down(depth + 1) + 1

        down(0)
    if kind == "MemoryError":
        bytearray(1 << 60)  # far beyond any machine: the allocation itself fails
