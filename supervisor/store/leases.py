"""Session leases: who may write a session now; the token fences out every earlier holder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import peewee
from peewee import fn

from supervisor.core.vocabulary import SessionStatus
from supervisor.store.db import chunks, db_now, now_sql, run_write
from supervisor.store.errors import LeaseLost, SessionNotFound
from supervisor.store.models import Host as HostRow
from supervisor.store.models import Session


@dataclass(frozen=True)
class Lease:
    """The right to write a session; `token` fences out every earlier holder."""

    session_id: str
    owner: str
    token: int
    expires_at: float


@dataclass(frozen=True)
class Grant:
    """A lease to give `owner`; for a continuation, first an attempt of `charge` to charge."""

    session_id: str
    owner: str
    charge: str | None = None  # the turn whose continuation attempt is charged first
    expect: int | None = None  # the lease token the grant was planned on (compare-and-set)


@dataclass(frozen=True)
class Granted:
    """What came of a `Grant`: the lease, or None; the attempt count if one was charged.

    `moved_on`: the turn to charge was no longer the active one (it ended, another
    began), so neither the attempt nor the lease was taken. `raced`: another daemon took
    the lease since it was planned, or holds it live.
    """

    lease: Lease | None
    attempts: int | None = None
    moved_on: bool = False
    raced: bool = False


class Leases:
    """Acquire, renew and release session leases; expiry is judged by the database clock."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def acquire(
        self, session_id: str, owner: str, ttl: float, *, force: bool = False
    ) -> Lease | None:
        """Take the lease if it is free or stale (or always, with `force`).

        Every acquisition gets a larger token than any before it. Returns None when
        another owner holds a live lease, or the session is closed (it runs no turn any
        more, whatever an assignment read before it was closed).
        """
        now = now_sql(self._db)

        def work() -> Lease | None:
            update = Session.update(
                owner=owner, lease_token=Session.lease_token + 1, lease_expires_at=now + ttl
            ).where((Session.id == session_id) & (Session.status != SessionStatus.CLOSED))
            if not force:
                update = update.where(
                    Session.owner.is_null()
                    | Session.lease_expires_at.is_null()
                    | (Session.lease_expires_at < now)
                )
            if update.execute() == 0:
                if not Session.select().where(Session.id == session_id).exists():
                    raise SessionNotFound(session_id)
                return None
            row = Session.get(Session.id == session_id)
            assert row.lease_expires_at is not None
            return Lease(session_id, owner, row.lease_token, row.lease_expires_at)

        return run_write(self._db, work)

    def grant(
        self, grants: Sequence[Grant], ttl: float, host_prefix: str | None = None
    ) -> list[Granted]:
        """Take many leases, charging continuation attempts first, in ONE transaction: a
        batch of assignments, or a dead worker's k sessions, costs one commit, not k. A
        closed or deleted session gets no lease. Results in order.

        A claim, safe with several daemons on the database: a grant with `expect` takes
        the lease only if its token is still the one planned on, and with `host_prefix`
        only if the lease is free, ran out, or is held by this host ("<host>/"); else it
        is `raced`. Both are conditions of the UPDATE itself, judged on the row as it is
        when the row lock is held, never on an earlier read.
        """
        now = now_sql(self._db)
        ids = [g.session_id for g in grants]

        def work() -> list[Granted]:
            rows = {
                row.id: row
                for part in chunks(ids)
                for row in Session.select(
                    Session.id,
                    Session.status,
                    Session.active_turn_id,
                    Session.attempt_turn_id,
                    Session.attempt_count,
                ).where(Session.id.in_(part))
            }
            taken: dict[str, int | None] = {}  # leased: the attempt count charged, if any
            moved_on: set[str] = set()
            raced: set[str] = set()
            for g in grants:
                row = rows.get(g.session_id)
                if row is None or row.status == SessionStatus.CLOSED:
                    continue
                charge: dict[str, Any] = {}
                if g.charge is not None:
                    if row.active_turn_id != g.charge:
                        moved_on.add(g.session_id)
                        continue
                    same = row.attempt_turn_id == g.charge
                    count = (row.attempt_count if same else 0) + 1
                    charge = {"attempt_turn_id": g.charge, "attempt_count": count}
                update = Session.update(
                    owner=g.owner,
                    lease_token=Session.lease_token + 1,
                    lease_expires_at=now + ttl,
                    **charge,
                ).where(Session.id == g.session_id)
                if g.expect is not None:
                    update = update.where(Session.lease_token == g.expect)
                if g.charge is not None:  # judged on a read: the turn must still be the one
                    update = update.where(Session.active_turn_id == g.charge)
                if host_prefix is not None:
                    update = update.where(
                        Session.owner.is_null()
                        | Session.owner.startswith(host_prefix)
                        | Session.lease_expires_at.is_null()
                        | (Session.lease_expires_at < now)
                    )
                if update.execute() == 0:
                    raced.add(g.session_id)
                    continue
                taken[g.session_id] = charge.get("attempt_count")
            tokens = {
                row.id: (int(row.lease_token), float(row.lease_expires_at or 0.0))
                for part in chunks(list(taken))
                for row in Session.select(
                    Session.id, Session.lease_token, Session.lease_expires_at
                ).where(Session.id.in_(part))
            }
            return [
                Granted(Lease(g.session_id, g.owner, *tokens[g.session_id]), taken[g.session_id])
                if g.session_id in taken
                else Granted(None, moved_on=g.session_id in moved_on, raced=g.session_id in raced)
                for g in grants
            ]

        return run_write(self._db, work)

    def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend the lease; LeaseLost if its token is no longer current."""
        now = now_sql(self._db)

        def work() -> Lease:
            updated = (
                Session.update(lease_expires_at=now + ttl)
                .where((Session.id == lease.session_id) & (Session.lease_token == lease.token))
                .execute()
            )
            if updated == 0:
                current = (
                    Session.select(Session.lease_token)
                    .where(Session.id == lease.session_id)
                    .scalar()
                )
                raise LeaseLost(lease.session_id, lease.token, current)
            expires = (
                Session.select(Session.lease_expires_at)
                .where(Session.id == lease.session_id)
                .scalar()
            )
            return Lease(lease.session_id, lease.owner, lease.token, float(expires))

        return run_write(self._db, work)

    def release(self, lease: Lease) -> bool:
        """Give the lease up; False if it was no longer ours. The token is never reused."""

        def work() -> bool:
            updated = (
                Session.update(owner=None, lease_expires_at=None)
                .where((Session.id == lease.session_id) & (Session.lease_token == lease.token))
                .execute()
            )
            return bool(updated)

        return run_write(self._db, work)

    def renew_owner(self, owner: str, ttl: float, host: tuple[str, str] | None = None) -> int:
        """Extend every lease `owner` holds, in one statement; returns how many.

        With `host` (host id, boot id): only while that host's row says the boot is alive
        and holds the id. A daemon that stopped renewing its host row (hung, paused, cut
        off) stops its workers' leases too, so the others adopt its sessions; no row for
        the host at all (a worker run alone) does not stop them.
        """
        now = now_sql(self._db)
        update = Session.update(lease_expires_at=now + ttl).where(Session.owner == owner)
        if host is not None:
            host_id, boot_id = host
            update = update.where(
                ~fn.EXISTS(
                    HostRow.select(HostRow.host_id).where(
                        (HostRow.host_id == host_id)
                        & ((HostRow.boot_id != boot_id) | (HostRow.expires_at < now))
                    )
                )
            )
        return run_write(self._db, update.execute)

    def holder(self, session_id: str) -> Lease | None:
        """The live lease on the session, or None if it is free or stale."""
        row = Session.get_or_none(Session.id == session_id)
        if row is None:
            raise SessionNotFound(session_id)
        if row.owner is None or row.lease_expires_at is None:
            return None
        if row.lease_expires_at < db_now(self._db):
            return None
        return Lease(session_id, row.owner, row.lease_token, row.lease_expires_at)
