"""The agent plug-in API.

An agent is any class with `async def run_turn(self, turn: Turn) -> str`, named in the
configuration as `package.module:Class` and built with no arguments, once per session.
The `Turn` it is handed commits every model call and tool call as an event by itself, so
an agent gets per-event durability without writing any storage code. `run_turn` returns
the outcome: "completed", or "truncated" when the model was cut by its token limit.

An agent may be asked to continue a turn that a crash interrupted, that it returned as
"truncated" after an answer cut at the token limit, or that failed on a model error that
may pass (`ModelError.transient`): `turn.messages` then holds everything committed so far,
with a note saying what happened. Such continuations are bounded by the turn's attempts.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Protocol, runtime_checkable

from supervisor.core.vocabulary import TurnOutcome
from workers.models import Message, ModelResponse, ToolCall, ToolSpec
from workers.tools import ToolOutcome

OUTCOMES = (TurnOutcome.COMPLETED, TurnOutcome.TRUNCATED)  # what run_turn may return


class Turn(Protocol):
    """What an agent can do in a turn; every call below commits its events."""

    session_id: str
    turn_id: str

    @property
    def messages(self) -> list[Message]:
        """The conversation so far, this turn included."""
        ...

    @property
    def tools(self) -> list[ToolSpec]:
        """The tools on offer."""
        ...

    async def call_model(self) -> ModelResponse:
        """Ask the model to answer `messages`; commits a `model_response` event."""
        ...

    async def call_tool(self, call: ToolCall) -> ToolOutcome:
        """Run one tool call: commits `tool_call` before it runs and `tool_result` after."""
        ...

    async def notice(self, text: str) -> None:
        """Tell the user something outside the conversation; commits a `notice` event."""
        ...

    async def spawn_subagent(
        self, task: str, *, agent: str | None = None, title: str | None = None
    ) -> str:
        """Start a subagent (a child session) for `task`; its session id. Its result
        comes back as a `subagent_result` that the session's next turn reads. Raises
        `workers.spawning.SpawnRefused` past `subagents.max_depth`/`max_children`."""
        ...

    async def start_task(self, kind: str, args: dict[str, Any] | None = None) -> str:
        """Start a background task of the operator's `kind` with `args`; its id. Its outcome
        comes back as a `task_result` that the session's next turn reads. Raises
        `workers.tasking.TaskRefused` (saying why) for an unknown kind, arguments that do
        not fit it, past `tasks.max_running`, or with tasks off."""
        ...

    async def request_restart(self, reason: str) -> str:
        """Ask for a restart of the daemon; the request's id (the one in progress, if a
        restart already is). It restarts once the turn ends; the outcome comes back as a
        `restart_result` that the session's next turn reads. Raises
        `workers.restarting.RestartRefused` (saying why) unless
        `restart.agent_may_request`, or within `restart.min_interval` of the last."""
        ...


@runtime_checkable
class Agent(Protocol):
    """An agent plug-in."""

    async def run_turn(self, turn: Turn) -> str:
        """Run one turn to its end; returns "completed" or "truncated"."""
        ...


class AgentLoadError(Exception):
    """`agent.class` does not name a usable agent class."""


def load_agent_class(spec: str) -> type[Agent]:
    """Import `package.module:Class`; AgentLoadError with what to fix if it fails."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise AgentLoadError(f"agent.class must look like package.module:Class, not {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # an import runs the module's code: SystemExit included
        raise AgentLoadError(
            f"agent.class {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not inspect.iscoroutinefunction(getattr(cls, "run_turn", None)):
        raise AgentLoadError(
            f"agent.class {spec!r}: {class_name} is not a class with an async run_turn(turn)"
        )
    return cls
