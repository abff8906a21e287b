"""The delivery outbox: a session's target, the rows its events' appends wrote, and their
claims, attempts and outcomes (`DeliveryStatus`).

A row is written by the append of its event (`appends.py`), in the same transaction; from
then on only this module changes it. A daemon claims the rows it sends, each the oldest
pending row of its (session, target), so a session's deliveries go out in seq order
whichever daemon sends them; a claim not finished by `claim_expires_at` (database clock),
or held by an earlier boot of the claimer's host, is free again.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import peewee

from supervisor.core.vocabulary import DeliveryStatus
from supervisor.store.claims import Claims
from supervisor.store.db import db_now, run_write
from supervisor.store.errors import SessionNotFound
from supervisor.store.models import Delivery, Event, Session
from supervisor.store.session_info import SessionInfo, info_of

LIST_MAX = 1000
ERROR_CHARS = 500  # of a failed attempt's error, kept
CLAIMS = Claims(Delivery)


@dataclass(frozen=True)
class DeliveryInfo:
    """A delivery row as the rest of turnkeeper sees it."""

    id: str
    target: str
    session: str
    seq: int
    kind: str
    status: str
    attempts: int
    next_at: float
    created_at: float
    claimed_by: str | None
    claim_expires_at: float | None
    last_code: int | None
    last_error: str
    delivered_at: float | None
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        """The API shape of a delivery."""
        out = asdict(self)
        del out["claimed_by"], out["claim_expires_at"]
        return out


FIELDS = tuple(DeliveryInfo.__dataclass_fields__)


def _info(row: Delivery) -> DeliveryInfo:
    return DeliveryInfo(**{name: getattr(row, name) for name in FIELDS})


def _first_in_line() -> Any:
    """Deliveries with no pending one of their (session, target) before them: the ones a
    claim may take, so that a session's go out in seq order."""
    earlier = Delivery.alias("earlier")
    return ~peewee.fn.EXISTS(
        earlier.select(earlier.id).where(
            (earlier.session == Delivery.session)
            & (earlier.target == Delivery.target)
            & (earlier.status == DeliveryStatus.PENDING)
            & (earlier.seq < Delivery.seq)
        )
    )


@dataclass(frozen=True)
class Outgoing:
    """A claimed delivery and what it carries: its event's payload."""

    delivery: DeliveryInfo
    payload: dict[str, Any]


class Deliveries:
    """The outbox (see the module's docstring)."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    # --- a session's target ---------------------------------------------------------

    def bind(self, session_id: str, target: str | None, kinds: Collection[str]) -> SessionInfo:
        """Bind the session to `target` (None: unbind), sending it events of `kinds`; its
        appends from the next commit on write deliveries. SessionNotFound if none."""

        def work() -> SessionInfo:
            changed = (
                Session.update(deliver_to=target, deliver_kinds=" ".join(sorted(kinds)))
                .where(Session.id == session_id)
                .execute()
            )
            if not changed:
                raise SessionNotFound(session_id)
            return info_of(Session.get(Session.id == session_id))

        result: SessionInfo = run_write(self._db, work)
        return result

    def sync_kinds(self, targets: Mapping[str, Collection[str]]) -> int:
        """Bring the kinds of the sessions bound to each of `targets` to what it sends now
        (the configuration may have changed since they were bound); the rows changed."""

        def work() -> int:
            changed = 0
            for name, kinds in targets.items():
                wanted = " ".join(sorted(kinds))
                changed += (
                    Session.update(deliver_kinds=wanted)
                    .where((Session.deliver_to == name) & (Session.deliver_kinds != wanted))
                    .execute()
                )
            return changed

        return int(run_write(self._db, work))

    # --- the sender -----------------------------------------------------------------

    def now(self) -> float:
        """The database clock, which `next_at` and claims are judged by."""
        return db_now(self._db)

    def claim(
        self, owner: str, targets: Mapping[str, float], limit: int, mine: str | None = None
    ) -> list[Outgoing]:
        """Claim for `owner` ("<host>/<boot8>") at most `limit` deliveries that are due, each
        the oldest pending one of its (session, target), of `targets` (name: seconds the
        claim lasts), with their events' payloads. A claim that ran out, or with `mine`
        ("<host>/") one of this host's earlier boots, is free. On the server databases
        `FOR UPDATE SKIP LOCKED`: two daemons take different rows."""
        if not targets or limit < 1:
            return []

        def work() -> list[DeliveryInfo]:
            now = db_now(self._db)
            pending = Delivery.status == DeliveryStatus.PENDING
            free = CLAIMS.free(now, owner, mine)
            query = (
                Delivery.select()
                .where(
                    pending
                    & Delivery.target.in_(list(targets))
                    & (Delivery.next_at <= now)
                    & free
                    & _first_in_line()
                )
                .order_by(Delivery.next_at, Delivery.created_at, Delivery.seq)
                .limit(limit)
            )
            if self._db.for_update:
                query = query.for_update(skip_locked=True)
            taken = []
            for row in list(query):
                expires = now + targets[row.target]
                if CLAIMS.take([row.id], owner, expires, now, mine):
                    row.claimed_by, row.claim_expires_at = owner, expires
                    taken.append(row)
            return [_info(row) for row in taken]

        claimed: list[DeliveryInfo] = run_write(self._db, work)
        return [Outgoing(d, self._payload(d.session, d.seq)) for d in claimed]

    def next_due(self, targets: Collection[str], after: float) -> float | None:
        """The soonest next try from `after` on (database clock) of a pending delivery of
        `targets` that a claim could take then (none of its session pending before it); None
        if no such delivery waits."""
        if not targets:
            return None
        found = (
            Delivery.select(Delivery.next_at)
            .where(
                (Delivery.status == DeliveryStatus.PENDING)
                & Delivery.target.in_(list(targets))
                & (Delivery.next_at >= after)
                & _first_in_line()
            )
            .order_by(Delivery.next_at)
            .limit(1)
            .scalar()
        )
        return None if found is None else float(found)

    def _payload(self, session_id: str, seq: int) -> dict[str, Any]:
        found = (
            Event.select(Event.payload)
            .where((Event.session_id == session_id) & (Event.seq == seq))
            .scalar()
        )
        try:
            payload = json.loads(found) if found else {}
        except ValueError:
            payload = {}
        return payload if isinstance(payload, dict) else {}

    def finish(
        self,
        delivery_id: str,
        owner: str,
        status: DeliveryStatus,
        *,
        next_in: float = 0.0,
        code: int | None = None,
        error: str = "",
    ) -> bool:
        """Record an attempt of `owner`'s claim: DELIVERED, DEAD, or PENDING again in
        `next_in` seconds (database clock). False if the claim was no longer `owner`'s (it
        ran out and another daemon took it): nothing is written."""

        def work() -> bool:
            now = db_now(self._db)
            changes: dict[Any, Any] = {
                Delivery.status: status,
                Delivery.attempts: Delivery.attempts + 1,
                **CLAIMS.cleared(),
                Delivery.last_code: code,
                Delivery.last_error: error[:ERROR_CHARS],
                Delivery.updated_at: now,
            }
            if status is DeliveryStatus.DELIVERED:
                changes[Delivery.delivered_at] = now
            elif status is DeliveryStatus.PENDING:
                changes[Delivery.next_at] = now + next_in
            return bool(
                Delivery.update(changes)
                .where(
                    (Delivery.id == delivery_id)
                    & CLAIMS.held_by(owner)
                    & (Delivery.status == DeliveryStatus.PENDING)
                )
                .execute()
            )

        return bool(run_write(self._db, work))

    def release(self, owner: str, deadline: float = 5.0) -> int:
        """Give up `owner`'s claims (a stop): sent again at once, by whoever claims them.
        Bounded by `deadline` (a stop does not wait on a database that went away)."""
        return int(
            run_write(
                self._db,
                deadline=deadline,
                work=lambda: CLAIMS.release(owner, Delivery.status == DeliveryStatus.PENDING),
            )
        )

    # --- operators ------------------------------------------------------------------

    def get(self, delivery_id: str) -> DeliveryInfo | None:
        row = Delivery.get_or_none(Delivery.id == delivery_id)
        return None if row is None else _info(row)

    def list(
        self,
        *,
        status: str | None = None,
        session: str | None = None,
        limit: int = 100,
    ) -> list[DeliveryInfo]:
        """Deliveries, newest first; of one `status`, of one `session`."""
        query = Delivery.select()
        if status is not None:
            query = query.where(Delivery.status == status)
        if session is not None:
            query = query.where(Delivery.session == session)
        query = query.order_by(Delivery.created_at.desc(), Delivery.seq.desc())
        return [_info(row) for row in query.limit(max(1, min(limit, LIST_MAX)))]

    def retry(self, delivery_id: str) -> DeliveryInfo | None:
        """Send a dead (or pending) delivery again at once, its attempts counted from 0;
        None if there is none. A delivered one, and one being sent right now (its claim
        holds: the attempt decides), are left as they are."""

        def work() -> DeliveryInfo | None:
            row = Delivery.get_or_none(Delivery.id == delivery_id)
            if row is None or row.status == DeliveryStatus.DELIVERED:
                return None if row is None else _info(row)
            now = db_now(self._db)
            if CLAIMS.holds(row, now):
                return _info(row)
            changes: dict[Any, Any] = {Delivery.next_at: 0.0, Delivery.updated_at: now}
            if row.status == DeliveryStatus.DEAD:
                changes |= {
                    Delivery.status: DeliveryStatus.PENDING,
                    Delivery.attempts: 0,
                    **CLAIMS.cleared(),
                }
            Delivery.update(changes).where(Delivery.id == delivery_id).execute()
            return _info(Delivery.get(Delivery.id == delivery_id))

        result: DeliveryInfo | None = run_write(self._db, work)
        return result

    def retry_all(self, target: str) -> tuple[int, int]:
        """Send every dead delivery of `target` again (pending, its attempts counted from
        0) and make every pending one due at once, but those being sent right now (their
        claim holds); how many were dead, and how many pending.

        One statement each, in one transaction: a sender never sees some of a session's
        dead rows pending again and not the others, so none is sent before an older one
        of its session (`claim` takes each session's oldest pending row). They go out as
        they were produced: each session's in seq order, the oldest first across them.
        """

        def work() -> tuple[int, int]:
            now = db_now(self._db)
            of_target = Delivery.target == target
            revived = (
                Delivery.update(
                    {
                        Delivery.status: DeliveryStatus.PENDING,
                        Delivery.attempts: 0,
                        Delivery.next_at: 0.0,
                        Delivery.updated_at: now,
                        **CLAIMS.cleared(),
                    }
                )
                .where(of_target & (Delivery.status == DeliveryStatus.DEAD))
                .execute()
            )
            due = (
                Delivery.update({Delivery.next_at: 0.0, Delivery.updated_at: now})
                .where(
                    of_target
                    & (Delivery.status == DeliveryStatus.PENDING)
                    & (Delivery.next_at > 0.0)
                    & CLAIMS.free(now)
                )
                .execute()
            )
            return int(revived), int(due)

        result: tuple[int, int] = run_write(self._db, work)
        return result

    def counts(self) -> dict[str, int]:
        """How many deliveries are in each status (every status, 0 if none)."""
        query = (
            Delivery.select(Delivery.status, peewee.fn.COUNT(Delivery.id))
            .group_by(Delivery.status)
            .tuples()
        )
        found: dict[str, int] = {str(row[0]): int(row[1]) for row in query.iterator()}
        return {status.value: int(found.get(status.value, 0)) for status in DeliveryStatus}

    def pending_by_target(self) -> dict[str, int]:
        """How many deliveries are pending, by target."""
        query = (
            Delivery.select(Delivery.target, peewee.fn.COUNT(Delivery.id))
            .where(Delivery.status == DeliveryStatus.PENDING)
            .group_by(Delivery.target)
            .tuples()
        )
        return {str(row[0]): int(row[1]) for row in query.iterator()}

    def prune(self, before: float) -> int:
        """Forget delivered rows delivered before `before` (epoch seconds); how many."""
        return int(
            run_write(
                self._db,
                lambda: (
                    Delivery.delete()
                    .where(
                        (Delivery.status == DeliveryStatus.DELIVERED)
                        & (Delivery.delivered_at < before)
                    )
                    .execute()
                ),
            )
        )
