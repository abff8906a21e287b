"""Sessions: create, find and list them; recovery's writes to their rows.

Their access control lists are in `acl.py`, their leases in `leases.py`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import (
    EventType,
    Permission,
    ScheduleStatus,
    SessionCount,
    SessionKind,
    SessionStatus,
    TurnOutcome,
    Writer,
)
from supervisor.store import lifecycle, subagents
from supervisor.store.db import chunks, run_write
from supervisor.store.errors import SessionClosed, SessionNotFound, TooManySessions
from supervisor.store.eventlog import make_request, write_events
from supervisor.store.models import Schedule, Session, SessionACL
from supervisor.store.session_info import INFO_FIELDS, SessionInfo, info_of

KINDS = tuple(SessionKind)
QUARANTINE_NOTICE = (
    "This session is quarantined: its turn failed every time it was run, so "
    "it will not be run again by itself. An operator can lift this with "
    "`turnkeeper sessions release ID`; then send your message again."
)


Page = list[tuple[SessionInfo, str | None]]  # sessions and the caller's permission on each


class Sessions:
    """Create, find and list sessions."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        # Built once: peewee builds a query's SQL anew on every call (~0.2 ms).
        columns = [getattr(Session, name) for name in INFO_FIELDS]
        query = Session.select(*columns).where(Session.id == "").bind(db)
        self._get_sql: str = query.sql()[0]
        q = db.quote
        names = ", ".join(
            f"s.{q[0]}{Session._meta.fields[n].column_name}{q[1]}" for n in INFO_FIELDS
        )
        newest = (
            f"SELECT c.payload FROM {q[0]}event{q[1]} c WHERE c.session_id = s.id "
            f"AND c.type = {db.param} ORDER BY c.seq DESC LIMIT 1"
        )
        self._opening_sql = f"SELECT {names}, ({newest}) FROM {q[0]}session{q[1]} s WHERE s.id IN "
        # Read off the index of (pending, status, updated_at), in its order.
        self._needing_sql = (
            f"SELECT {names} FROM {q[0]}session{q[1]} s WHERE s.pending = {db.param} "
            f"AND s.status = {db.param} ORDER BY s.updated_at, s.id LIMIT {db.param}"
        )
        self._some_sql = (
            f"SELECT {names} FROM {q[0]}session{q[1]} s WHERE s.status = {db.param} "
            f"AND (s.pending = {db.param} OR s.active_turn_id IS NOT NULL) AND s.id IN "
        )

    def create(
        self,
        principal: str,
        *,
        kind: str = SessionKind.ATTACHED,
        title: str = "",
        agent: str = "",
        parent: str | None = None,
        events: list[tuple[str, dict[str, Any]]] = (),  # type: ignore[assignment]
        deliver: tuple[str, str] | None = None,  # its target, and the kinds it is sent
        max_open: int = 0,  # the principal's open sessions at most (0: no limit)
    ) -> SessionInfo:
        """A new session, its creator's `admin` ACL row and its first `events` (type,
        payload), in one transaction: an autonomous run starts whole or not at all.

        TooManySessions when `principal` has `max_open` open sessions already (subagents,
        bounded per tree, do not count)."""
        deliver_to, deliver_kinds = deliver or (None, "")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if not principal:
            raise ValueError("a session needs a principal to own it")
        session_id = uuid.uuid4().hex
        now = SYSTEM.time()

        def work() -> None:
            if max_open and self.open_of(principal) >= max_open:
                raise TooManySessions(principal, max_open)
            Session.insert(
                id=session_id,
                kind=kind,
                parent=parent,
                title=title,
                agent=agent,
                created_at=now,
                updated_at=now,
                deliver_to=deliver_to,
                deliver_kinds=deliver_kinds,
                principal=principal,
            ).execute()
            SessionACL.insert(
                session=session_id, principal=principal, permission=Permission.ADMIN
            ).execute()
            for outcome in write_events(
                self._db,
                [make_request(session_id, t, p, writer=Writer.INTAKE) for t, p in events],
            ):
                if isinstance(outcome, Exception):
                    raise outcome

        run_write(self._db, work)
        return self.get(session_id)

    @staticmethod
    def open_of(principal: str) -> int:
        """How many sessions `principal` has that are not closed, subagents left out."""
        query = Session.select().where(
            (Session.principal == principal)
            & (Session.status != SessionStatus.CLOSED)
            & (Session.kind != SessionKind.SUBAGENT)
        )
        return int(query.count())

    def get(self, session_id: str) -> SessionInfo:
        """The session, or SessionNotFound: one prebuilt statement, no model instance."""
        found = self._db.execute_sql(self._get_sql, (session_id,)).fetchone()
        if found is None:
            raise SessionNotFound(session_id)
        return _info(found)

    def opening(self, session_ids: Collection[str]) -> dict[str, tuple[SessionInfo, Any]]:
        """These sessions (those that exist), each with the payload of its newest
        `compaction` event (None: it has none), by id: what a worker reads first of the
        sessions one `assign` hands it, in one query (per `IN_MAX` of them)."""
        found: dict[str, tuple[SessionInfo, Any]] = {}
        for part in chunks(list(session_ids)):
            marks = ", ".join([self._db.param] * len(part))
            query = f"{self._opening_sql}({marks})"
            params = (EventType.COMPACTION.value, *part)
            for row in self._db.execute_sql(query, params).fetchall():
                info, compaction = _info(row[:-1]), row[-1]
                found[info.id] = (info, None if compaction is None else json.loads(compaction))
        return found

    def with_work(self, limit: int = 1000) -> list[SessionInfo]:
        """Open sessions that need a turn (pending input) or have a turn in flight.

        Pending sessions come first, oldest first, then the others with a turn in
        flight, oldest first: user input is never crowded out of the `limit` by a backlog
        of interrupted turns. Both columns are indexed, so this costs what it returns,
        not the number of sessions stored.
        """
        rows = self.needing_turns(limit)
        if len(rows) < limit:
            # A range on the indexed column (not IS NOT NULL, which planners without
            # statistics take for "most rows"): it reads only the turns in flight.
            running = Session.select().where(
                (Session.active_turn_id > "") & (Session.status == SessionStatus.OPEN)
            )
            seen = {row.id for row in rows}  # pending ones are read already
            more = running.order_by(Session.updated_at, Session.id).limit(limit)
            rows += [info_of(row) for row in more if row.id not in seen][: limit - len(rows)]
        return rows

    def needing_turns(self, limit: int = 1000) -> list[SessionInfo]:
        """Open sessions with pending input, oldest first: read in order off the index of
        (pending, status, updated_at), so it costs what it returns."""
        params = (True, SessionStatus.OPEN.value, limit)
        return [_info(row) for row in self._db.execute_sql(self._needing_sql, params).fetchall()]

    def some(self, session_ids: Collection[str]) -> list[SessionInfo]:
        """The open ones of these sessions that have work (pending, or a turn in flight):
        one prebuilt statement per `IN_MAX` of them, no model instance per row."""
        rows: list[SessionInfo] = []
        for part in chunks(list(session_ids)):
            marks = ", ".join([self._db.param] * len(part))
            query = f"{self._some_sql}({marks})"
            params = (SessionStatus.OPEN.value, True, *part)
            rows += [_info(row) for row in self._db.execute_sql(query, params).fetchall()]
        return rows

    def many(self, session_ids: Collection[str]) -> dict[str, SessionInfo]:
        """These sessions, whatever their state, by id (those that exist)."""
        parts = chunks(list(session_ids))
        rows = (row for part in parts for row in Session.select().where(Session.id.in_(part)))
        return {row.id: info_of(row) for row in rows}

    def idle_autonomous(self, limit: int = 1000) -> list[SessionInfo]:
        """Open autonomous sessions with no turn in flight and no input waiting."""
        query = (
            Session.select()
            .where(
                (Session.kind == SessionKind.AUTONOMOUS)
                & (Session.status == SessionStatus.OPEN)
                & ~Session.pending
                & Session.active_turn_id.is_null()
            )
            .order_by(Session.updated_at)
            .limit(limit)
        )
        return [info_of(row) for row in query]

    def quarantine(self, session_id: str, reason: str) -> None:
        """Stop a session that keeps killing its workers: not continued, not re-assigned.

        Ends its turn as failed and tells the user with a `notice`, in one transaction,
        and drops its lease so no worker writes to it any more.
        """
        self.finalize(session_id, None, QUARANTINE_NOTICE, reason, quarantine=True)

    def finalize(
        self,
        session_id: str,
        turn_id: str | None,
        notice: str,
        reason: str,
        *,
        quarantine: bool = False,
        token: int | None = None,
    ) -> bool:
        """End an interrupted turn with a `notice` for the user, in one transaction.

        The turn ends `failed` with `reason` (stale, unsafe_tail, quarantined); the lease is
        revoked so no worker writes to the session any more. With `turn_id`, nothing is
        done (False) unless that turn is still the active one: recovery judged it from a
        read that may be stale; with `token`, nothing either unless the lease token is still
        the one read (no daemon leased it since). `quarantine` also stops the session for
        good.
        """

        def work() -> bool:
            row = lifecycle.locked_row(session_id)  # another daemon may judge it too
            if turn_id is not None and row.active_turn_id != turn_id:
                return False
            if token is not None and row.lease_token != token:
                return False  # leased since it was judged: its new owner goes on with it
            events = [
                make_request(
                    session_id,
                    EventType.NOTICE,
                    {"text": notice, "reason": reason, "resend": True},
                    turn_id=row.active_turn_id,
                    writer=Writer.SUPERVISOR,
                )
            ]
            if row.active_turn_id:
                events.append(
                    make_request(
                        session_id,
                        EventType.TURN_ENDED,
                        {"outcome": TurnOutcome.FAILED, "reason": reason},
                        turn_id=row.active_turn_id,
                        writer=Writer.SUPERVISOR,
                    )
                )
            lifecycle.append_all(self._db, events)
            changes = lifecycle.revoked() | {Session.resend_requested_at: SYSTEM.time()}
            if quarantine:
                changes |= {
                    Session.status: SessionStatus.QUARANTINED,
                    Session.quarantined_at: SYSTEM.time(),
                    Session.quarantine_reason: reason,
                }
            Session.update(changes).where(Session.id == session_id).execute()
            return True

        return bool(run_write(self._db, work))

    def charge_attempt(
        self, session_id: str, turn_id: str, *, limit: int | None = None, token: int | None = None
    ) -> int | None:
        """Charge a continuation attempt of `turn_id` before it starts (write-ahead).

        Returns the session's attempt count for the turn with this attempt (its first run
        included), or None when that turn is no longer the active one (it ended, or another
        turn began) or, with `token` (a worker continuing its own turn), the lease is no
        longer that token's. With `limit`, an attempt past `limit` continuation attempts
        is not charged: a count above `limit + 1` says the attempts are spent.
        """

        def work() -> int | None:
            row = Session.get_or_none(Session.id == session_id)
            if row is None:
                raise SessionNotFound(session_id)
            if row.active_turn_id != turn_id or token not in (None, row.lease_token):
                return None
            count = (row.attempt_count if row.attempt_turn_id == turn_id else 0) + 1
            if limit is None or count <= limit + 1:
                Session.update(attempt_turn_id=turn_id, attempt_count=count).where(
                    Session.id == session_id
                ).execute()
            return count

        result: int | None = run_write(self._db, work)
        return result

    def refund_attempt(self, session_id: str, turn_id: str) -> None:
        """Give back an attempt that was charged but never ran (no worker took it)."""
        run_write(
            self._db,
            lambda: (
                Session.update(attempt_count=Session.attempt_count - 1)
                .where(
                    (Session.id == session_id)
                    & (Session.attempt_turn_id == turn_id)
                    & (Session.attempt_count > 1)
                )
                .execute()
            ),
        )

    def interrupt(
        self, session_id: str, by: str, streamed: lifecycle.Streamed | None = None
    ) -> list[lifecycle.Written]:
        """End the turn in flight as `interrupted_by_operator`, for good (see lifecycle.py),
        with the text its model call streamed so far as its cut answer, and cancel the
        session's running subagents, in one transaction.

        Returns the events written (seq, type), the `turn_ended` last; none if no turn was
        running.
        """
        why = f"its parent was interrupted by {by}"

        def work() -> list[lifecycle.Written]:
            written = lifecycle.interrupt(self._db, session_id, by, streamed)
            subagents.cancel_within(self._db, session_id, by, why)
            return written

        return run_write(self._db, work)

    def close(self, session_id: str, by: str) -> list[lifecycle.Written]:
        """Close the session: its turn in flight ends as an interrupt would end it, and it
        runs no turn and takes no message any more; its history is kept (see lifecycle.py).

        Returns the events written (seq, type): none if it was closed already, for
        closing is idempotent.
        """
        why = f"its parent was closed by {by}"

        def work() -> list[lifecycle.Written]:
            written = lifecycle.close(self._db, session_id, by)
            if written:
                subagents.cancel_within(self._db, session_id, by, why)
                # Its schedules end with it: they fire no more and count against no limit.
                Schedule.update(status=ScheduleStatus.ENDED).where(
                    Schedule.session == session_id
                ).execute()
            return written

        return run_write(self._db, work)

    def request_turn(self, session_id: str) -> None:
        """Mark the session as needing a turn with no new message (a wake).

        SessionClosed for a closed session: it runs no turn any more.
        """

        def work() -> None:
            row = Session.get_or_none(Session.id == session_id)
            if row is None:
                raise SessionNotFound(session_id)
            if row.status == SessionStatus.CLOSED:
                raise SessionClosed(session_id)
            Session.update(pending=True).where(Session.id == session_id).execute()

        run_write(self._db, work)

    def release(self, session_id: str, by: str = "operator") -> list[lifecycle.Written]:
        """Lift a quarantine: the poisoned turn ends `failed` with a notice and is never
        retried; the attempts start over (see lifecycle.py). The one place of this rule,
        for the API and the command line alike.

        Returns the events written (seq, type): none if the session was not quarantined.
        """
        return run_write(self._db, lambda: lifecycle.release(self._db, session_id, by))

    def counts(self) -> dict[str, int]:
        """Sessions by state: open, quarantined, closed; running (a turn in flight) and
        pending (input waiting for a turn) among the open ones."""
        counts: dict[str, int] = {status: 0 for status in SessionStatus}
        query = Session.select(Session.status, peewee.fn.COUNT(Session.id)).group_by(Session.status)
        rows: list[tuple[str, int]] = list(query.tuples())  # type: ignore[arg-type]
        for status, number in rows:
            counts[status] = int(number)
        open_ = Session.select().where(Session.status == SessionStatus.OPEN)
        counts[SessionCount.RUNNING] = open_.where(Session.active_turn_id.is_null(False)).count()
        counts[SessionCount.PENDING] = open_.where(Session.pending).count()
        return counts

    def list(self, principal: str | None = None, limit: int = 100) -> list[SessionInfo]:
        """Sessions, newest first; only those `principal` may read when it is given."""
        query = Session.select().order_by(Session.created_at.desc(), Session.id).limit(limit)
        if principal is not None:
            query = query.join(SessionACL).where(SessionACL.principal == principal)
        return [info_of(row) for row in query]

    def page(
        self,
        principal: str | None = None,
        *,
        limit: int = 100,
        offset: int = 0,
        text: str = "",
        statuses: Collection[str] = (),
        by_activity: bool = False,
    ) -> tuple[Page, bool]:
        """A page of sessions, newest first (by creation, or by last activity), with the
        permission `principal` holds on each (None when no principal is given: the admin
        reads every one), and whether more follow.

        `text` keeps those whose title contains it (case-insensitive) or whose id starts
        with it; `statuses` those in one of the states (all when empty).
        """
        newest = Session.updated_at if by_activity else Session.created_at
        if principal is None:
            query = Session.select(Session, peewee.Value(None).alias("held"))
        else:
            query = (
                Session.select(Session, SessionACL.permission.alias("held"))
                .join(SessionACL)
                .where(SessionACL.principal == principal)
            )
        if text:
            matches = Session.title.contains(text)
            if all(c in "0123456789abcdef" for c in text.lower()):
                matches |= Session.id.startswith(text.lower())
            query = query.where(matches)
        if statuses:
            query = query.where(Session.status.in_(list(statuses)))
        query = query.order_by(newest.desc(), Session.id).offset(offset).limit(limit + 1)
        rows = list(query.objects())
        found = [(info_of(row), getattr(row, "held", None)) for row in rows[:limit]]
        return found, len(rows) > limit


def _info(row: tuple[Any, ...]) -> SessionInfo:
    """A row of the `INFO_FIELDS` columns, in that order, as a `SessionInfo`."""
    values = dict(zip(INFO_FIELDS, row, strict=True))
    values["pending"] = bool(values["pending"])
    return SessionInfo(**values)
