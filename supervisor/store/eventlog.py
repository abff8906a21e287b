"""The event log: per-event durable appends with group commit, and reads.

An append is one transaction: bump `session.last_seq` only if the writer's lease token is
still the session's token, insert the event, commit. Only then is the caller told the
seq. Appends that arrive while a commit is in flight are committed together in the next
transaction (group commit); a lone append is committed at once, never delayed by a timer.

`turn_started` sets `session.active_turn_id` and `turn_ended` clears it, in the same
transaction as the event, so "a turn is in flight" is always a durable fact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import peewee

from supervisor.core.context_use import context_use
from supervisor.core.vocabulary import EventType
from supervisor.store.appends import Known, Outcome, write_batch, write_events
from supervisor.store.db import chunks, run_append
from supervisor.store.errors import StorageUnavailable, StoreError
from supervisor.store.events import (
    EVENT_TYPES,
    WRITERS,
    AppendRequest,
    EventRecord,
    SessionRow,
    advance,
    make_request,
)
from supervisor.store.statements import sql_for

__all__ = [
    "EVENT_TYPES",
    "WRITERS",
    "AppendRequest",
    "EventLog",
    "EventRecord",
    "SessionRow",
    "advance",
    "make_request",
    "write_events",
]

# Commit at most this many appends in one transaction; the rest wait for the next one.
MAX_BATCH = 512
# Known session rows kept at most (all are forgotten past this; they are only a shortcut).
KNOWN_MAX = 10_000


_STOP = object()


class EventLog:
    """Appends through one committer thread (group commit) and reads on the caller's thread.

    A blocking `append` that finds nothing queued or being committed commits on its own
    thread instead, sparing two thread hand-offs; anything that arrives meanwhile queues
    for the committer, which waits for that commit and then takes all of it at once.
    """

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        self._sql = sql_for(db)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()  # guards _closed, _thread and _in_flight
        self._closed = False
        self._in_flight = 0  # appends queued or being committed
        self._writing = threading.Lock()  # held for each transaction, and `_known` with it
        self._known: Known = {}
        self.commits = 0
        self.committed = 0

    def submit(
        self, session_id: str, type: str, payload: dict[str, Any] | None = None, **options: Any
    ) -> Future[int]:
        """Queue an append; the future resolves to its seq once committed, or to the error."""
        req = make_request(session_id, type, payload, **options)
        req.future = Future()
        self._enqueue(req)
        future: Future[int] = req.future
        return future

    def append(
        self, session_id: str, type: str, payload: dict[str, Any] | None = None, **options: Any
    ) -> int:
        """Append one event and return its seq once it is committed.

        Options: `token` (the writer's lease token; None only for lease-less intake
        writes), `turn_id`, `writer`, `idempotency_key` (the same key on the same session
        appends nothing and returns the first seq). Raises LeaseLost when `token` is not
        the session's current token, SessionNotFound, or StoreError.
        """
        req = make_request(session_id, type, payload, **options)
        # Never inside a transaction this thread has open: the append would be part of it,
        # not durable when this returns (and on SQLite, the write lock may be that one's).
        if self._admit(alone=not self._db.in_transaction()):
            try:
                with self._writing:
                    (outcome,) = self._write([req])
            finally:
                with self._start_lock:
                    self._in_flight -= 1
        else:
            req.waiter = waiter = threading.Lock()
            waiter.acquire()
            self._queue.put(req)
            waiter.acquire()  # released by the committer once `outcome` is set
            outcome = req.outcome
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    async def append_async(
        self, session_id: str, type: str, payload: dict[str, Any] | None = None, **options: Any
    ) -> int:
        """`append` for asyncio callers: awaits the commit without blocking the loop.

        A cancelled caller stops waiting; the append itself may still commit.
        """
        req = make_request(session_id, type, payload, **options)
        req.loop = asyncio.get_running_loop()
        req.future = req.loop.create_future()
        self._enqueue(req)
        seq: int = await req.future
        return seq

    def _enqueue(self, req: AppendRequest) -> None:
        self._admit(alone=False)
        self._queue.put(req)

    def _admit(self, alone: bool) -> bool:
        """Count in an append; whether it may commit on the caller's thread (`alone` and
        nothing queued or being committed, which keeps every caller's order). If not, the
        committer is started if need be, and the caller queues the append."""
        with self._start_lock:
            if self._closed:
                raise StoreError("the event log is closed")
            alone = alone and self._in_flight == 0
            self._in_flight += 1
            if not alone and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="turnkeeper-committer", daemon=True
                )
                self._thread.start()
        return alone

    def read(self, session_id: str, after: int = 0, limit: int = 100) -> list[EventRecord]:
        """Events with seq > `after`, oldest first, at most `limit`: one prebuilt statement."""
        cursor = self._db.execute_sql(self._sql.read_after, (session_id, after, limit))
        return [_row_record(session_id, row) for row in cursor.fetchall()]

    def logs(self, after: Mapping[str, int]) -> dict[str, list[EventRecord]]:
        """Each session's events with seq > `after[session]`, oldest first: several
        sessions' logs in one query (per `IN_MAX` of them), by session."""
        found: dict[str, list[EventRecord]] = {sid: [] for sid in after}
        p = self._db.param
        for part in chunks(list(after)):
            whole = [sid for sid in part if after[sid] <= 0]
            ranges = [(sid, after[sid]) for sid in part if after[sid] > 0]
            where = [f"session_id IN ({', '.join([p] * len(whole))})"] if whole else []
            where += [f"(session_id = {p} AND seq > {p})"] * len(ranges)
            params = [*whole, *(value for pair in ranges for value in pair)]
            query = f"{self._sql.read_logs} WHERE {' OR '.join(where)} ORDER BY session_id, seq"
            for sid, *row in self._db.execute_sql(query, params).fetchall():
                found[sid].append(_row_record(sid, tuple(row)))
        return found

    def tail(self, session_id: str, count: int) -> list[EventRecord]:
        """The last `count` events, oldest first; an index range scan, not a log scan."""
        cursor = self._db.execute_sql(self._sql.read_last, (session_id, count))
        return [_row_record(session_id, row) for row in reversed(cursor.fetchall())]

    def last_of(self, session_id: str, type: str) -> EventRecord | None:
        """The newest event of `type` in the session, if any (read back from the end)."""
        cursor = self._db.execute_sql(self._sql.read_last_of, (session_id, type))
        row = cursor.fetchone()
        return None if row is None else _row_record(session_id, row)

    def count_of(self, session_id: str, type: str) -> int:
        """How many events of `type` the session has."""
        cursor = self._db.execute_sql(self._sql.count_of, (session_id, type))
        return int(cursor.fetchone()[0])

    def context_use(self, session_id: str, window: int) -> dict[str, Any]:
        """The session's use of the context window (`supervisor.core.context_use`)."""
        return context_use(
            self.last_of(session_id, EventType.MODEL_RESPONSE),
            self.last_of(session_id, EventType.COMPACTION),
            self.count_of(session_id, EventType.COMPACTION),
            window,
        )

    def close(self) -> None:
        """Commit what is queued, then stop the committer thread."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    def _run(self) -> None:
        stop = False
        try:
            while not stop:
                first = self._queue.get()
                if first is _STOP:
                    break
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stop = True
                        break
                    batch.append(item)
                with self._writing:
                    outcomes = self._write(batch)
                _resolve_batch(batch, outcomes)
                with self._start_lock:
                    self._in_flight -= len(batch)
        finally:
            self._db.close()

    def _write(self, batch: list[AppendRequest]) -> list[Outcome]:
        """Commit `batch` in one transaction; the caller holds `_writing`."""
        known = self._known
        outcomes: list[Outcome]
        try:
            outcomes, learned = run_append(
                self._db,
                self._sql.begin,
                lambda cursor: write_batch(cursor, self._sql, batch, known),
            )
        except Exception as exc:
            # Anything but our own errors is the database failing to take the write: a
            # full disk, a read-only file system, a server that went away.
            error = (
                exc if isinstance(exc, StoreError) else StorageUnavailable(f"append failed: {exc}")
            )
            return [error] * len(batch)
        self.commits += 1
        if len(known) + len(learned) > KNOWN_MAX:
            known.clear()
        known.update(learned)
        self.committed += sum(not isinstance(o, StoreError) for o in outcomes)
        return outcomes


def _resolve_batch(batch: list[AppendRequest], outcomes: list[Outcome]) -> None:
    # One wake-up per event loop for the whole batch, not one per append.
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Outcome]]] = {}
    for req, outcome in zip(batch, outcomes, strict=True):
        if req.waiter is not None:
            req.outcome = outcome
            req.waiter.release()
        elif req.loop is None:
            _resolve(req.future, outcome)
        else:
            by_loop.setdefault(req.loop, []).append((req.future, outcome))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
            loop.call_soon_threadsafe(_resolve_all, items)


def _resolve(future: Any, outcome: Outcome) -> None:
    if future.done():  # an asyncio caller that was cancelled
        return
    if isinstance(outcome, StoreError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _resolve_all(items: list[tuple[Any, Outcome]]) -> None:
    for future, outcome in items:
        _resolve(future, outcome)


def _row_record(session_id: str, row: tuple[Any, ...]) -> EventRecord:
    seq, kind, turn_id, payload, created_at, writer, token = row
    return EventRecord(
        session_id,
        int(seq),
        kind,
        turn_id,
        json.loads(payload),
        float(created_at),
        writer,
        None if token is None else int(token),
    )
