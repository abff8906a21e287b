"""Background tasks from inside a turn: the `start_task` tool and what `turn.start_task` does.

A task is a command of a kind the operator defined (`[[tasks.kinds]]`); the model (or the
agent) only names the kind and gives its arguments, each checked whole against the kind's
pattern for it (`supervisor.tasks.rules.check_args`). A start is one transaction of the
store (`supervisor.store.tasks`): the session's `task_started` and the task's row, written
with the turn's lease token, so a turn fenced out starts nothing. The supervisor runs the
task apart from any worker and tells the session its outcome later (`task_result`, which
the session's next turn reads).

Refused, with the reason in words the model can act on (an error result of the tool, or
`TaskRefused` from `turn.start_task`): a kind that is not one of the operator's,
arguments that do not fit it, more than `tasks.max_running` tasks of the session pending
or running, and tasks turned off (`tasks.max_running` 0, or no kinds). A tool call that
started a task before a crash starts no second one when its turn is continued and the
call is made again: the call id is kept with the task.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.contract.task_kinds import TasksConfig
from supervisor.core.vocabulary import EventType
from supervisor.store import Started, Store
from supervisor.tasks.rules import KindRules, TaskRefused, check_args
from workers.desk import Notify, SessionDesk
from workers.models import ToolSpec
from workers.tools import ToolOutcome

__all__ = ["TOOL", "Kinds", "Starter", "TaskRefused", "result_message", "started"]

TOOL = "start_task"
OFF = "background tasks are off here (tasks.max_running is 0, or no [[tasks.kinds]] is configured)"


@dataclass(frozen=True)
class Kinds:
    """The operator's task kinds and `tasks.max_running` (per session), as the worker
    checks a start against them."""

    kinds: tuple[KindRules, ...] = ()
    max_running: int = 0
    max_running_total: int = 32  # past these a start waits `pending`: the result says so
    max_running_per_principal: int = 8

    @classmethod
    def of(cls, config: TasksConfig) -> Kinds:
        """The `[tasks]` section's kinds and limits."""
        return cls(
            tuple(kind.rules() for kind in config.kinds),
            config.max_running,
            config.max_running_total,
            config.max_running_per_principal,
        )

    @property
    def enabled(self) -> bool:
        return self.max_running > 0 and bool(self.kinds)

    def get(self, name: Any) -> KindRules | None:
        """The kind called `name`, or None."""
        return next((kind for kind in self.kinds if kind.name == name), None)

    def listed(self) -> str:
        """Each kind with its argument names, for the tool's description and refusals."""
        return "; ".join(
            f"{k.name} (args: {', '.join(sorted(k.args))})" if k.args else f"{k.name} (no args)"
            for k in self.kinds
        )


def spec(kinds: Kinds) -> ToolSpec:
    """The `start_task` tool, its description naming the operator's kinds."""
    return ToolSpec(
        TOOL,
        "Start a background task: a command the operator defined, which runs apart from "
        "this conversation and may take long. Do not wait for it: its outcome (exit status "
        "and the end of its output) arrives here as a message once it ends. `kind` must be "
        f"one of the operator's task kinds: {kinds.listed()}. `args` gives a value (a "
        "string or a number) to each argument of the kind, and to no other.",
        {
            "type": "object",
            "properties": {
                "kind": {
                    "type": "string",
                    "enum": [kind.name for kind in kinds.kinds],
                    "description": "the task kind, one of the operator's",
                },
                "args": {
                    "type": "object",
                    "description": "the kind's arguments by name (omit for a kind without any)",
                    "additionalProperties": True,
                },
            },
            "required": ["kind"],
        },
    )


class Starter(SessionDesk):
    """Starts the background tasks of one session's turns, with the lease token they
    write with."""

    def __init__(
        self,
        session_id: str,
        store: Store,
        token: Callable[[], int],
        notify: Notify,
        kinds: Kinds,
    ) -> None:
        super().__init__(session_id, store, token, notify)
        self.kinds = kinds
        self.spec = spec(kinds)

    @property
    def enabled(self) -> bool:
        """Tasks may be started: the tool is offered."""
        return self.kinds.enabled

    async def start(self, kind: Any, args: Any, turn_id: str, *, call_id: str | None) -> str:
        """Start a task of `kind` with `args`; its id. TaskRefused saying why it may not."""
        return (await self._start(kind, args, turn_id, call_id=call_id)).task.id

    async def _start(self, kind: Any, args: Any, turn_id: str, *, call_id: str | None) -> Started:
        if not self.enabled:
            raise TaskRefused(OFF)
        rules = self.kinds.get(kind)
        if rules is None:
            raise TaskRefused(
                f"there is no task kind {str(kind)[:64]!r}; the operator's kinds are: "
                f"{self.kinds.listed()}"
            )
        checked = check_args(rules, args)
        started = await asyncio.to_thread(
            self._store.tasks.start,
            self.session_id,
            rules.name,
            checked,
            token=self._token(),
            turn_id=turn_id,
            max_running=self.kinds.max_running,
            max_running_total=self.kinds.max_running_total,
            max_running_per_principal=self.kinds.max_running_per_principal,
            call_id=call_id,
        )
        if started.new:
            # A signal only: the supervisor's launcher starts the task's runner.
            await self._committed(self.session_id, started.seq, EventType.TASK_STARTED)
        return started

    async def start_once(self, kind: str, args: Any, turn_id: str, number: int) -> str:
        """`turn.start_task`: the `number`-th start of this kind and these arguments in a
        run of the turn. A continued turn runs its agent from the top: the same starts, in
        the same order, get the tasks they started before, not new ones."""
        text = json.dumps([kind, args], sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]
        key = f"turn.start_task:{number}:{digest}"
        return await self.start(kind, args, turn_id, call_id=key)

    async def call(self, arguments: dict[str, Any], turn_id: str, call_id: str) -> ToolOutcome:
        """The `start_task` tool: an error result the model reads when refused."""
        kind = arguments.get("kind")
        try:
            begun = await self._start(kind, arguments.get("args"), turn_id, call_id=call_id)
        except TaskRefused as exc:
            return ToolOutcome(f"no task started: {exc}", is_error=True)
        return ToolOutcome(started(begun.task.id, str(kind), begun.waits))


def started(task: str, kind: str, waits: str | None = None) -> str:
    """The tool's result for a task started (also what a repaired call says); `waits`:
    why it is queued instead of running at once."""
    queued = f"; it is queued, not running yet: {waits}" if waits else ""
    return (
        f"started task {task} ({kind}){queued}; its outcome will arrive in this conversation "
        "as a message when it ends"
    )


def result_message(payload: dict[str, Any]) -> str:
    """A `task_result` as the session's model reads it."""
    text = payload.get("text")
    if not isinstance(text, str) or not text:  # the store always writes one; say what is known
        text = f"task {payload.get('task')} ({payload.get('kind')}) ended: {payload.get('status')}."
    return f"[background task result] {text}"
