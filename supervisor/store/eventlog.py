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
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import peewee

from supervisor.core.vocabulary import EventType, SessionStatus
from supervisor.store.db import run_write
from supervisor.store.errors import (
    IdempotencyConflict,
    LeaseLost,
    SessionClosed,
    SessionNotFound,
    StorageUnavailable,
    StoreError,
)
from supervisor.store.events import (
    EVENT_TYPES,
    WRITERS,
    AppendRequest,
    EventRecord,
    ReplayedSeq,
    SessionRow,
    advance,
    make_request,
)
from supervisor.store.models import Event, IntakeKey
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


def write_events(db: peewee.Database, requests: Sequence[AppendRequest]) -> list[int | StoreError]:
    """Append `requests` inside the caller's open write transaction on `db`.

    The session rows are read under the write lock, so fencing (the writer's token must be
    the session's current token) and the seqs are decided on values nobody else can change
    before the commit. Returns, for each request, its seq or the error that rejected it
    (the others still commit). Pure with respect to Python state, so a retried transaction
    can call it again.
    """
    outcomes: list[int | StoreError | None] = [None] * len(requests)
    duplicate_of: dict[int, int] = {}
    first_with_key: dict[tuple[str, str], int] = {}
    todo: list[int] = []
    for i, req in enumerate(requests):
        if req.idempotency_key is not None:
            key = (req.session_id, req.idempotency_key)
            if key in first_with_key:
                duplicate_of[i] = first_with_key[key]
                continue
            seen = (
                IntakeKey.select(IntakeKey.seq, IntakeKey.digest)
                .where((IntakeKey.session_id == req.session_id) & (IntakeKey.key == key[1]))
                .first()
            )
            if seen is not None:
                outcomes[i] = _replay(req, int(seen.seq), seen.digest)
                continue
            first_with_key[key] = i
        todo.append(i)

    sql = sql_for(db)
    session_ids = sorted({requests[i].session_id for i in todo})
    rows: dict[str, SessionRow] = {}
    if session_ids:
        cursor = db.execute_sql(sql.lock_rows(len(session_ids)), session_ids)
        for sid, last, token, pending, active, attempt_turn, attempts, resend, status in cursor:
            rows[sid] = SessionRow(
                int(last),
                int(token),
                bool(pending),
                active,
                attempt_turn,
                int(attempts),
                resend,
                status,
            )
    events: list[tuple[Any, ...]] = []
    keys: list[tuple[str, str, int, str | None]] = []
    last_user: dict[str, int] = {}  # user messages appended in this batch
    for i in todo:
        req = requests[i]
        row = rows.get(req.session_id)
        if row is None:
            outcomes[i] = SessionNotFound(req.session_id)
            continue
        if req.token is not None and req.token != row.lease_token:
            outcomes[i] = LeaseLost(req.session_id, req.token, row.lease_token)
            continue
        if req.type == EventType.USER_MESSAGE and row.status == SessionStatus.CLOSED:
            outcomes[i] = SessionClosed(req.session_id)  # decided under the lock: no race
            continue
        advance(row, req)
        if req.type == "user_message":
            last_user[req.session_id] = row.last_seq
        elif req.read_to is not None:
            # The turn read up to `read_to`; a message after that is still waiting for one.
            latest = last_user.get(req.session_id) or _last_user_seq(req.session_id)
            row.pending = latest > req.read_to
        outcomes[i] = row.last_seq
        events.append(
            (
                req.session_id,
                row.last_seq,
                req.type,
                req.turn_id,
                req.payload_json,
                req.created_at,
                req.writer,
                req.token,
            )
        )
        if req.idempotency_key is not None:
            keys.append((req.session_id, req.idempotency_key, row.last_seq, req.idempotency_digest))
    if events:
        now = time.time()
        touched = sorted({event[0] for event in events})
        db.cursor().executemany(
            sql.update,
            [
                (
                    r.last_seq,
                    r.pending,
                    r.active_turn_id,
                    r.attempt_turn_id,
                    r.attempt_count,
                    r.resend_requested_at,
                    now,
                    sid,
                )
                for sid in touched
                for r in (rows[sid],)
            ],
        )
        db.cursor().executemany(sql.insert, events)
    if keys:
        db.cursor().executemany(sql.insert_key, keys)
    for i, first_index in duplicate_of.items():
        first = outcomes[first_index]
        if isinstance(first, int):
            outcomes[i] = _replay(requests[i], first, requests[first_index].idempotency_digest)
        else:
            outcomes[i] = first
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(requests), "every append has an outcome"
    return done


def _replay(req: AppendRequest, seq: int, digest: str | None) -> int | StoreError:
    """The outcome of an append whose key was used before: a replay, or a conflict.

    A key stored without a digest (before digests were kept, or by a caller that sends
    none) matches any request.
    """
    if digest is not None and req.idempotency_digest not in (None, digest):
        return IdempotencyConflict(req.session_id, seq)
    return ReplayedSeq(seq)


def _last_user_seq(session_id: str) -> int:
    """The seq of the session's newest user message (0 if none); read under the lock."""
    seq = (
        Event.select(Event.seq)
        .where((Event.session_id == session_id) & (Event.type == "user_message"))
        .order_by(Event.seq.desc())
        .limit(1)
        .scalar()
    )
    return int(seq or 0)


_STOP = object()


class EventLog:
    """Appends through one committer thread (group commit) and reads on the caller's thread."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
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
        return self.submit(session_id, type, payload, **options).result()

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
        with self._start_lock:
            if self._closed:
                raise StoreError("the event log is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="turnkeeper-committer", daemon=True
                )
                self._thread.start()
        self._queue.put(req)

    def read(self, session_id: str, after: int = 0, limit: int = 100) -> list[EventRecord]:
        """Events with seq > `after`, oldest first, at most `limit`."""
        query = (
            Event.select()
            .where((Event.session_id == session_id) & (Event.seq > after))
            .order_by(Event.seq)
            .limit(limit)
        )
        return [_record(row) for row in query]

    def tail(self, session_id: str, count: int) -> list[EventRecord]:
        """The last `count` events, oldest first; an index range scan, not a log scan."""
        query = (
            Event.select()
            .where(Event.session_id == session_id)
            .order_by(Event.seq.desc())
            .limit(count)
        )
        return [_record(row) for row in reversed(list(query))]

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
                self._commit(batch)
        finally:
            self._db.close()

    def _commit(self, batch: list[AppendRequest]) -> None:
        outcomes: list[int | StoreError]
        try:
            outcomes = run_write(self._db, lambda: write_events(self._db, batch))
            self.commits += 1
        except Exception as exc:
            # Anything but our own errors is the database failing to take the write: a
            # full disk, a read-only file system, a server that went away.
            error = (
                exc if isinstance(exc, StoreError) else StorageUnavailable(f"append failed: {exc}")
            )
            outcomes = [error] * len(batch)
        # One wake-up per event loop for the whole batch, not one per append.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, int | StoreError]]] = {}
        for req, outcome in zip(batch, outcomes, strict=True):
            if not isinstance(outcome, StoreError):
                self.committed += 1
            if req.loop is None:
                _resolve(req.future, outcome)
            else:
                by_loop.setdefault(req.loop, []).append((req.future, outcome))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve_all, items)


def _resolve(future: Any, outcome: int | StoreError) -> None:
    if future.done():  # an asyncio caller that was cancelled
        return
    if isinstance(outcome, StoreError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _resolve_all(items: list[tuple[Any, int | StoreError]]) -> None:
    for future, outcome in items:
        _resolve(future, outcome)


def _record(row: Event) -> EventRecord:
    return EventRecord(
        session_id=row.session_id,
        seq=row.seq,
        type=row.type,
        turn_id=row.turn_id,
        payload=json.loads(row.payload),
        created_at=row.created_at,
        writer=row.writer,
        lease_token=row.lease_token,
    )
