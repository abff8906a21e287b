"""The host registry: which daemons share this database, and which of them are alive.

Each daemon holds one row under its `daemon.host_id`, renewed on the database clock. A row
whose `expires_at` has passed is a lost host: the others adopt its sessions once their
leases run out too. Two live daemons never hold one id: `register` refuses the second,
naming the first, and a renewal by a boot that no longer holds the row fails, so a host
that comes back after its id was taken over stops instead of writing beside the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import peewee

from supervisor.store.db import db_now, run_write
from supervisor.store.errors import StoreError
from supervisor.store.models import Host as HostRow
from supervisor.store.models import Session


@dataclass(frozen=True)
class Me:
    """What a daemon registers of itself."""

    host_id: str
    boot_id: str
    hostname: str
    machine: str
    pid: int
    pid_started: float
    version: str


@dataclass(frozen=True)
class Host(Me):
    """One daemon on the database, as its row says, judged at `now` (database clock)."""

    started_at: float
    last_seen: float
    expires_at: float
    left_at: float | None
    now: float

    @property
    def live(self) -> bool:
        """Renewed within its time to live, and not stopped."""
        return self.left_at is None and self.expires_at >= self.now

    @property
    def state(self) -> str:
        """`live`, `left` (a clean stop) or `lost` (stopped renewing)."""
        return "live" if self.live else "left" if self.left_at is not None else "lost"


class HostTaken(StoreError):
    """A live daemon holds this host id already."""

    def __init__(self, holder: Host) -> None:
        age = max(0.0, holder.now - holder.last_seen)
        super().__init__(
            f"daemon.host_id {holder.host_id!r} is held by a live turnkeeper (pid "
            f"{holder.pid} on {holder.hostname}, boot {holder.boot_id[:8]}, last seen "
            f"{age:.1f} s ago): give each daemon on this database its own daemon.host_id, "
            f"or stop that one (if it is gone, its claim runs out at its lease.stale_after)"
        )
        self.holder = holder


class SingleHost(StoreError):
    """The database serves one host (SQLite), and another one is live on it."""

    def __init__(self, holder: Host) -> None:
        super().__init__(
            f"store.url is a SQLite database, which serves one host, and host "
            f"{holder.host_id!r} (pid {holder.pid} on {holder.hostname}) is live on it: "
            "point store.url at PostgreSQL or MariaDB for several daemons on one database"
        )
        self.holder = holder


class Hosts:
    """Register, renew and read host rows; every time is the database's."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def register(
        self, me: Me, ttl: float, gone: Callable[[Host], bool], *, single: bool = False
    ) -> Host | None:
        """Hold `me.host_id` for `ttl` s; returns the row it replaced, if any.

        A live row of another boot is taken over only if `gone(row)` says its daemon is
        dead (a crash on this machine a moment ago); otherwise HostTaken names it. With
        `single` (SQLite, which serves one host) a live daemon of any other id is refused
        too (SingleHost).
        """

        def work() -> Host | None:
            now = db_now(self._db)
            query = HostRow.select().where(HostRow.host_id == me.host_id)
            if self._db.for_update:  # row lock on the server databases
                query = query.for_update()
            row = query.first()
            before = _host(row, now) if row is not None else None
            held = before is not None and before.live and before.boot_id != me.boot_id
            if held and before is not None and not gone(before):
                raise HostTaken(before)
            if single:
                others = HostRow.select().where(HostRow.host_id != me.host_id)
                for other in (_host(r, now) for r in others):
                    if other.live and not gone(other):
                        raise SingleHost(other)
            fields = {
                "boot_id": me.boot_id,
                "hostname": me.hostname[:255],
                "machine": me.machine,
                "pid": me.pid,
                "pid_started": me.pid_started,
                "version": me.version[:32],
                "started_at": now,
                "last_seen": now,
                "expires_at": now + ttl,
                "left_at": None,
            }
            if row is None:
                HostRow.insert(host_id=me.host_id, **fields).execute()
            else:
                HostRow.update(**fields).where(HostRow.host_id == me.host_id).execute()
            return before

        result: Host | None = run_write(self._db, work)
        return result

    def renew(self, host_id: str, boot_id: str, ttl: float) -> float | None:
        """Extend our row; returns how long it had run out for (0.0 when it had not), or
        None when another boot holds the id now (we are fenced out)."""

        def work() -> float | None:
            now = db_now(self._db)
            row = HostRow.get_or_none(HostRow.host_id == host_id)
            if row is None or row.boot_id != boot_id:
                return None
            overdue = max(0.0, now - float(row.expires_at))
            HostRow.update(last_seen=now, expires_at=now + ttl, left_at=None).where(
                (HostRow.host_id == host_id) & (HostRow.boot_id == boot_id)
            ).execute()
            return overdue

        result: float | None = run_write(self._db, work)
        return result

    def leave(self, host_id: str, boot_id: str, owner_prefix: str) -> int:
        """A clean stop: the row says so and this boot's leases run out now, so the other
        daemons adopt its sessions at once. Returns how many leases it let go."""

        def work() -> int:
            now = db_now(self._db)
            HostRow.update(left_at=now, expires_at=now).where(
                (HostRow.host_id == host_id) & (HostRow.boot_id == boot_id)
            ).execute()
            expired: int = (
                Session.update(lease_expires_at=now)
                .where(
                    Session.owner.startswith(owner_prefix + "/") & (Session.lease_expires_at > now)
                )
                .execute()
            )
            return expired

        result: int = run_write(self._db, work)
        return result

    def prune(self, age: float) -> int:
        """Forget hosts that stopped (left or lost) more than `age` s ago; how many."""

        def work() -> int:
            before = db_now(self._db) - age
            deleted: int = HostRow.delete().where(HostRow.expires_at < before).execute()
            return deleted

        result: int = run_write(self._db, work)
        return result

    def all(self) -> list[Host]:
        """Every registered host, by id."""
        now = db_now(self._db)
        return [_host(row, now) for row in HostRow.select().order_by(HostRow.host_id)]

    def owned(self) -> dict[str, int]:
        """Sessions with a live lease, by the host id their owner names."""
        now = db_now(self._db)
        counts: dict[str, int] = {}
        query = (
            Session.select(Session.owner, peewee.fn.COUNT(Session.id))
            .where(Session.owner.is_null(False) & (Session.lease_expires_at >= now))
            .group_by(Session.owner)
        )
        rows: list[tuple[str, int]] = list(query.tuples())  # type: ignore[arg-type]
        for owner, count in rows:
            host = str(owner).split("/", 1)[0]
            counts[host] = counts.get(host, 0) + int(count)
        return counts


def _host(row: HostRow, now: float) -> Host:
    return Host(
        host_id=row.host_id,
        boot_id=row.boot_id,
        hostname=row.hostname,
        machine=row.machine,
        pid=int(row.pid),
        pid_started=float(row.pid_started),
        version=row.version,
        started_at=float(row.started_at),
        last_seen=float(row.last_seen),
        expires_at=float(row.expires_at),
        left_at=None if row.left_at is None else float(row.left_at),
        now=now,
    )
