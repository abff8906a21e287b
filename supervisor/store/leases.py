"""Session leases: who may write a session now; the token fences out every earlier holder."""

from __future__ import annotations

from dataclasses import dataclass

import peewee

from supervisor.core.vocabulary import SessionStatus
from supervisor.store.db import db_now, now_sql, run_write
from supervisor.store.errors import LeaseLost, SessionNotFound
from supervisor.store.models import Session


@dataclass(frozen=True)
class Lease:
    """The right to write a session; `token` fences out every earlier holder."""

    session_id: str
    owner: str
    token: int
    expires_at: float


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

    def renew_owner(self, owner: str, ttl: float) -> int:
        """Extend every lease `owner` holds, in one statement; returns how many."""
        now = now_sql(self._db)
        return run_write(
            self._db,
            lambda: (
                Session.update(lease_expires_at=now + ttl).where(Session.owner == owner).execute()
            ),
        )

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
