"""Pages of a session's log as plain rows: the read side the API streams from.

A page is one `SELECT ... WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?` on the
unique (session_id, seq) index: keyset paging, so the thousandth page costs what the first
does. Rows come back as tuples straight from the driver, with no model instance per row,
and the payload stays the JSON text it was stored as (`supervisor.store.events` encoded
it), so a caller that sends events on as JSON need not parse and encode it again.
"""

from __future__ import annotations

from collections.abc import Iterator

import peewee

from supervisor.store.models import Event

FETCH = 100  # rows taken from the cursor at a time

# seq, type, turn_id, payload (its stored JSON text), created_at
EventRow = tuple[int, str, str | None, str, float]


class EventRows:
    """Reads pages of events on the caller's thread (each thread has its own connection)."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        query = (
            Event.select(Event.seq, Event.type, Event.turn_id, Event.payload, Event.created_at)
            .where((Event.session_id == "") & (Event.seq > 0))
            .order_by(Event.seq)
            .limit(1)
            .bind(db)
        )
        self._sql: str = query.sql()[0]

    def page(
        self, session_id: str, after: int, limit: int, budget: int | None = None
    ) -> list[EventRow]:
        """Events with seq > `after`, oldest first, at most `limit`: one query."""
        return [row for rows in self.batches(session_id, after, limit, budget) for row in rows]

    def batches(
        self, session_id: str, after: int, limit: int, budget: int | None = None
    ) -> Iterator[list[EventRow]]:
        """`page`, in batches of up to `FETCH` rows taken from the query as they are used.

        With a `budget`, rows stop being fetched once their payloads hold that many
        characters (at least one row comes): a page of large events stays bounded, and
        the caller asks for the rest from the last seq it got.
        """
        try:
            cursor = self._db.execute_sql(self._sql, (session_id, after, limit))
        except (peewee.InterfaceError, peewee.OperationalError):
            # A connection the server dropped stays broken: the next read opens another.
            self._db.close()
            raise
        size = 0
        try:
            while batch := cursor.fetchmany(FETCH):
                rows: list[EventRow] = []
                for seq, kind, turn_id, payload, created_at in batch:
                    rows.append((int(seq), kind, turn_id, payload, float(created_at)))
                    size += len(payload)
                    if budget is not None and size >= budget:
                        break
                yield rows
                if budget is not None and size >= budget:
                    return
        finally:
            cursor.close()
