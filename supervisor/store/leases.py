"""Session leases: who may write a session now; the token fences out every earlier holder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import peewee
from peewee import fn

from supervisor.core.vocabulary import SessionStatus
from supervisor.store.db import DRIVER_ERRORS, backend, chunks, db_now, now_sql, run_write
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


class _GrantSql:
    """The statements of a grant, built once per store: the rows read (on a server,
    locked in id order), the leases taken, the tokens read back."""

    def __init__(self, db: peewee.Database) -> None:
        p, q, now = db.param, db.quote, now_sql(db).sql
        self._session = f"{q[0]}session{q[1]}"
        self._lock = "" if backend(db) == "sqlite" else " FOR UPDATE"  # SQLite: BEGIN IMMEDIATE
        self._now = now
        self._update = (
            f"UPDATE {self._session} SET owner = {p}, lease_token = lease_token + 1, "
            f"lease_expires_at = {now} + {p}, attempt_turn_id = {p}, attempt_count = {p} "
            f"WHERE id = {p} AND lease_token = {p}"
        )
        self._p = p

    def read(self, db: peewee.Database, ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """(id, status, active_turn_id, attempt_turn_id, attempt_count, owner,
        lease_token, lease_expires_at, whether it ran out) of each session there is."""
        marks = ", ".join([self._p] * len(ids))
        query = (
            "SELECT id, status, active_turn_id, attempt_turn_id, attempt_count, owner, "
            f"lease_token, lease_expires_at, lease_expires_at < {self._now} "
            f"FROM {self._session} WHERE id IN ({marks}) ORDER BY id{self._lock}"
        )
        return list(db.execute_sql(query, tuple(ids)).fetchall())

    def take(self, db: peewee.Database, rows: list[tuple[Any, ...]]) -> None:
        """Each lease: (owner, ttl, attempt turn, attempt count, id, token read)."""
        cursor = db.cursor()
        with DRIVER_ERRORS:
            cursor.executemany(self._update, rows)

    def tokens(self, db: peewee.Database, ids: Sequence[str]) -> list[tuple[Any, ...]]:
        """(id, lease_token, lease_expires_at) of each session there is."""
        marks = ", ".join([self._p] * len(ids))
        query = (
            f"SELECT id, lease_token, lease_expires_at FROM {self._session} WHERE id IN ({marks})"
        )
        return list(db.execute_sql(query, tuple(ids)).fetchall())


class Leases:
    """Acquire, renew and release session leases; expiry is judged by the database clock."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        self._grant_sql = _GrantSql(db)

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
        batch of assignments, or a dead worker's k sessions, costs one commit, not k, and
        three statements whatever k (`_GrantSql`): the rows read, locked in id order
        (SQLite: the write lock itself), the leases taken by one `executemany`, the new
        tokens read back. A closed or deleted session gets no lease. Results in order.

        A claim, safe with several daemons on the database: a grant with `expect` takes
        the lease only if its token is still the one planned on, and with `host_prefix`
        only if the lease is free, ran out, or is held by this host ("<host>/"); else it
        is `raced`. Both are judged on the row as it is while its lock is held, never on
        an earlier read, and the UPDATE itself is a compare-and-set on the token so read.
        """
        ids = sorted({g.session_id for g in grants})
        sql = self._grant_sql

        def work() -> list[Granted]:
            rows = {row[0]: row for part in chunks(ids) for row in sql.read(self._db, part)}
            results: list[Granted | None] = [None] * len(grants)
            taking: dict[str, tuple[int, int, int | None]] = {}  # index, token read, charged
            updates: list[tuple[Any, ...]] = []
            for i, g in enumerate(grants):
                row = rows.get(g.session_id)
                if row is None or row[1] == SessionStatus.CLOSED:
                    results[i] = Granted(None)
                    continue
                _, _, active, attempt_turn, attempt_count, owner, token, expires, expired = row
                attempt = (attempt_turn, attempt_count)
                if g.charge is not None:
                    if active != g.charge:
                        results[i] = Granted(None, moved_on=True)
                        continue
                    attempt = (g.charge, (attempt_count if attempt_turn == g.charge else 0) + 1)
                free = (
                    owner is None
                    or expires is None
                    or bool(expired)
                    or (host_prefix is not None and str(owner).startswith(host_prefix))
                )
                if (
                    g.session_id in taking  # twice in one batch: the first takes it
                    or (g.expect is not None and token != g.expect)
                    or (host_prefix is not None and not free)
                ):
                    results[i] = Granted(None, raced=True)
                    continue
                charged = attempt[1] if g.charge is not None else None
                taking[g.session_id] = (i, int(token), charged)
                updates.append((g.owner, ttl, *attempt, g.session_id, token))
            if updates:
                sql.take(self._db, updates)
            taken = {
                row[0]: row for part in chunks(list(taking)) for row in sql.tokens(self._db, part)
            }
            for session_id, (i, token, charged) in taking.items():
                row = taken.get(session_id)
                if row is None or int(row[1]) != token + 1:  # the compare-and-set failed
                    results[i] = Granted(None, raced=True)
                    continue
                owner = grants[i].owner
                results[i] = Granted(Lease(session_id, owner, int(row[1]), float(row[2])), charged)
            return [r if r is not None else Granted(None) for r in results]

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
