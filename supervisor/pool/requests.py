"""What requests tell the pool about sessions and tasks: signals only, each carried out by
the part of the pool it concerns (`Ownership`, the task keeper)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from supervisor.core.vocabulary import INPUT_EVENTS
from supervisor.pool.ownership import Ownership
from supervisor.tasks.service import TaskKeeper


class Requests:
    """The request side of `supervisor.pool.pool.Pool`."""

    ownership: Ownership
    task_keeper: TaskKeeper
    on_event: list[Callable[[str, dict[str, Any]], None]]

    def wake(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one."""
        self.ownership.wake(session_id)

    def committed(self, session_id: str, seq: int, event_type: str, wake: bool = True) -> None:
        """An event was committed (only a signal: readers read it from the database); new
        input (a subagent's task, or its result) wakes its session's owner."""
        for callback in self.on_event:
            callback(session_id, {"seq": seq, "type": event_type})
        if wake and event_type in INPUT_EVENTS:
            self.wake(session_id)

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on."""
        self.ownership.touch(session_id)

    def interrupt(self, session_id: str) -> None:
        """The session's turn was ended in the database (interrupt, close): stop it now."""
        self.ownership.interrupt(session_id)

    def cancel_task(self, task_id: str) -> None:
        """A cancel of the task was committed: signal its runner now if it is ours."""
        self.task_keeper.cancel(task_id)
