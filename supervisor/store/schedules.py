"""Schedules and their fires: one row per schedule, one row per scheduled time decided.

The rules are `supervisor.schedules.rules`'s. A fire row is keyed by (schedule,
scheduled_for) and written only for a time after the schedule's newest one, under the
schedule row's lock, before its message is injected: a time that another daemon (or an
earlier boot) decided is never decided again. A fire with neither `seq` (its message is in
its session) nor `reason` (why it never will be) is owed its message; a booting daemon
finishes it, and any daemon once it is old enough (`fired_at` is the database clock's),
with the same idempotency key, so a crash in between injects it once.

A fire of a schedule with no session makes a session of kind `scheduled`, its owner's ACL
row, its message and the fire's `seq` in one transaction.

`on_change` callbacks run after a schedule was created or deleted (in the writer's
thread): the scheduler of this process looks again at once.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import (
    ADMIN_PRINCIPAL,
    EventType,
    FireOutcome,
    Permission,
    ScheduleStatus,
    SessionKind,
    SessionStatus,
    Writer,
)
from supervisor.store import lifecycle
from supervisor.store.db import chunks, db_now, run_write
from supervisor.store.errors import SessionClosed, TooManySessions
from supervisor.store.eventlog import make_request
from supervisor.store.models import Schedule, ScheduleFire, Session, SessionACL
from supervisor.store.sessions import Sessions

KEEP_FIRES = 1000  # fire rows kept per schedule (the newest); older settled ones go
PRUNE_EVERY = 64  # a schedule's old rows are pruned after one in so many fires, on average


class ScheduleRefused(Exception):
    """A schedule that may not be made: schedules are off, or there are too many (in all,
    or of its owner)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule row as the rest of turnkeeper sees it."""

    id: str
    cron: str
    timezone: str
    text: str
    session: str | None
    owner: str | None
    misfire: str
    created_at: float
    armed_from: float
    status: str = ScheduleStatus.ACTIVE

    def to_dict(self) -> dict[str, Any]:
        """The API shape of a schedule (without its fire times)."""
        return {k: v for k, v in asdict(self).items() if k != "armed_from"}


@dataclass(frozen=True)
class FireInfo:
    """A fire row: one scheduled time of a schedule and what became of it."""

    id: int
    schedule: str
    scheduled_for: float
    outcome: str
    session: str | None
    seq: int | None
    fired_at: float
    fired_by: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """The API shape of a fire."""
        shown = {k: v for k, v in asdict(self).items() if k not in ("id", "schedule", "fired_by")}
        return shown | {"reason": self.reason or None}


def others_share(limit: int) -> int:
    """How many of `schedules.max_schedules` the principals other than the admin may have
    together: 90 %, so that the admin can always make one."""
    return limit * 9 // 10


def _schedule(row: Schedule) -> ScheduleInfo:
    return ScheduleInfo(**{name: getattr(row, name) for name in ScheduleInfo.__dataclass_fields__})


def _fire(row: ScheduleFire) -> FireInfo:
    values = {name: getattr(row, name) for name in FireInfo.__dataclass_fields__}
    values["seq"] = None if row.seq is None else int(row.seq)
    return FireInfo(**values)


class Schedules:
    """Schedules, their fires, and the sessions their fires make."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        self.on_change: list[Callable[[], None]] = []

    # --- schedules ------------------------------------------------------------------

    def create(
        self,
        *,
        cron: str,
        timezone: str,
        text: str,
        session: str | None,
        owner: str,
        misfire: str,
        limit: int,
        per_owner: int,
    ) -> ScheduleInfo:
        """A new schedule, armed from now. `cron` and `timezone` are checked already
        (`supervisor.contract.cron`); ScheduleRefused past `limit` schedules in all (0:
        schedules are off) or `per_owner` made by `owner`, SessionNotFound or
        SessionClosed for its session."""
        schedule_id = "s" + uuid.uuid4().hex
        now = SYSTEM.time()

        def work() -> None:
            if limit <= 0:
                raise ScheduleRefused(
                    "schedules_off", "schedules are turned off here (schedules.max_schedules = 0)"
                )
            if session is not None and lifecycle.locked_row(session).status == SessionStatus.CLOSED:
                raise SessionClosed(session)
            counted = Schedule.select().where(Schedule.status != ScheduleStatus.ENDED)
            if counted.where(Schedule.owner == owner).count() >= per_owner:
                raise ScheduleRefused(
                    "too_many_own_schedules",
                    f"{owner} has made {per_owner} schedules already (schedules.max_per_owner); "
                    "delete one of them first",
                )
            if counted.count() >= limit:
                raise ScheduleRefused(
                    "too_many_schedules",
                    f"there are {limit} schedules already (schedules.max_schedules); "
                    "delete one first",
                )
            shared = others_share(limit)
            others = counted.where(Schedule.owner != ADMIN_PRINCIPAL)
            if owner != ADMIN_PRINCIPAL and others.count() >= shared:
                raise ScheduleRefused(
                    "too_many_schedules",
                    f"principals other than the admin have {shared} schedules already, their "
                    f"share of schedules.max_schedules ({limit}; the rest is kept for the "
                    "admin); delete one first",
                )
            Schedule.insert(
                id=schedule_id,
                cron=cron,
                timezone=timezone,
                text=text,
                session=session,
                owner=owner,
                misfire=misfire,
                created_at=now,
                armed_from=now,
            ).execute()

        run_write(self._db, work)
        self._changed()
        found = self.get(schedule_id)
        assert found is not None
        return found

    def get(self, schedule_id: str) -> ScheduleInfo | None:
        row = Schedule.get_or_none(Schedule.id == schedule_id)
        return None if row is None else _schedule(row)

    def all(self) -> list[ScheduleInfo]:
        """Every schedule, oldest first."""
        return [_schedule(row) for row in Schedule.select().order_by(Schedule.created_at)]

    def active(self) -> list[ScheduleInfo]:
        """The schedules that fire (neither paused nor ended), oldest first."""
        query = Schedule.select().where(Schedule.status == ScheduleStatus.ACTIVE)
        return [_schedule(row) for row in query.order_by(Schedule.created_at)]

    def pause_owned_by(self, principals: Collection[str]) -> int:
        """Pause the active schedules `principals` made (their tokens were revoked): they
        are listed, and never fire while paused. How many were paused."""
        return self._set_status(principals, ScheduleStatus.ACTIVE, ScheduleStatus.PAUSED)

    def resume_owned_by(self, principals: Collection[str]) -> int:
        """Resume the paused schedules of `principals` (their tokens are back), armed from
        now: no time they were paused for is caught up. How many were resumed."""
        return self._set_status(principals, ScheduleStatus.PAUSED, ScheduleStatus.ACTIVE)

    def hold(self, schedule_id: str) -> bool:
        """Hold an active schedule (a user paused it): it never fires until `release`.
        False if it was not active (held already, paused, ended or gone)."""
        return self._set_one(schedule_id, ScheduleStatus.ACTIVE, ScheduleStatus.HELD)

    def release(self, schedule_id: str) -> bool:
        """Let a held schedule fire again, or a paused one whose owner's token is back (the
        caller checked), armed from now: no time it did not fire for is caught up. False
        if it was neither."""
        return self._set_one(
            schedule_id, (ScheduleStatus.HELD, ScheduleStatus.PAUSED), ScheduleStatus.ACTIVE
        )

    def _set_one(
        self, schedule_id: str, was: ScheduleStatus | tuple[ScheduleStatus, ...], status: str
    ) -> bool:
        changes: dict[Any, Any] = {Schedule.status: status}
        if status is ScheduleStatus.ACTIVE:
            changes[Schedule.armed_from] = SYSTEM.time()
        states = list(was) if isinstance(was, tuple) else [was]
        query = Schedule.update(changes).where(
            (Schedule.id == schedule_id) & Schedule.status.in_(states)
        )
        changed = bool(run_write(self._db, query.execute))
        if changed:
            self._changed()
        return changed

    def _set_status(
        self, principals: Collection[str], was: ScheduleStatus, status: ScheduleStatus
    ) -> int:
        if not principals:
            return 0
        changes: dict[Any, Any] = {Schedule.status: status}
        if status is ScheduleStatus.ACTIVE:
            changes[Schedule.armed_from] = SYSTEM.time()
        query = Schedule.update(changes).where(
            Schedule.owner.in_(list(principals)) & (Schedule.status == was)
        )
        changed = int(run_write(self._db, query.execute))
        if changed:
            self._changed()
        return changed

    def visible(self, principal: str | None = None, limit: int = 100) -> list[ScheduleInfo]:
        """Schedules oldest first; with `principal`, those it may read: on a session it
        holds any permission on, or its own that make a new session each run."""
        query = Schedule.select().order_by(Schedule.created_at, Schedule.id).limit(limit)
        if principal is not None:
            readable = SessionACL.select(SessionACL.session).where(
                SessionACL.principal == principal
            )
            query = query.where(
                Schedule.session.in_(readable)
                | (Schedule.session.is_null() & (Schedule.owner == principal))
            )
        return [_schedule(row) for row in query]

    def delete(self, schedule_id: str) -> bool:
        """Delete the schedule and its fires; False if there was none. A fire of it not
        yet injected never will be."""

        def work() -> bool:
            gone = Schedule.delete().where(Schedule.id == schedule_id).execute()
            ScheduleFire.delete().where(ScheduleFire.schedule == schedule_id).execute()
            return bool(gone)

        deleted = bool(run_write(self._db, work))
        if deleted:
            self._changed()
        return deleted

    def _changed(self) -> None:
        for callback in list(self.on_change):
            callback()

    # --- fires ----------------------------------------------------------------------

    def newest(self, schedule_ids: Collection[str]) -> dict[str, FireInfo]:
        """Each schedule's newest fire row (those that have one)."""
        found: dict[str, FireInfo] = {}
        for part in chunks(list(schedule_ids)):
            latest = (
                ScheduleFire.select(
                    ScheduleFire.schedule, peewee.fn.MAX(ScheduleFire.scheduled_for).alias("at")
                )
                .where(ScheduleFire.schedule.in_(part))
                .group_by(ScheduleFire.schedule)
            )
            rows = ScheduleFire.select().join(
                latest,
                on=(
                    (ScheduleFire.schedule == latest.c.schedule)
                    & (ScheduleFire.scheduled_for == latest.c.at)
                ),
            )
            found.update((row.schedule, _fire(row)) for row in rows)
        return found

    def record(
        self, schedule_id: str, fires: list[tuple[float, str, str]], by: str
    ) -> list[FireInfo]:
        """Commit fires (scheduled_for, outcome, reason), oldest first, in one transaction:
        those after the schedule's newest fire. Returns the rows written; none when the
        schedule is gone or no longer active (held, paused or ended since the times were
        planned), or every time was decided already (by another daemon, say)."""

        def work() -> list[FireInfo]:
            query = Schedule.select(Schedule.id).where(
                (Schedule.id == schedule_id) & (Schedule.status == ScheduleStatus.ACTIVE)
            )
            if self._db.for_update:  # two daemons deciding one schedule take turns
                query = query.for_update()
            if query.first() is None:
                return []
            newest = (
                ScheduleFire.select(peewee.fn.MAX(ScheduleFire.scheduled_for))
                .where(ScheduleFire.schedule == schedule_id)
                .scalar()
            )
            written: list[FireInfo] = []
            now = db_now(self._db)  # the clock `owed` judges a fire's age by
            for scheduled_for, outcome, reason in fires:
                if newest is not None and scheduled_for <= newest:
                    continue
                newest = scheduled_for
                row = FireInfo(
                    0,
                    schedule_id,
                    scheduled_for,
                    outcome,
                    None,
                    None,
                    now,
                    by,
                    reason if outcome == FireOutcome.SKIPPED else "",
                )
                fire_id = ScheduleFire.insert(
                    schedule=schedule_id,
                    scheduled_for=scheduled_for,
                    outcome=outcome,
                    fired_at=row.fired_at,
                    fired_by=by,
                    reason=row.reason,
                ).execute()
                written.append(replace(row, id=int(fire_id)))
            if written and random.random() < 1 / PRUNE_EVERY:
                self._prune(schedule_id)
            return written

        return run_write(self._db, work)

    def _prune(self, schedule_id: str) -> None:
        """Drop the schedule's settled fires older than its newest KEEP_FIRES."""
        cutoff = (
            ScheduleFire.select(ScheduleFire.scheduled_for)
            .where(ScheduleFire.schedule == schedule_id)
            .order_by(ScheduleFire.scheduled_for.desc())
            .offset(KEEP_FIRES)
            .limit(1)
            .scalar()
        )
        if cutoff is not None:
            ScheduleFire.delete().where(
                (ScheduleFire.schedule == schedule_id)
                & (ScheduleFire.scheduled_for <= cutoff)
                & (ScheduleFire.seq.is_null(False) | (ScheduleFire.reason != ""))
            ).execute()

    def fires(self, schedule_id: str, limit: int = KEEP_FIRES) -> list[FireInfo]:
        """The schedule's fires, oldest first (the newest `limit`)."""
        query = (
            ScheduleFire.select()
            .where(ScheduleFire.schedule == schedule_id)
            .order_by(ScheduleFire.scheduled_for.desc())
            .limit(limit)
        )
        return [_fire(row) for row in reversed(list(query))]

    def owed(self, limit: int = 1000, age: float = 0.0) -> list[FireInfo]:
        """Fires committed whose message is not in a session yet, oldest first; with
        `age`, those committed at least so many seconds ago (the database clock)."""
        query = (
            ScheduleFire.select()
            .where(ScheduleFire.seq.is_null() & (ScheduleFire.reason == ""))
            .order_by(ScheduleFire.id)
            .limit(limit)
        )
        if age > 0:
            query = query.where(ScheduleFire.fired_at <= db_now(self._db) - age)
        return [_fire(row) for row in query]

    def injected(self, fire_id: int, session_id: str, seq: int) -> None:
        """The fire's message is in `session_id` as `seq`."""
        run_write(
            self._db,
            lambda: (
                ScheduleFire.update(session=session_id, seq=seq)
                .where((ScheduleFire.id == fire_id) & ScheduleFire.seq.is_null())
                .execute()
            ),
        )

    def dropped(self, fire_id: int, reason: str) -> None:
        """The fire's message will never be injected, for `reason`."""
        run_write(
            self._db,
            lambda: (
                ScheduleFire.update(reason=reason[:1000] or "dropped")
                .where((ScheduleFire.id == fire_id) & ScheduleFire.seq.is_null())
                .execute()
            ),
        )

    def inject_new(
        self,
        fire_id: int,
        owner: str | None,
        title: str,
        payload: dict[str, Any],
        key: str,
        max_open: int = 0,
    ) -> tuple[str, int] | None:
        """The fire's message as the first event of a new session of kind `scheduled`,
        whose ACL gives `owner` admin (as a session's creator gets), in one transaction
        with the fire's `seq`: the session and its message, once. Returns (session, seq),
        the earlier ones if the fire was injected before; None if the fire is gone or
        dropped. An owner with `max_open` open sessions already gets none: the fire is
        dropped saying so (`auth.max_open_sessions_per_principal` bounds scheduled
        sessions as it bounds those made through the API)."""

        def work() -> tuple[str, int] | None:
            query = ScheduleFire.select().where(ScheduleFire.id == fire_id)
            if self._db.for_update:
                query = query.for_update()
            fire = query.first()
            if fire is None or fire.reason:
                return None
            if fire.seq is not None:
                return str(fire.session), int(fire.seq)
            if max_open and owner and Sessions.open_of(owner) >= max_open:
                reason = str(TooManySessions(owner, max_open))
                ScheduleFire.update(reason=reason).where(ScheduleFire.id == fire_id).execute()
                return None
            session_id = uuid.uuid4().hex
            now = SYSTEM.time()
            Session.insert(
                id=session_id,
                kind=SessionKind.SCHEDULED,
                title=title[:200],
                created_at=now,
                updated_at=now,
                principal=owner,
            ).execute()
            if owner:
                SessionACL.insert(
                    session=session_id, principal=owner, permission=Permission.ADMIN
                ).execute()
            message = make_request(
                session_id,
                EventType.USER_MESSAGE,
                payload,
                writer=Writer.INTAKE,
                idempotency_key=key,
            )
            (seq,) = lifecycle.append_all(self._db, [message])
            ScheduleFire.update(session=session_id, seq=seq).where(
                ScheduleFire.id == fire_id
            ).execute()
            return session_id, seq

        return run_write(self._db, work)

    # --- the sessions fires made ----------------------------------------------------

    def running_sessions(self, limit: int = 1000) -> list[str]:
        """Open sessions of kind `scheduled` with a turn in flight."""
        query = (
            Session.select(Session.id)
            .where(
                (Session.active_turn_id > "")
                & (Session.kind == SessionKind.SCHEDULED)
                & (Session.status == SessionStatus.OPEN)
            )
            .order_by(Session.updated_at)
            .limit(limit)
        )
        return [row.id for row in query]
