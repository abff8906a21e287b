"""An agent for the tracing tests: the tool loop, held after its tools ran until the file
named by TURNKEEPER_TEST_GATE exists (the event loop free: heartbeats go on), so that a
test can SIGKILL its worker with a tool call's spans exported and the turn in flight.
It logs "the model answered" after each model call.

`/otel-modules` answers with a notice naming the OpenTelemetry modules the worker
imported (none while tracing is off).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from loguru import logger

from workers.agent import Turn
from workers.agents.tool_loop import MAX_STEPS, ToolLoopAgent


class GatedAfterTools(ToolLoopAgent):
    async def run_turn(self, turn: Turn) -> str:
        users = [m.content for m in turn.messages if m.role == "user" and not m.note]
        if users and users[-1] == "/otel-modules":
            loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
            await turn.notice(f"modules: {','.join(loaded) or 'none'}")
            return "completed"
        gate = Path(os.environ.get("TURNKEEPER_TEST_GATE", "/nonexistent/gate"))
        for _ in range(MAX_STEPS):
            response = await turn.call_model()
            logger.bind(subsystem="agent").info("the model answered")  # a line of the run's
            if not response.tool_calls:
                return "truncated" if response.finish_reason == "length" else "completed"
            for call in response.tool_calls:
                await turn.call_tool(call)
            while not gate.exists():
                await asyncio.sleep(0.05)
        return "completed"
