"""Following the database for attached sessions: the events other hosts commit.

A session's events are committed by the host whose worker owns it, and by whichever
host took a request about it (an inject, an ACL change, a close); a supervisor hears only
of the commits of its own host. So the hub (`attach.Hub`) reads, every `attach.IDLE_CHECK`
seconds and in one query, the head of every session a stream is attached to: its
`session.last_seq`, which each append bumps in the same transaction as its events, so a
head that can be read has its events readable too. A head past what the session's
streams were signalled is signalled to them, as a local publish is; a stream sends only
what it then reads from the log after the last seq it sent, so a signal from anywhere,
late or twice, never makes a gap, a duplicate or a reordering.

The rules (`Follow`, pure: no I/O, no clock):
- only attached sessions are read, and nothing at all while no stream is attached;
- a head at or below what the session's streams were already signalled is no news;
- a session whose streams were signalled a new seq by a local publish since the last
  read is not read this time: at that signal they read its log to the end. It is read at
  the next tick without one, so a write by another host waits at most two ticks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import peewee

from supervisor.store.db import chunks
from supervisor.store.errors import StoreError
from supervisor.store.models import Session

# What a failed read of the log raises: the database is down, locked or unreachable.
READ_ERRORS = (peewee.PeeweeException, StoreError)

# session ids -> the heads (last seq) of those that exist; run on a thread
ReadHeads = Callable[[Sequence[str]], Mapping[str, int]]


class Follow:
    """What the streams of each attached session were signalled, and what to read next."""

    def __init__(self) -> None:
        self.signalled: dict[str, int] = {}  # attached session -> the highest seq signalled
        self._fresh: set[str] = set()  # signalled by a local publish since the last read

    def attach(self, session_id: str) -> None:
        """The first stream of `session_id` subscribed."""
        self.signalled.setdefault(session_id, 0)

    def detach(self, session_id: str) -> None:
        """The last stream of `session_id` went away."""
        self.signalled.pop(session_id, None)
        self._fresh.discard(session_id)

    def published(self, session_id: str, seq: int) -> None:
        """A local publish signalled `seq` to the session's streams."""
        if seq > self.signalled.get(session_id, seq):
            self.signalled[session_id] = seq
            self._fresh.add(session_id)

    def due(self) -> list[str]:
        """The sessions to read at this tick; starts the next interval."""
        due = [s for s in self.signalled if s not in self._fresh]
        self._fresh.clear()
        return due

    def heads(self, found: Mapping[str, int]) -> list[tuple[str, int]]:
        """The (session, head) pairs to signal, given the heads read; records them."""
        news: list[tuple[str, int]] = []
        for session_id, head in found.items():
            known = self.signalled.get(session_id)
            if known is not None and head > known:  # still attached, and news
                self.signalled[session_id] = head
                news.append((session_id, head))
        return news


class Heads:
    """Reads sessions' heads on the caller's thread: one query per `db.IN_MAX` ids."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def __call__(self, session_ids: Sequence[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        try:
            for part in chunks(session_ids):
                query = Session.select(Session.id, Session.last_seq).where(
                    Session.id.in_(list(part))
                )
                sql, params = query.bind(self._db).sql()
                rows = self._db.execute_sql(sql, params).fetchall()
                found.update((str(session_id), int(head)) for session_id, head in rows)
        except READ_ERRORS:
            # A broken server connection is dropped, so the next read opens a new one.
            with contextlib.suppress(Exception):
                self._db.close()
            raise
        return found
