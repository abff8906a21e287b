"""The database: schema, event log, sessions, leases, ACLs, boot log and child registry.

This package is the contract the supervisor and the workers share; each process opens its
own `Store` (its own connections) on the same database URL.
"""

from __future__ import annotations

from types import TracebackType

import peewee

from supervisor.store import migrations
from supervisor.store.acl import PERMISSIONS, Acl
from supervisor.store.boots import Boot, Boots, Child, Children
from supervisor.store.db import backend, db_now, open_database, probe, run_write, sqlite_path
from supervisor.store.deliveries import Deliveries, DeliveryInfo, Outgoing
from supervisor.store.errors import (
    BadStoreURL,
    IdempotencyConflict,
    LeaseLost,
    NotAnswering,
    SchemaMissing,
    SchemaTooNew,
    SessionClosed,
    SessionNotFound,
    StorageUnavailable,
    StoreBusy,
    StoreError,
    TooManySessions,
)
from supervisor.store.eventlog import EVENT_TYPES, EventLog, EventRecord
from supervisor.store.events import EventTooLarge, ReplayedSeq, request_digest, scoped_key
from supervisor.store.events import limits as event_limits
from supervisor.store.hosts import Host, Hosts, HostTaken, Me, SingleHost
from supervisor.store.leases import Grant, Granted, Lease, Leases
from supervisor.store.models import MODELS, SchemaVersion
from supervisor.store.restarts import Admitted, RateLimited, RestartInfo, Restarts, Settled
from supervisor.store.schedules import FireInfo, ScheduleInfo, ScheduleRefused, Schedules
from supervisor.store.sessions import KINDS, SessionInfo, Sessions
from supervisor.store.subagents import Reported, Spawned, SubagentInfo, Subagents
from supervisor.store.tasks import Started, TaskInfo, TaskReported, Tasks

__all__ = [
    "EVENT_TYPES",
    "KINDS",
    "PERMISSIONS",
    "Acl",
    "Admitted",
    "BadStoreURL",
    "Boot",
    "Boots",
    "Child",
    "Children",
    "Deliveries",
    "DeliveryInfo",
    "EventLog",
    "EventRecord",
    "EventTooLarge",
    "FireInfo",
    "Grant",
    "Granted",
    "Host",
    "HostTaken",
    "Hosts",
    "IdempotencyConflict",
    "Lease",
    "LeaseLost",
    "Leases",
    "Me",
    "NotAnswering",
    "Outgoing",
    "RateLimited",
    "ReplayedSeq",
    "Reported",
    "RestartInfo",
    "Restarts",
    "ScheduleInfo",
    "ScheduleRefused",
    "Schedules",
    "SchemaMissing",
    "SchemaTooNew",
    "SessionClosed",
    "SessionInfo",
    "SessionNotFound",
    "Sessions",
    "Settled",
    "SingleHost",
    "Spawned",
    "Started",
    "StorageUnavailable",
    "Store",
    "StoreBusy",
    "StoreError",
    "SubagentInfo",
    "Subagents",
    "TaskInfo",
    "TaskReported",
    "Tasks",
    "TooManySessions",
    "probe",
    "request_digest",
    "scoped_key",
    "sqlite_path",
]


class Store:
    """One process's handle on the database.

    `migrate=True` (the daemon, `turnkeeper db migrate`) creates or upgrades the schema;
    `migrate=False` (read-only commands) refuses a missing or outdated one with a clear
    error instead of creating a database by accident.
    """

    def __init__(
        self,
        url: str,
        synchronous: str = "full",
        *,
        migrate: bool = True,
        max_event_bytes: int | None = None,
    ) -> None:
        if max_event_bytes is not None:  # the process's limit (`events.limits`)
            event_limits.max_event_bytes = max_event_bytes
        path = sqlite_path(url)
        if not migrate and path is not None and not path.exists():
            raise SchemaMissing(
                f"no database at {path}: start the daemon or run `turnkeeper db migrate`"
            )
        self.url = url
        self.db: peewee.Database = open_database(url, synchronous)
        self.db.bind(MODELS, bind_refs=False, bind_backrefs=False)
        try:
            self.db.connect(reuse_if_open=True)
            if migrate:
                self.schema_before, self.schema_version = migrations.migrate(self.db)
            else:
                self.schema_before = self.schema_version = migrations.check(self.db)
        except peewee.OperationalError as exc:
            self.db.close()
            raise StoreError(f"cannot open the database ({backend(self.db)}): {exc}") from exc
        except BaseException:
            self.db.close()
            raise
        self.events = EventLog(self.db)
        self.sessions = Sessions(self.db)
        self.acl = Acl(self.db)
        self.leases = Leases(self.db)
        self.boots = Boots(self.db)
        self.children = Children(self.db)
        self.hosts = Hosts(self.db)
        self.subagents = Subagents(self.db)
        self.schedules = Schedules(self.db)
        self.tasks = Tasks(self.db)
        self.deliveries = Deliveries(self.db)
        self.restarts = Restarts(self.db)

    def now(self) -> float:
        """The database clock (epoch seconds): the only clock leases are judged by."""
        return db_now(self.db)

    @property
    def backend(self) -> str:
        """`sqlite`, `postgresql` or `mysql`."""
        return backend(self.db)

    def probe_write(self, deadline: float = 2.0) -> None:
        """Commit one small write transaction, or raise StorageUnavailable saying why.

        For readiness after a failed write: whether the database takes writes again.
        """
        stamp = SchemaVersion.update(updated_at=SchemaVersion.updated_at).where(
            SchemaVersion.id == 1
        )
        try:
            run_write(self.db, stamp.execute, deadline=deadline)
        except StorageUnavailable:
            raise
        except peewee.DatabaseError as exc:
            raise StorageUnavailable(f"the database takes no writes: {exc}") from exc

    def close(self) -> None:
        """Commit queued appends, stop the committer and close this thread's connection."""
        self.events.close()
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
