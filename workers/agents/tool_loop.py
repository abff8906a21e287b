"""The built-in agent: call the model, run the tools it asks for, repeat until it answers."""

from __future__ import annotations

from workers.agent import Turn

MAX_STEPS = 25


class ToolLoopAgent:
    """Call the model; while it asks for tools, run them and call it again."""

    async def run_turn(self, turn: Turn) -> str:
        """One turn: at most MAX_STEPS model calls."""
        for _ in range(MAX_STEPS):
            response = await turn.call_model()
            if response.tool_calls:
                for call in response.tool_calls:
                    await turn.call_tool(call)
                continue
            return "truncated" if response.finish_reason == "length" else "completed"
        await turn.notice(f"The turn stopped after {MAX_STEPS} model calls.")
        return "completed"
