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
import json
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import peewee

from supervisor.store.db import backend, run_write
from supervisor.store.errors import LeaseLost, SessionNotFound, StoreError
from supervisor.store.models import Event, Session

EVENT_TYPES = frozenset(
    {
        "user_message",
        "turn_started",
        "model_response",
        "tool_call",
        "tool_result",
        "turn_ended",
        "repair",
        "continuation",
        "checkpoint",
        "notice",
        "acl",
    }
)
WRITERS = frozenset({"worker", "boot", "intake", "supervisor", "cli"})
# Commit at most this many appends in one transaction; the rest wait for the next one.
MAX_BATCH = 512


@dataclass(frozen=True)
class EventRecord:
    """One committed event as read back from the log."""

    session_id: str
    seq: int
    type: str
    turn_id: str | None
    payload: dict[str, Any]
    created_at: float
    writer: str

    def to_dict(self) -> dict[str, Any]:
        """The API shape of an event."""
        return {
            "seq": self.seq,
            "type": self.type,
            "turn_id": self.turn_id,
            "payload": self.payload,
            "created_at": self.created_at,
        }


@dataclass
class AppendRequest:
    """An event to append; built by `make_request`, which validates it."""

    session_id: str
    type: str
    payload_json: str
    turn_id: str | None
    token: int | None
    writer: str
    idempotency_key: str | None
    created_at: float
    # A continuation after a crash charges a turn attempt; a handoff (rolling restart) not.
    charges_attempt: bool = False
    future: Future[int] = field(default_factory=Future)


def make_request(
    session_id: str,
    type: str,
    payload: dict[str, Any] | None = None,
    *,
    token: int | None = None,
    turn_id: str | None = None,
    writer: str = "worker",
    idempotency_key: str | None = None,
) -> AppendRequest:
    """Validate an append in the caller's thread, so a bad one never reaches a batch."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}; known: {', '.join(sorted(EVENT_TYPES))}")
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; known: {', '.join(sorted(WRITERS))}")
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise ValueError(f"event payload must be a JSON object, not {payload.__class__.__name__}")
    try:
        payload_json = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"event payload is not JSON-serializable: {exc}") from exc
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
        raise ValueError("idempotency key must be 1 to 200 characters")
    if type in TURN_EVENTS and not turn_id:
        raise ValueError(f"a {type} event needs a turn_id")
    return AppendRequest(
        session_id=session_id,
        type=type,
        payload_json=payload_json,
        turn_id=turn_id,
        token=token,
        writer=writer,
        idempotency_key=idempotency_key,
        created_at=time.time(),
        charges_attempt=type == "continuation" and payload.get("cause") != "handoff",
    )


TURN_EVENTS = frozenset({"turn_started", "turn_ended", "continuation"})


@dataclass(frozen=True)
class Effects:
    """What a run of events does to its session row besides `last_seq` (pure data).

    - `user_message` marks the session pending (it needs a turn);
    - `turn_started` clears pending, makes the turn active and charges its first attempt;
    - a charged `continuation` adds an attempt to its turn;
    - `turn_ended` clears the active turn and its attempts.
    """

    pending: bool | None = None  # None: unchanged
    set_active: bool = False
    active_turn_id: str | None = None
    attempts: str = "keep"  # keep | set (to attempt_n) | add (attempt_n) | clear
    attempt_turn_id: str | None = None
    attempt_n: int = 0


def effects_of(events: Sequence[AppendRequest]) -> Effects:
    """The net effect of `events`, in order, on their session's row."""
    pending: bool | None = None
    set_active, active = False, None
    mode, turn, n = "keep", None, 0
    for event in events:
        if event.type == "user_message":
            pending = True
        elif event.type == "turn_started":
            pending, set_active, active = False, True, event.turn_id
            mode, turn, n = "set", event.turn_id, 1
        elif event.type == "turn_ended":
            set_active, active = True, None
            mode, turn, n = "clear", None, 0
        elif event.charges_attempt:
            if mode in ("set", "add") and turn == event.turn_id:
                n += 1
            else:
                mode, turn, n = ("add" if mode == "keep" else "set"), event.turn_id, 1
    return Effects(pending, set_active, active, mode, turn, n)


class _Sql:
    """The append statements for one database, built once (the hot path builds no query)."""

    def __init__(self, db: peewee.Database) -> None:
        self.kind = backend(db)
        self.p = db.param
        q = db.quote[0], db.quote[1]
        self.session = f"{q[0]}session{q[1]}"
        columns = (
            "session_id",
            "seq",
            "type",
            "turn_id",
            "payload",
            "created_at",
            "writer",
            "lease_token",
            "idempotency_key",
        )
        self.insert = (
            f"INSERT INTO {q[0]}event{q[1]} ({', '.join(columns)}) "
            f"VALUES ({', '.join([self.p] * len(columns))})"
        )
        self.select_last = f"SELECT last_seq FROM {self.session} WHERE id = {self.p}"
        self._updates: dict[tuple[bool, bool, bool, str], str] = {}

    def update(self, fenced: bool, effects: Effects) -> str:
        key = (fenced, effects.pending is not None, effects.set_active, effects.attempts)
        sql = self._updates.get(key)
        if sql is None:
            sql = self._updates[key] = self._build_update(*key)
        return sql

    def _build_update(self, fenced: bool, pending: bool, active: bool, attempts: str) -> str:
        p = self.p
        sets = [f"last_seq = last_seq + {p}", f"updated_at = {p}"]
        if pending:
            sets.append(f"pending = {p}")
        if active:
            sets.append(f"active_turn_id = {p}")
        if attempts == "set":
            sets += [f"attempt_count = {p}", f"attempt_turn_id = {p}"]
        elif attempts == "add":
            # attempt_count first: MySQL reads columns already assigned in this statement.
            sets += [
                f"attempt_count = CASE WHEN attempt_turn_id = {p} THEN attempt_count + {p} "
                f"ELSE {p} END",
                f"attempt_turn_id = {p}",
            ]
        elif attempts == "clear":
            sets += ["attempt_count = 0", "attempt_turn_id = NULL"]
        sql = f"UPDATE {self.session} SET {', '.join(sets)} WHERE id = {p}"
        if fenced:
            sql += f" AND lease_token = {p}"
        if self.kind != "mysql":
            sql += " RETURNING last_seq"
        return sql

    @staticmethod
    def update_params(
        count: int, now: float, effects: Effects, session_id: str, token: int | None
    ) -> list[Any]:
        params: list[Any] = [count, now]
        if effects.pending is not None:
            params.append(effects.pending)
        if effects.set_active:
            params.append(effects.active_turn_id)
        if effects.attempts == "set":
            params += [effects.attempt_n, effects.attempt_turn_id]
        elif effects.attempts == "add":
            params += [
                effects.attempt_turn_id,
                effects.attempt_n,
                effects.attempt_n,
                effects.attempt_turn_id,
            ]
        params.append(session_id)
        if token is not None:
            params.append(token)
        return params


_statements: dict[int, _Sql] = {}


def _sql_for(db: peewee.Database) -> _Sql:
    sql = _statements.get(id(db))
    if sql is None:
        sql = _statements[id(db)] = _Sql(db)
    return sql


def write_events(db: peewee.Database, requests: Sequence[AppendRequest]) -> list[int | StoreError]:
    """Append `requests` inside the caller's open write transaction on `db`.

    Returns, for each request, its seq or the error that rejected it (the others still
    commit). Pure with respect to Python state, so a retried transaction can call it again.
    """
    outcomes: list[int | StoreError | None] = [None] * len(requests)
    duplicate_of: dict[int, int] = {}
    first_with_key: dict[tuple[str, str], int] = {}
    pending: list[int] = []
    for i, req in enumerate(requests):
        if req.idempotency_key is not None:
            key = (req.session_id, req.idempotency_key)
            if key in first_with_key:
                duplicate_of[i] = first_with_key[key]
                continue
            seen = (
                Event.select(Event.seq)
                .where((Event.session == req.session_id) & (Event.idempotency_key == key[1]))
                .scalar()
            )
            if seen is not None:
                outcomes[i] = int(seen)
                continue
            first_with_key[key] = i
        pending.append(i)

    groups: dict[tuple[str, int | None], list[int]] = {}
    for i in pending:
        groups.setdefault((requests[i].session_id, requests[i].token), []).append(i)
    sql = _sql_for(db)
    rows: list[tuple[Any, ...]] = []
    now = time.time()
    # Sessions are locked in id order, so two processes' batches cannot deadlock.
    for (session_id, token), indexes in sorted(groups.items(), key=lambda item: item[0][0]):
        group = [requests[i] for i in indexes]
        effects = effects_of(group)
        cursor = db.execute_sql(
            sql.update(token is not None, effects),
            sql.update_params(len(group), now, effects, session_id, token),
        )
        if sql.kind == "mysql":
            found = cursor.rowcount > 0
            if found:
                cursor = db.execute_sql(sql.select_last, (session_id,))
        result = cursor.fetchall()
        if not result:
            for i in indexes:
                outcomes[i] = _rejection(session_id, token)
            continue
        first = int(result[0][0]) - len(group) + 1
        for n, (i, req) in enumerate(zip(indexes, group, strict=True)):
            outcomes[i] = first + n
            rows.append(
                (
                    session_id,
                    first + n,
                    req.type,
                    req.turn_id,
                    req.payload_json,
                    req.created_at,
                    req.writer,
                    token,
                    req.idempotency_key,
                )
            )
    if rows:
        db.cursor().executemany(sql.insert, rows)
    for i, first_index in duplicate_of.items():
        outcomes[i] = outcomes[first_index]
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(requests), "every append has an outcome"
    return done


def _rejection(session_id: str, token: int | None) -> StoreError:
    row = Session.select(Session.lease_token).where(Session.id == session_id).tuples().first()
    return SessionNotFound(session_id) if row is None else LeaseLost(session_id, token, row[0])


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
        with self._start_lock:
            if self._closed:
                raise StoreError("the event log is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="turnkeeper-committer", daemon=True
                )
                self._thread.start()
        self._queue.put(req)
        return req.future

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
        """`append` for asyncio callers: awaits the commit without blocking the loop."""
        return await asyncio.wrap_future(self.submit(session_id, type, payload, **options))

    def read(self, session_id: str, after: int = 0, limit: int = 100) -> list[EventRecord]:
        """Events with seq > `after`, oldest first, at most `limit`."""
        query = (
            Event.select()
            .where((Event.session == session_id) & (Event.seq > after))
            .order_by(Event.seq)
            .limit(limit)
        )
        return [_record(row) for row in query]

    def tail(self, session_id: str, count: int) -> list[EventRecord]:
        """The last `count` events, oldest first; an index range scan, not a log scan."""
        query = (
            Event.select()
            .where(Event.session == session_id)
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
        try:
            outcomes = run_write(self._db, lambda: write_events(self._db, batch))
        except Exception as exc:
            error = exc if isinstance(exc, StoreError) else StoreError(f"append failed: {exc}")
            for req in batch:
                req.future.set_exception(error)
            return
        self.commits += 1
        for req, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, StoreError):
                req.future.set_exception(outcome)
            else:
                self.committed += 1
                req.future.set_result(outcome)


def _record(row: Event) -> EventRecord:
    return EventRecord(
        session_id=row.session_id,  # type: ignore[attr-defined]  # peewee's FK column
        seq=row.seq,
        type=row.type,
        turn_id=row.turn_id,
        payload=json.loads(row.payload),
        created_at=row.created_at,
        writer=row.writer,
    )
