"""The SQL of an append, built once per database so that the hot path builds no query."""

from __future__ import annotations

import weakref
from typing import Any

import peewee

from supervisor.core.vocabulary import INPUT_EVENTS
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
    "deliver_to",
    "deliver_kinds",
)
# Read under the lock; an append never sets them.
READ_ONLY = ("lease_token", "status", "deliver_to", "deliver_kinds")
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
        self._row = f"({', '.join([p] * len(EVENT_COLUMNS))})"
        self.insert = (
            f"INSERT INTO {q[0]}event{q[1]} ({', '.join(EVENT_COLUMNS)}) VALUES {self._row}"
        )
        self._inserts: dict[int, str] = {1: self.insert}
        self.insert_key = (
            f"INSERT INTO {q[0]}intake_key{q[1]} (session_id, {q[0]}key{q[1]}, seq, digest) "
            f"VALUES ({p}, {p}, {p}, {p})"
        )
        settable = [c for c in ROW_COLUMNS if c not in READ_ONLY]
        self.update = (
            f"UPDATE {self.session} SET {', '.join(f'{c} = {p}' for c in settable)}, "
            f"updated_at = {p} WHERE id = {p}"
        )
        # The append of events that change nothing but `last_seq`, from a known row: it
        # matches (rowcount 1) only if nobody appended and the lease did not move since.
        self.bump = (
            f"UPDATE {self.session} SET last_seq = {p}, updated_at = {p} "
            f"WHERE id = {p} AND last_seq = {p} AND lease_token = {p}"
        )
        # The same for events a delivery target could be sent: it matches only a session
        # bound to no target (a bound one's append takes the locked row, for its outbox).
        self.bump_unbound = self.bump + " AND deliver_to IS NULL"
        self.insert_delivery = (
            f"INSERT INTO {q[0]}delivery{q[1]} (id, target, {q[0]}session{q[1]}, seq, kind, "
            "status, attempts, next_at, created_at, last_error, updated_at) "
            f"VALUES ({', '.join([p] * 11)})"
        )
        # SQLite: take the write lock up front, so a write never upgrades a read lock.
        self.begin = "BEGIN IMMEDIATE" if self.kind == "sqlite" else "BEGIN"
        self.find_key = (
            f"SELECT seq, digest FROM {q[0]}intake_key{q[1]} "
            f"WHERE session_id = {p} AND {q[0]}key{q[1]} = {p}"
        )
        read = (
            f"SELECT seq, type, turn_id, payload, created_at, writer, lease_token "
            f"FROM {q[0]}event{q[1]} WHERE session_id = {p}"
        )
        self.read_after = f"{read} AND seq > {p} ORDER BY seq LIMIT {p}"
        # Several sessions' logs: the caller adds the WHERE and the ORDER BY.
        self.read_logs = (
            "SELECT session_id, seq, type, turn_id, payload, created_at, writer, lease_token "
            f"FROM {q[0]}event{q[1]}"
        )
        self.read_last = f"{read} ORDER BY seq DESC LIMIT {p}"
        self.read_last_of = f"{read} AND type = {p} ORDER BY seq DESC LIMIT 1"
        self.count_of = (
            f"SELECT COUNT(*) FROM {q[0]}event{q[1]} WHERE session_id = {p} AND type = {p}"
        )
        inputs = ", ".join([p] * len(INPUT_EVENTS))
        self.last_user = (
            f"SELECT seq FROM {q[0]}event{q[1]} WHERE session_id = {p} AND type IN ({inputs}) "
            "ORDER BY seq DESC LIMIT 1"
        )

    def insert_events(self, cursor: Any, events: list[tuple[Any, ...]]) -> None:
        """Insert event rows. psycopg2's `executemany` makes a round trip per row, so on
        PostgreSQL they go in one multi-row INSERT; pymysql already does that, and SQLite
        makes no round trips."""
        if self.kind != "postgresql" or len(events) == 1:
            cursor.executemany(self.insert, events)
            return
        n = len(events)
        sql = self._inserts.get(n)
        if sql is None:  # at most MAX_BATCH of them
            sql = self._inserts[n] = self.insert + f", {self._row}" * (n - 1)
        cursor.execute(sql, [value for row in events for value in row])

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
