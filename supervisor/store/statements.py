"""The SQL of an append, built once per database so that the hot path builds no query."""

from __future__ import annotations

import weakref

import peewee

from supervisor.store.db import backend

ROW_COLUMNS = (
    "last_seq",
    "lease_token",
    "pending",
    "active_turn_id",
    "attempt_turn_id",
    "attempt_count",
    "resend_requested_at",
    "status",
)
READ_ONLY = ("lease_token", "status")  # read under the lock; an append never sets them
EVENT_COLUMNS = (
    "session_id",
    "seq",
    "type",
    "turn_id",
    "payload",
    "created_at",
    "writer",
    "lease_token",
)


class Sql:
    """The append statements for one database, built once: the hot path builds no query."""

    def __init__(self, db: peewee.Database) -> None:
        self.kind = backend(db)
        p = self.p = db.param
        q = db.quote
        self.session = f"{q[0]}session{q[1]}"
        self.insert = (
            f"INSERT INTO {q[0]}event{q[1]} ({', '.join(EVENT_COLUMNS)}) "
            f"VALUES ({', '.join([p] * len(EVENT_COLUMNS))})"
        )
        self.insert_key = (
            f"INSERT INTO {q[0]}intake_key{q[1]} (session_id, {q[0]}key{q[1]}, seq, digest) "
            f"VALUES ({p}, {p}, {p}, {p})"
        )
        settable = [c for c in ROW_COLUMNS if c not in READ_ONLY]
        self.update = (
            f"UPDATE {self.session} SET {', '.join(f'{c} = {p}' for c in settable)}, "
            f"updated_at = {p} WHERE id = {p}"
        )

    def lock_rows(self, count: int) -> str:
        """Read (and on servers, lock in id order) the session rows a batch appends to."""
        sql = (
            f"SELECT id, {', '.join(ROW_COLUMNS)} FROM {self.session} "
            f"WHERE id IN ({', '.join([self.p] * count)}) ORDER BY id"
        )
        # SQLite's BEGIN IMMEDIATE already excludes every other writer.
        return sql if self.kind == "sqlite" else sql + " FOR UPDATE"


# Keyed by the database object itself: an id() can be reused by a later database.
_statements: weakref.WeakKeyDictionary[peewee.Database, Sql] = weakref.WeakKeyDictionary()


def sql_for(db: peewee.Database) -> Sql:
    """The append statements for `db`, built on first use."""
    sql = _statements.get(db)
    if sql is None:
        sql = _statements[db] = Sql(db)
    return sql
