"""The boot log (one row per daemon start) and the child-process registry."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import BootOutcome
from supervisor.store.db import db_now, run_write
from supervisor.store.models import AgentBootLog, ChildProcess

OUTCOMES = tuple(BootOutcome)


@dataclass(frozen=True)
class Boot:
    """One daemon start. `outcome` None means it never ended (yet, or ever)."""

    boot_id: str
    host: str
    pid: int
    version: str
    started_at: float
    ended_at: float | None
    outcome: str | None
    attempted: list[str]
    breaker: dict[str, Any] | None


class Boots:
    """Begin and end boot rows; read recent ones."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def begin(self, host: str, pid: int, version: str, boot_id: str | None = None) -> str:
        """Write this boot's row first thing; returns its boot id (new unless given)."""
        boot_id = boot_id or uuid.uuid4().hex
        started = db_now(self._db)
        run_write(
            self._db,
            lambda: AgentBootLog.insert(
                boot_id=boot_id, host=host, pid=pid, version=version, started_at=started
            ).execute(),
        )
        return boot_id

    def end(self, boot_id: str, outcome: str) -> None:
        """Record how the boot ended."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}")
        ended = db_now(self._db)
        run_write(
            self._db,
            lambda: (
                AgentBootLog.update(ended_at=ended, outcome=outcome)
                .where(AgentBootLog.boot_id == boot_id)
                .execute()
            ),
        )

    def set_attempted(self, boot_id: str, session_ids: list[str]) -> None:
        """Write the sessions this boot is about to continue, before it starts any."""
        run_write(
            self._db,
            lambda: (
                AgentBootLog.update(attempted=json.dumps(session_ids))
                .where(AgentBootLog.boot_id == boot_id)
                .execute()
            ),
        )

    def set_breaker(self, boot_id: str, state: dict[str, Any]) -> None:
        """Record the breaker as this boot judged it (kept with any reset time)."""

        def work() -> None:
            row = AgentBootLog.get_or_none(AgentBootLog.boot_id == boot_id)
            if row is None:
                return
            merged = {**(json.loads(row.breaker) if row.breaker else {}), **state}
            AgentBootLog.update(breaker=json.dumps(merged)).where(
                AgentBootLog.boot_id == boot_id
            ).execute()

        run_write(self._db, work)

    def reset_breaker(self, host: str) -> float:
        """`turnkeeper breaker reset`: boots of `host` started until now stop counting.

        The time is kept in the newest boot row of the host, so it outlives restarts.
        Returns it (database clock).
        """
        at = db_now(self._db)

        def work() -> None:
            row = (
                AgentBootLog.select()
                .where(AgentBootLog.host == host)
                .order_by(AgentBootLog.started_at.desc())
                .first()
            )
            if row is None:
                raise LookupError(f"no boot of host {host} is recorded")
            merged = {**(json.loads(row.breaker) if row.breaker else {}), "reset_at": at}
            AgentBootLog.update(breaker=json.dumps(merged)).where(
                AgentBootLog.boot_id == row.boot_id
            ).execute()

        run_write(self._db, work)
        return at

    def of_host(self, host: str, since: float) -> list[Boot]:
        """The boots of `host` started after `since`, newest first: what the breaker reads."""
        where = (AgentBootLog.host == host) & (AgentBootLog.started_at >= since)
        return self._query(where, limit=None)

    def prune(self, before: float) -> int:
        """Delete boot rows started before `before`; returns how many."""
        deleted: int = run_write(
            self._db,
            lambda: AgentBootLog.delete().where(AgentBootLog.started_at < before).execute(),
        )
        return deleted

    def recent(self, limit: int = 20) -> list[Boot]:
        """The newest boots first."""
        return self._query(None, limit=limit)

    def _query(self, where: Any, limit: int | None) -> list[Boot]:
        query = AgentBootLog.select().order_by(AgentBootLog.started_at.desc())
        if where is not None:
            query = query.where(where)
        if limit is not None:
            query = query.limit(limit)
        return [
            Boot(
                boot_id=row.boot_id,
                host=row.host,
                pid=row.pid,
                version=row.version,
                started_at=row.started_at,
                ended_at=row.ended_at,
                outcome=row.outcome,
                attempted=json.loads(row.attempted or "[]"),
                breaker=json.loads(row.breaker) if row.breaker else None,
            )
            for row in query
        ]


@dataclass(frozen=True)
class Child:
    """A process turnkeeper started; (pid, create_time) identifies it despite pid reuse."""

    id: int
    boot: str
    pid: int
    create_time: float
    pgid: int | None
    kind: str
    worker: str | None
    name: str
    host: str = ""


class Children:
    """The registry of live workers and MCP children, for the boot-time sweep."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def record(
        self,
        boot: str,
        pid: int,
        create_time: float,
        kind: str,
        *,
        pgid: int | None = None,
        worker: str | None = None,
        name: str = "",
        host: str = "",
    ) -> int:
        """Register a child right after it started, under its daemon's boot and host id;
        returns its row id."""
        row_id: int = run_write(
            self._db,
            lambda: ChildProcess.insert(
                boot=boot,
                host=host,
                pid=pid,
                create_time=create_time,
                pgid=pgid,
                kind=kind,
                worker=worker,
                name=name,
                started_at=SYSTEM.time(),
            ).execute(),
        )
        return row_id

    def forget(self, row_ids: list[int]) -> None:
        """Remove rows of children that were reaped (or swept)."""
        if row_ids:
            run_write(
                self._db,
                lambda: ChildProcess.delete().where(ChildProcess.id.in_(row_ids)).execute(),
            )

    def of_boot(self, boot: str) -> list[Child]:
        """Children recorded by this boot (their process groups, for the shutdown)."""
        return self._query(ChildProcess.boot == boot)

    def of_other_boots(
        self, boot: str, host: str | None = None, aliases: tuple[str, ...] = ()
    ) -> list[Child]:
        """Children recorded by earlier boots of `host`: candidates for its sweep.

        Another host's rows are never its business: their pids name processes of another
        machine. A row recorded before hosts were (host "") is `host`'s when its boot row
        names `host` or one of `aliases` (the hostname it had then). `host` None: every
        host's (a database only one host can use: SQLite).
        """
        where = ChildProcess.boot != boot
        if host is not None:
            legacy = AgentBootLog.select(AgentBootLog.boot_id).where(
                AgentBootLog.host.in_([host, *aliases])
            )
            where &= (ChildProcess.host == host) | (
                (ChildProcess.host == "") & ChildProcess.boot.in_(legacy)
            )
        return self._query(where)

    def _query(self, where: Any) -> list[Child]:
        query = ChildProcess.select().where(where).order_by(ChildProcess.id)
        return [
            Child(
                row.id,
                row.boot,
                row.pid,
                row.create_time,
                row.pgid,
                row.kind,
                row.worker,
                row.name,
                row.host,
            )
            for row in query
        ]
