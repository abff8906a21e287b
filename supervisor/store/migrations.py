"""Schema migrations.

A fresh database gets every table from the current models and is stamped `LATEST`; an
existing one runs the steps from its version up, in one transaction where the backend
allows DDL in transactions. A database stamped newer than `LATEST` is refused: an older
turnkeeper must not write rows it does not understand.

To change the schema: change the models, add a step `STEPS[n]` that brings version n-1 to
n (with `playhouse.migrate`), and bump `LATEST`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import peewee
from playhouse.migrate import SchemaMigrator
from playhouse.migrate import migrate as run_migrations

from supervisor.contract.clock import SYSTEM
from supervisor.store.db import backend
from supervisor.store.errors import SchemaMissing, SchemaTooNew
from supervisor.store.events import scoped_key
from supervisor.store.models import (
    HOST_ID_LEN,
    ID_LEN,
    MODELS,
    PRINCIPAL_LEN,
    TARGET_LEN,
    BaseModel,
    Delivery,
    Event,
    Host,
    IntakeKey,
    RestartRequest,
    Schedule,
    ScheduleFire,
    SchemaVersion,
    Session,
    SessionACL,
    Subagent,
    Task,
)

LATEST = 10


def _resend_mark(db: peewee.Database) -> None:
    """2: `session.resend_requested_at`, recovery's request to the user to resend."""
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_column("session", "resend_requested_at", peewee.DoubleField(null=True))
    )


def _scoped_keys(db: peewee.Database) -> None:
    """3: idempotency keys scoped to their principal, with the digest of their request.

    A stored key becomes `scoped_key(principal, key)`, the principal read from the message
    it made (intake writes it as `by`); its digest stays empty, so it matches any replay.
    """
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_column("intake_key", "digest", peewee.CharField(max_length=64, null=True))
    )
    rows = [
        (str(row.session_id), str(row.key), int(row.seq))
        for row in IntakeKey.select(IntakeKey.session_id, IntakeKey.key, IntakeKey.seq)
    ]
    for session_id, key, seq in rows:
        payload = (
            Event.select(Event.payload)
            .where((Event.session_id == session_id) & (Event.seq == seq))
            .scalar()
        )
        principal = json.loads(payload).get("by") if payload else None
        if isinstance(principal, str):
            IntakeKey.update(key=scoped_key(principal, key)).where(
                (IntakeKey.session_id == session_id) & (IntakeKey.key == key)
            ).execute()


def _work_indexes(db: peewee.Database) -> None:
    """4: indexes for the work query (pending, status, updated_at) and lease renewal (owner)."""
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_index("session", ("owner",), False),
        migrator.add_index("session", ("pending", "status", "updated_at"), False),
    )


def _hosts(db: peewee.Database) -> None:
    """5: the host registry (several daemons on one database), and each child's host.

    Children recorded before it get host "": their boot row says whose they were.
    """
    create_tables(db, [Host])
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_column(
            "child_process", "host", peewee.CharField(max_length=HOST_ID_LEN, default="")
        ),
        migrator.add_index("child_process", ("host",), False),
    )


def _subagents(db: peewee.Database) -> None:
    """6: the subagent registry."""
    create_tables(db, [Subagent])


def _tasks_and_schedules(db: peewee.Database) -> None:
    """7: the task registry, schedules and their fires."""
    create_tables(db, [Task, Schedule, ScheduleFire])


def _deliveries(db: peewee.Database) -> None:
    """8: the delivery outbox, and each session's target."""
    create_tables(db, [Delivery])
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_column(
            "session", "deliver_to", peewee.CharField(max_length=TARGET_LEN, null=True)
        ),
        migrator.add_column(
            "session", "deliver_kinds", peewee.CharField(max_length=200, default="")
        ),
    )


def _restarts(db: peewee.Database) -> None:
    """9: the restart requests."""
    create_tables(db, [RestartRequest])


def _principals(db: peewee.Database) -> None:
    """10: the principal each session (and task) belongs to, and each subagent's root, for
    the limits per principal and per tree; each schedule's status (active, paused, ended).
    A session made before has its creator's `admin` ACL row (the first such principal by
    name where an admin granted more); a subagent its parent's principal and root, read
    level by level from the top."""
    migrator = SchemaMigrator.from_database(db)
    run_migrations(
        migrator.add_column(
            "session", "principal", peewee.CharField(max_length=PRINCIPAL_LEN, null=True)
        ),
        migrator.add_index("session", ("principal", "status"), False),
    )
    # A table made by step 6 or 7 from today's model has its new column already.
    for table, column, size, index in (
        ("subagent", "root", ID_LEN, ("root", "status")),
        ("task", "principal", PRINCIPAL_LEN, ("status", "principal")),
    ):
        if column not in {found.name for found in db.get_columns(table)}:
            run_migrations(
                migrator.add_column(table, column, peewee.CharField(max_length=size, null=True)),
                migrator.add_index(table, index, False),
            )
    if "status" not in {found.name for found in db.get_columns("schedule")}:
        status = peewee.CharField(max_length=16, default="active")
        run_migrations(migrator.add_column("schedule", "status", status))
    creator = SessionACL.select(peewee.fn.MIN(SessionACL.principal)).where(
        (SessionACL.session == Session.id) & (SessionACL.permission == "admin")
    )
    Session.update(principal=creator).where(Session.parent.is_null()).execute()
    for depth in range(1, 33):  # subagents.max_depth is at most 32
        rows = Subagent.select(Subagent.id, Subagent.parent).where(Subagent.depth == depth)
        for row in rows:
            parent = Session.get_or_none(Session.id == row.parent)
            root = Subagent.select(Subagent.root).where(Subagent.id == row.parent).scalar()
            Subagent.update(root=root or row.parent).where(Subagent.id == row.id).execute()
            if parent is not None:
                Session.update(principal=parent.principal).where(Session.id == row.id).execute()
    of_session = Session.select(Session.principal).where(Session.id == Task.session)
    Task.update(principal=of_session).execute()


# version -> the step that migrates version-1 to version.
STEPS: dict[int, Callable[[peewee.Database], None]] = {
    2: _resend_mark,
    3: _scoped_keys,
    4: _work_indexes,
    5: _hosts,
    6: _subagents,
    7: _tasks_and_schedules,
    8: _deliveries,
    9: _restarts,
    10: _principals,
}

_LOCK_NAME = "turnkeeper_migrate"
_PG_LOCK_KEY = 0x7475726E  # "turn"


def current_version(db: peewee.Database) -> int:
    """The schema version stored in the database, 0 if it has none."""
    if not SchemaVersion.table_exists():
        return 0
    row = SchemaVersion.get_or_none(SchemaVersion.id == 1)
    return row.version if row else 0


def check(db: peewee.Database) -> int:
    """Raise unless the database is at `LATEST`; for commands that must not migrate."""
    version = current_version(db)
    if version > LATEST:
        raise _too_new(version)
    if version < LATEST:
        raise SchemaMissing(
            f"the database is at schema version {version}, this turnkeeper needs {LATEST}: "
            "run `turnkeeper db migrate` (the daemon also migrates when it starts)"
        )
    return version


def migrate(db: peewee.Database) -> tuple[int, int]:
    """Bring the database to `LATEST`; returns (version before, version after)."""
    with _migration_lock(db), db.atomic():
        before = current_version(db)
        if before > LATEST:
            raise _too_new(before)
        if before == 0:
            create_tables(db)
        else:
            for version in range(before + 1, LATEST + 1):
                STEPS[version](db)
        if before != LATEST:
            SchemaVersion.delete().execute()
            SchemaVersion.insert(id=1, version=LATEST, updated_at=SYSTEM.time()).execute()
        return before, LATEST


def create_tables(db: peewee.Database, models: list[type[BaseModel]] = MODELS) -> None:
    """The tables of `models` (all of them by default); WITHOUT ROWID is SQLite's alone."""
    sqlite = backend(db) == "sqlite"
    for model in models:
        wanted = model._meta.without_rowid
        model._meta.without_rowid = wanted and sqlite
        try:
            db.create_tables([model], safe=True)
        finally:
            model._meta.without_rowid = wanted


def _too_new(version: int) -> SchemaTooNew:
    return SchemaTooNew(
        f"the database is at schema version {version}, newer than this turnkeeper "
        f"understands ({LATEST}): upgrade turnkeeper, or point store.url at another database"
    )


@contextmanager
def _migration_lock(db: peewee.Database) -> Iterator[None]:
    """Serialize migrators across processes and hosts.

    SQLite's BEGIN IMMEDIATE already does; PostgreSQL takes a transaction advisory lock
    inside the migration's transaction; MySQL's DDL commits implicitly, so it takes a
    named lock for the connection's life.
    """
    kind = backend(db)
    if kind == "mysql":
        db.execute_sql("SELECT GET_LOCK(%s, 60)", (_LOCK_NAME,))
        try:
            yield
        finally:
            db.execute_sql("SELECT RELEASE_LOCK(%s)", (_LOCK_NAME,))
    elif kind == "postgresql":
        with db.atomic():
            db.execute_sql("SELECT pg_advisory_xact_lock(%s)", (_PG_LOCK_KEY,))
            yield
    else:
        yield
