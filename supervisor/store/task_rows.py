"""The task registry's rows as the rest of the daemon sees them, the row lock, and the
registry's reads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import peewee

from supervisor.core.vocabulary import TaskStatus
from supervisor.store.db import db_now
from supervisor.store.models import SessionACL, Task

LIVE = (TaskStatus.PENDING, TaskStatus.RUNNING)


@dataclass(frozen=True)
class TaskInfo:
    """A task's registry row."""

    id: str
    session: str
    kind: str
    args: dict[str, str]
    status: str
    attempt: int
    started_seq: int
    result_seq: int | None
    turn_id: str | None
    call_id: str | None
    host: str | None
    runner_pid: int | None
    runner_started: float | None
    exit_code: int | None
    duration: float | None
    output_tail: str
    reason: str
    cancel_requested: bool
    created_at: float
    started_at: float | None
    heartbeat_at: float | None
    ended_at: float | None

    @property
    def reported(self) -> bool:
        """Its outcome went to its session (or it had none to go to)."""
        return self.result_seq is not None

    def as_dict(self) -> dict[str, Any]:
        """For the API and `--json`."""
        return asdict(self)


@dataclass(frozen=True)
class Started:
    """A task `start` admitted, or the one the same tool call admitted before (`new` False)."""

    task: TaskInfo
    seq: int  # the session's `task_started`
    new: bool
    waits: str | None = None  # why it waits `pending` for a free slot, if it does


@dataclass(frozen=True)
class TaskReported:
    """An outcome written to its session: its `task_result` (seq 0: no session took it)."""

    task: str
    session: str
    status: str
    seq: int
    notice_seq: int | None = None


def info_of(row: Task) -> TaskInfo:
    try:
        args = json.loads(row.args or "{}")
    except ValueError:
        args = {}
    if not isinstance(args, dict):
        args = {}
    return TaskInfo(
        id=row.id,
        session=row.session,
        kind=row.kind,
        args={str(k): str(v) for k, v in args.items()},
        status=row.status,
        attempt=int(row.attempt),
        started_seq=int(row.started_seq),
        result_seq=None if row.result_seq is None else int(row.result_seq),
        turn_id=row.turn_id,
        call_id=row.call_id,
        host=row.host,
        runner_pid=row.runner_pid,
        runner_started=row.runner_started,
        exit_code=row.exit_code,
        duration=row.duration,
        output_tail=row.output_tail or "",
        reason=row.reason or "",
        cancel_requested=bool(row.cancel_requested),
        created_at=row.created_at,
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        ended_at=row.ended_at,
    )


def locked(task_id: str) -> Task | None:
    query = Task.select().where(Task.id == task_id)
    if Task._meta.database.for_update:
        query = query.for_update()
    row: Task | None = query.first()
    return row


class Reading:
    """The registry read: a task, a session's tasks, the tasks a principal may read, the
    counts, and what a reconcile pass looks at."""

    def get(self, task_id: str) -> TaskInfo | None:
        """The row of a task, or None."""
        row = Task.get_or_none(Task.id == task_id)
        return None if row is None else info_of(row)

    def of_session(self, session_id: str, limit: int = 1000) -> list[TaskInfo]:
        """The tasks of a session, oldest first."""
        query = (
            Task.select()
            .where(Task.session == session_id)
            .order_by(Task.created_at, Task.id)
            .limit(limit)
        )
        return [info_of(row) for row in query]

    def counts(self) -> dict[str, int]:
        """Tasks by status (every status, 0 included)."""
        counts = {status.value: 0 for status in TaskStatus}
        query = Task.select(Task.status, peewee.fn.COUNT(Task.id)).group_by(Task.status)
        found: list[tuple[str, int]] = list(query.tuples())  # type: ignore[arg-type]
        for status, number in found:
            counts[str(status)] = int(number)
        return counts

    def to_reconcile(self, lost_grace: float, limit: int = 500) -> list[TaskInfo]:
        """What a reconcile pass looks at, each kind of row with a limit of its own, so
        that long-running tasks never crowd the others out: pending rows, outcomes not
        reported, and running rows not heard from for `lost_grace` by the database clock.
        """
        now = db_now(Task._meta.database)
        stale = Task.heartbeat_at.is_null() | (Task.heartbeat_at < now - lost_grace)
        found: list[TaskInfo] = []
        for where in (
            Task.status == TaskStatus.PENDING,
            Task.result_seq.is_null() & Task.status.not_in(LIVE),
            (Task.status == TaskStatus.RUNNING) & stale,
        ):
            query = Task.select().where(where).order_by(Task.created_at, Task.id).limit(limit)
            found += [info_of(row) for row in query]
        return found

    def live_ids(self, limit: int = 100_000) -> set[str]:
        """The ids of the pending and running tasks."""
        query = Task.select(Task.id).where(Task.status.in_(LIVE)).limit(limit)
        return {row.id for row in query}

    def listed(
        self, statuses: Sequence[str] = (), limit: int = 100, principal: str | None = None
    ) -> list[TaskInfo]:
        """Tasks newest first, of `statuses` (all when empty) and, with `principal`, only
        those of sessions it holds a permission on."""
        query = Task.select()
        if statuses:
            query = query.where(Task.status.in_(list(statuses)))
        if principal is not None:
            query = query.join(SessionACL, on=(SessionACL.session == Task.session)).where(
                SessionACL.principal == principal
            )
        query = query.order_by(Task.created_at.desc(), Task.id.desc()).limit(limit)
        return [info_of(row) for row in query]
