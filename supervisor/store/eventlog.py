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

from supervisor.store.db import run_write
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
    return AppendRequest(
        session_id=session_id,
        type=type,
        payload_json=payload_json,
        turn_id=turn_id,
        token=token,
        writer=writer,
        idempotency_key=idempotency_key,
        created_at=time.time(),
    )


_UNCHANGED = object()


def _active_turn_after(requests: Sequence[AppendRequest]) -> object:
    """`session.active_turn_id` after these events, or _UNCHANGED if none touches it."""
    active: object = _UNCHANGED
    for req in requests:
        if req.type == "turn_started":
            active = req.turn_id
        elif req.type == "turn_ended":
            active = None
    return active


def write_events(requests: Sequence[AppendRequest]) -> list[int | StoreError]:
    """Append `requests` inside the caller's open write transaction.

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
    # Sessions are locked in id order, so two processes' batches cannot deadlock.
    for (session_id, token), indexes in sorted(groups.items(), key=lambda item: item[0][0]):
        group = [requests[i] for i in indexes]
        for i, result in zip(indexes, _append_group(session_id, token, group), strict=True):
            outcomes[i] = result
    for i, first in duplicate_of.items():
        outcomes[i] = outcomes[first]
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(requests), "every append has an outcome"
    return done


def _append_group(
    session_id: str, token: int | None, group: list[AppendRequest]
) -> list[int | StoreError]:
    changes: dict[Any, Any] = {
        Session.last_seq: Session.last_seq + len(group),
        Session.updated_at: time.time(),
    }
    active = _active_turn_after(group)
    if active is not _UNCHANGED:
        changes[Session.active_turn_id] = active
    update = Session.update(changes).where(Session.id == session_id)
    if token is not None:
        update = update.where(Session.lease_token == token)
    if update.execute() == 0:
        row = Session.select(Session.lease_token).where(Session.id == session_id).tuples().first()
        error: StoreError = (
            SessionNotFound(session_id) if row is None else LeaseLost(session_id, token, row[0])
        )
        return [error] * len(group)
    last = Session.select(Session.last_seq).where(Session.id == session_id).scalar()
    first = int(last) - len(group) + 1
    Event.insert_many(
        [
            {
                Event.session: session_id,
                Event.seq: first + n,
                Event.type: req.type,
                Event.turn_id: req.turn_id,
                Event.payload: req.payload_json,
                Event.created_at: req.created_at,
                Event.writer: req.writer,
                Event.lease_token: token,
                Event.idempotency_key: req.idempotency_key,
            }
            for n, req in enumerate(group)
        ]
    ).execute()
    return list(range(first, first + len(group)))


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
            outcomes = run_write(self._db, lambda: write_events(batch))
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
