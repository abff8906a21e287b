"""The task registry: admit a background task with its `task_started`, start it once,
record its outcome, report it to its session once, and move on a task whose runner went.

The rules are `supervisor.tasks.rules`'s. Every write is one transaction:
- `start` writes the session's `task_started` (with the turn's lease token: a turn fenced
  out starts nothing) and the row, `pending`;
- `claim` takes a pending row for one daemon (`pending` -> `running`, compare and set);
- the runner renews `heartbeat_at` (`heartbeat`) and records the outcome (`record`), each
  only while the row is still its attempt's and `running`;
- `report` writes the session's `task_result` and `result_seq` together, once;
- `lose` writes `lost` with its `task_result` and a `notice`, or, for a kind that retries,
  puts the row back to `pending` (attempt 2) with a `notice`.

Rows are locked session first, then task row, everywhere. `result_seq` 0 means the
outcome had no session to go to (it was closed or deleted). The reads: a task, a
session's tasks, the tasks a principal may read, the counts, and what a reconcile pass
looks at.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import EventType, SessionStatus, TaskStatus, Writer
from supervisor.store import lifecycle
from supervisor.store.claims import Claims
from supervisor.store.db import db_now, run_write
from supervisor.store.errors import LeaseLost
from supervisor.store.eventlog import make_request
from supervisor.store.events import call_key
from supervisor.store.models import Session, SessionACL, Task
from supervisor.tasks import rules

__all__ = ["Started", "TaskInfo", "TaskReported", "Tasks"]

CLAIMS = Claims(Task)  # no expiry: a running task's runner is judged by its heartbeat
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
    """The task row, locked for the open write transaction on the server databases."""
    query = Task.select().where(Task.id == task_id)
    if Task._meta.database.for_update:
        query = query.for_update()
    row: Task | None = query.first()
    return row


class Tasks:
    """The registry of background tasks."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    # --- admit ----------------------------------------------------------------------

    def start(
        self,
        session_id: str,
        kind: str,
        args: dict[str, str],
        *,
        token: int,
        turn_id: str | None,
        max_running: int,
        max_running_total: int = 1 << 30,
        max_running_per_principal: int = 1 << 30,
        call_id: str | None = None,
    ) -> Started:
        """Admit a task of `kind` with checked `args`, as the session's turn holding `token`.

        LeaseLost if the token is not the session's; `rules.TaskRefused` (saying why) past
        `max_running` or for a session that is not open. With `call_id`, the same tool call
        of the same turn made again (a continued turn) gets the task it started. Past
        `max_running_total` or `max_running_per_principal` (counting the tasks running, and
        its principal's pending before it) it is admitted all the same, to wait `pending` in order:
        `Started.waits` says why.
        """
        key = call_key(call_id)

        def work() -> Started:
            session = lifecycle.locked_row(session_id)
            if session.lease_token != token:
                raise LeaseLost(session_id, token, session.lease_token)
            if key is not None:
                earlier = Task.get_or_none(
                    (Task.session == session_id) & (Task.call_id == key) & (Task.turn_id == turn_id)
                )
                if earlier is not None:
                    return Started(info_of(earlier), int(earlier.started_seq), False)
            if session.status != SessionStatus.OPEN:
                raise rules.TaskRefused(f"this session is {session.status}: it starts no task")
            live = Task.select().where((Task.session == session_id) & Task.status.in_(LIVE)).count()
            if live >= max_running:
                raise rules.TaskRefused(
                    f"this session has {live} tasks pending or running; at most "
                    f"{max_running} at once (tasks.max_running): collect one first"
                )
            task_id = "t" + uuid.uuid4().hex
            payload = {"task": task_id, "kind": kind, "args": args, "call_id": call_id}
            (seq,) = lifecycle.append_all(
                self._db,
                [
                    make_request(
                        session_id, EventType.TASK_STARTED, payload, token=token, turn_id=turn_id
                    )
                ],
            )
            ahead = self._ahead(session.principal)
            waits = rules.waits(
                *ahead, max_total=max_running_total, max_per_principal=max_running_per_principal
            )
            Task.insert(
                id=task_id,
                session=session_id,
                principal=session.principal,
                kind=kind,
                args=json.dumps(args),
                status=TaskStatus.PENDING,
                call_id=key,
                turn_id=turn_id,
                started_seq=seq,
                created_at=SYSTEM.time(),
            ).execute()
            return Started(info_of(Task.get(Task.id == task_id)), seq, True, waits)

        result: Started = run_write(self._db, work)
        return result

    def now(self) -> float:
        """The database clock, which heartbeats are judged by."""
        return db_now(self._db)

    # --- a daemon starts it ---------------------------------------------------------

    @staticmethod
    def _ahead(principal: str | None) -> tuple[int, int]:
        """What a new task of `principal` would wait behind: the tasks running, and its
        principal's running or pending (each of those starts before it)."""
        running = Task.select().where(Task.status == TaskStatus.RUNNING).count()
        live = Task.select().where(Task.status.in_(LIVE) & (Task.principal == principal))
        return int(running), int(live.count())

    @staticmethod
    def _running_counts(principal: str | None) -> tuple[int, int]:
        """The tasks running, in all and of `principal`."""
        running = Task.select().where(Task.status == TaskStatus.RUNNING)
        return int(running.count()), int(running.where(Task.principal == principal).count())

    def claim(
        self,
        task_id: str,
        host: str,
        owner: str,
        max_total: int = 1 << 30,
        max_per_principal: int = 1 << 30,
    ) -> TaskInfo | None:
        """Take a pending task for this daemon: `running` on `host`, heard from now. None
        if it is not pending (another daemon took it, or it was cancelled), or if
        `max_total` tasks run already, or `max_per_principal` of its principal's: it then
        stays pending for a later pass (counted in this transaction; on a server database
        two daemons claiming at the same instant may each pass a cap by one)."""

        def work() -> TaskInfo | None:
            row = Task.get_or_none(Task.id == task_id)
            if row is None or row.status != TaskStatus.PENDING:
                return None
            counts = self._running_counts(row.principal)
            if rules.waits(*counts, max_total=max_total, max_per_principal=max_per_principal):
                return None
            now = db_now(self._db)
            taken = (
                Task.update(
                    CLAIMS.claimed(owner, None),
                    status=TaskStatus.RUNNING,
                    host=host,
                    started_at=now,
                    heartbeat_at=now,
                    runner_pid=None,
                    runner_started=None,
                )
                .where((Task.id == task_id) & (Task.status == TaskStatus.PENDING))
                .execute()
            )
            return info_of(Task.get(Task.id == task_id)) if taken else None

        result: TaskInfo | None = run_write(self._db, work)
        return result

    def set_runner(self, task_id: str, attempt: int, pid: int, create_time: float) -> bool:
        """Its runner's process; False if the row is no longer this attempt's run."""
        return bool(
            run_write(
                self._db,
                lambda: (
                    Task.update(runner_pid=pid, runner_started=create_time)
                    .where(self._this_run(task_id, attempt))
                    .execute()
                ),
            )
        )

    # --- the runner -----------------------------------------------------------------

    def heartbeat(self, task_id: str, attempt: int) -> bool | None:
        """The runner is alive: renew `heartbeat_at`. Returns whether a cancel was asked,
        or None if the row is no longer this attempt's run (the runner stops its command)."""

        def work() -> bool | None:
            now = db_now(self._db)
            if not Task.update(heartbeat_at=now).where(self._this_run(task_id, attempt)).execute():
                return None
            flag = Task.select(Task.cancel_requested).where(Task.id == task_id).scalar()
            return bool(flag)

        result: bool | None = run_write(self._db, work)
        return result

    def record(
        self,
        task_id: str,
        attempt: int,
        status: TaskStatus,
        *,
        exit_code: int | None,
        duration: float | None,
        output_tail: str,
        reason: str = "",
    ) -> bool:
        """The runner's outcome; False if the row is no longer this attempt's run (it was
        marked lost meanwhile: that outcome stands)."""
        assert status.final
        return bool(
            run_write(
                self._db,
                lambda: (
                    Task.update(
                        CLAIMS.cleared(),
                        status=status,
                        exit_code=exit_code,
                        duration=duration,
                        output_tail=rules.tail(output_tail),
                        reason=reason[:2000],
                        ended_at=SYSTEM.time(),
                    )
                    .where(self._this_run(task_id, attempt))
                    .execute()
                ),
            )
        )

    @staticmethod
    def _this_run(task_id: str, attempt: int) -> Any:
        return (
            (Task.id == task_id) & (Task.attempt == attempt) & (Task.status == TaskStatus.RUNNING)
        )

    # --- the one report -------------------------------------------------------------

    def report(self, task_id: str) -> TaskReported | None:
        """If the task's outcome is recorded and not reported, write its `task_result`
        (which wakes its session); else None."""

        def work() -> TaskReported | None:
            row = Task.get_or_none(Task.id == task_id)
            if row is None or not TaskStatus(row.status).final or row.result_seq is not None:
                return None
            session = lifecycle.locked_row_if_any(row.session)
            row = locked(task_id)
            if row is None or not TaskStatus(row.status).final or row.result_seq is not None:
                return None
            return self._report_within(row, session)

        result: TaskReported | None = run_write(self._db, work)
        return result

    def _report_within(
        self, row: Task, session: Session | None, notice: str | None = None
    ) -> TaskReported:
        """Inside the open transaction, the rows locked: `task_result` (and `notice`)."""
        text = rules.result_text(
            row.id,
            row.kind,
            row.status,
            exit_code=row.exit_code,
            duration=row.duration,
            reason=row.reason or "",
            output_tail=row.output_tail or "",
        )
        seq, notice_seq = 0, None
        if session is not None and session.status != SessionStatus.CLOSED:
            payload = {
                "task": row.id,
                "kind": row.kind,
                "status": row.status,
                "exit_code": row.exit_code,
                "duration": row.duration,
                "text": text,
                "output": f"/v1/tasks/{row.id}/output",
            }
            requests = [
                make_request(row.session, EventType.TASK_RESULT, payload, writer=Writer.SUPERVISOR)
            ]
            if notice is not None:
                requests.append(
                    make_request(
                        row.session,
                        EventType.NOTICE,
                        {"text": notice, "task": row.id},
                        writer=Writer.SUPERVISOR,
                    )
                )
            seqs = lifecycle.append_all(self._db, requests)
            seq, notice_seq = seqs[0], (seqs[1] if notice is not None else None)
        Task.update(CLAIMS.cleared(), result_seq=seq).where(Task.id == row.id).execute()
        return TaskReported(row.id, row.session, row.status, seq, notice_seq)

    # --- a runner gone --------------------------------------------------------------

    def lose(
        self, task_id: str, attempt: int, lost_grace: float, retry: bool
    ) -> TaskReported | None:
        """A running task whose run `attempt` was not heard from for `lost_grace`: with
        `retry` (its kind retries and this was its first attempt), pending again with a
        notice (returned with seq 0 and status `pending`); else `lost` (`cancelled` if a
        cancel was asked), reported with a notice. None if it was heard from meanwhile, or
        the row is another attempt's by now (another daemon judged it first)."""

        def work() -> TaskReported | None:
            row = Task.get_or_none(Task.id == task_id)
            if row is None or row.status != TaskStatus.RUNNING:
                return None
            session = lifecycle.locked_row_if_any(row.session)
            row = locked(task_id)
            now = db_now(self._db)
            if row is None or row.status != TaskStatus.RUNNING or row.attempt != attempt:
                return None
            if row.heartbeat_at is not None and now - row.heartbeat_at < lost_grace:
                return None
            notes = {"task": row.id, "kind": row.kind}
            if retry and not row.cancel_requested:
                Task.update(
                    CLAIMS.cleared(),
                    status=TaskStatus.PENDING,
                    attempt=row.attempt + 1,
                    host=None,
                    runner_pid=None,
                    runner_started=None,
                    heartbeat_at=None,
                ).where(Task.id == task_id).execute()
                notice_seq = None
                if session is not None and session.status != SessionStatus.CLOSED:
                    text = rules.RETRY_NOTICE.format(**notes)
                    (notice_seq,) = lifecycle.append_all(
                        self._db,
                        [
                            make_request(
                                row.session,
                                EventType.NOTICE,
                                {"text": text, "task": row.id},
                                writer=Writer.SUPERVISOR,
                            )
                        ],
                    )
                return TaskReported(row.id, row.session, TaskStatus.PENDING, 0, notice_seq)
            status = TaskStatus.CANCELLED if row.cancel_requested else TaskStatus.LOST
            reason = "" if row.cancel_requested else rules.LOST_REASON
            Task.update(status=status, reason=reason, ended_at=SYSTEM.time()).where(
                Task.id == task_id
            ).execute()
            row = Task.get(Task.id == task_id)
            notice = None if row.cancel_requested else rules.LOST_NOTICE.format(**notes)
            return self._report_within(row, session, notice)

        result: TaskReported | None = run_write(self._db, work)
        return result

    # --- cancel ---------------------------------------------------------------------

    def live_of_principals(self, principals: list[str], limit: int = 10_000) -> list[str]:
        """The pending and running tasks of `principals`' sessions, oldest first."""
        query = (
            Task.select(Task.id)
            .where(Task.status.in_(LIVE) & Task.principal.in_(principals))
            .order_by(Task.created_at, Task.id)
            .limit(limit)
        )
        return [row.id for row in query]

    def cancel(self, task_id: str) -> TaskInfo | None:
        """Ask for the task to stop. A pending one is `cancelled` at once (its report is
        `report`'s); a running one gets `cancel_requested`, which its runner acts on. None
        if there is no such task."""

        def work() -> TaskInfo | None:
            row = locked(task_id)
            if row is None:
                return None
            if row.status == TaskStatus.PENDING:
                Task.update(
                    status=TaskStatus.CANCELLED, cancel_requested=True, ended_at=SYSTEM.time()
                ).where(Task.id == task_id).execute()
            elif row.status == TaskStatus.RUNNING:
                Task.update(cancel_requested=True).where(Task.id == task_id).execute()
            return info_of(Task.get(Task.id == task_id))

        result: TaskInfo | None = run_write(self._db, work)
        return result

    # --- reading --------------------------------------------------------------------

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

    def to_reconcile(
        self, lost_grace: float, limit: int = 500, now: float | None = None
    ) -> list[TaskInfo]:
        """What a reconcile pass looks at, each kind of row with a limit of its own, so
        that long-running tasks never crowd the others out: pending rows, outcomes not
        reported, and running rows not heard from for `lost_grace` by the database clock
        (at `now`, read from it if not given).
        """
        if now is None:
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

    def heard(self, limit: int = 100_000) -> list[tuple[str, float | None]]:
        """The running tasks, each with when its runner was last heard from (database
        clock): when each falls due for a pass."""
        query = Task.select(Task.id, Task.heartbeat_at).where(Task.status == TaskStatus.RUNNING)
        return [(str(row.id), row.heartbeat_at) for row in query.limit(limit)]

    def running_on(self, host: str, limit: int = 100_000) -> list[TaskInfo]:
        """The tasks running on `host` whose runner's process is known."""
        query = (
            Task.select()
            .where(
                (Task.status == TaskStatus.RUNNING)
                & (Task.host == host)
                & Task.runner_pid.is_null(False)
            )
            .order_by(Task.created_at, Task.id)
            .limit(limit)
        )
        return [info_of(row) for row in query]

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
