"""An agent plug-in for tests: a parent that starts a subagent running another agent, a
choice only an agent (not the model) makes.

/spawn AGENT TASK   start a subagent running AGENT (`package.module:Class`, which must be
                    in agent.allowed) on TASK, and say so in a notice
anything else       the tool-loop agent's turn (the subagent's result, say)
"""

from __future__ import annotations

from workers.agent import Turn
from workers.agents.tool_loop import ToolLoopAgent


class Agent(ToolLoopAgent):
    async def run_turn(self, turn: Turn) -> str:
        users = [m.content for m in turn.messages if m.role == "user" and not m.note]
        last = users[-1] if users else ""
        if last.startswith("/spawn "):
            _, agent, task = last.split(maxsplit=2)
            child = await turn.spawn_subagent(task, agent=agent)
            await turn.notice(f"started subagent {child}")
            return "completed"
        return await super().run_turn(turn)
