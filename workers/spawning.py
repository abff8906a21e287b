"""Subagents from inside a turn: the `spawn_subagent` tool and what `turn.spawn_subagent` does.

A spawn is one transaction of the store (`supervisor.store.subagents`): the parent's
`subagent_spawned`, the child session and its task, written with the parent turn's lease
token, so a turn fenced out spawns nothing. The limits (`subagents.max_depth`,
`subagents.max_children`) are checked in that transaction; past them the tool returns an
error result the model reads. A tool call that spawned a child before a crash spawns no
second one when its turn is continued and the call is made again: the call id is kept
with the child.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.core.vocabulary import EventType
from supervisor.store import Store
from supervisor.subagents.rules import Refused
from workers.desk import Notify, SessionDesk
from workers.models import ToolSpec
from workers.tools import ToolOutcome

TOOL = "spawn_subagent"
SPEC = ToolSpec(
    TOOL,
    "Hand a sub-task to a subagent: a new session of its own that works on `task` while "
    "this conversation goes on. Its result arrives here as a message once it is done.",
    {
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "what the subagent should do"},
            "title": {"type": "string", "description": "a short name for it (optional)"},
        },
        "required": ["task"],
    },
)


class SpawnRefused(Exception):
    """`turn.spawn_subagent` was refused: the limits, or a task that is not one."""


@dataclass(frozen=True)
class Limits:
    """`subagents.max_depth` and `subagents.max_children`, and the agent classes a child
    may name (`agent.allowed`; empty: any name, checked when its turn builds the agent)."""

    max_depth: int = 2
    max_children: int = 8
    agents: tuple[str, ...] = ()
    max_per_root: int = 0  # subagents of one tree not closed (0: no limit)

    @property
    def enabled(self) -> bool:
        return self.max_depth > 0 and self.max_children > 0


class Spawner(SessionDesk):
    """Spawns the subagents of one session's turns, with the lease token they write with."""

    def __init__(
        self,
        session_id: str,
        store: Store,
        token: Callable[[], int],
        notify: Notify,
        limits: Limits,
    ) -> None:
        super().__init__(session_id, store, token, notify)
        self.limits = limits

    async def spawn(
        self,
        task: Any,
        turn_id: str,
        *,
        agent: str | None = None,
        title: str | None = None,
        call_id: str | None = None,
    ) -> str:
        """Start a child for `task`; its session id. SpawnRefused saying why it may not."""
        if agent and self.limits.agents and agent not in self.limits.agents:
            raise SpawnRefused(f"agent {agent!r} is not one the operator allows (agent.allowed)")
        try:
            spawned = await asyncio.to_thread(
                self._store.subagents.spawn,
                self.session_id,
                task,
                token=self._token(),
                turn_id=turn_id,
                max_depth=self.limits.max_depth,
                max_children=self.limits.max_children,
                max_per_root=self.limits.max_per_root,
                title=title or "",
                agent=agent,
                call_id=call_id,
            )
        except (Refused, ValueError) as exc:
            raise SpawnRefused(str(exc)) from exc
        if spawned.new:
            # Signals only: the supervisor wakes the child (its task is pending input).
            await self._committed(self.session_id, spawned.spawned_seq, EventType.SUBAGENT_SPAWNED)
            await self._committed(spawned.child.id, spawned.task_seq, EventType.USER_MESSAGE)
        return spawned.child.id

    async def call(self, arguments: dict[str, Any], turn_id: str, call_id: str) -> ToolOutcome:
        """The `spawn_subagent` tool: an error result the model reads when refused."""
        title = arguments.get("title")
        try:
            child = await self.spawn(
                arguments.get("task"),
                turn_id,
                title=title if isinstance(title, str) else None,
                call_id=call_id,
            )
        except SpawnRefused as exc:
            return ToolOutcome(f"no subagent started: {exc}", is_error=True)
        return ToolOutcome(started(child))


def started(child: str) -> str:
    """The tool's result for a child started (also what a repaired call says)."""
    return (
        f"started subagent {child}; its result will arrive in this conversation as a "
        "message when it is done"
    )
