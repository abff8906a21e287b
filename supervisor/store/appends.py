"""Writing a batch of appends inside an open write transaction, with plain DB-API calls.

Two ways to take a session's seqs:

- from a known row: the committer remembers, for each session it appended to, the
  `last_seq` and lease token its last commit left. A batch whose events for a session
  change nothing but `last_seq` (no turn or user message, no idempotency key, no other
  token) bumps the row with one UPDATE that matches only if both are still those values.
  It then holds the row's write lock, so fencing is the same as below; no SELECT is made.
  A batch with an event a delivery target could be sent (`AppendRequest.kind`) matches
  only a session bound to no target: a bound one's goes the locked way, for its outbox.
- from the row read under the write lock (`lock_rows`): any other batch, and a known row
  whose UPDATE matched nothing (another writer appended, or the lease moved).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import INPUT_EVENTS, DeliveryStatus, EventType, SessionStatus
from supervisor.store.db import DRIVER_ERRORS
from supervisor.store.errors import (
    IdempotencyConflict,
    LeaseLost,
    SessionClosed,
    SessionNotFound,
    StoreError,
)
from supervisor.store.events import ROW_EVENTS, AppendRequest, ReplayedSeq, SessionRow, advance
from supervisor.store.statements import Sql, sql_for

# A session's `last_seq` and lease token, as a committed append left them.
Known = dict[str, tuple[int, int]]
Outcome = int | StoreError


def write_events(db: peewee.Database, requests: Sequence[AppendRequest]) -> list[Outcome]:
    """Append `requests` inside the caller's open write transaction on `db`.

    The session rows are read under the write lock, so fencing (the writer's token must be
    the session's current token) and the seqs are decided on values nobody else can change
    before the commit. Returns, for each request, its seq or the error that rejected it
    (the others still commit). Pure with respect to Python state, so a retried transaction
    can call it again.
    """
    with DRIVER_ERRORS:
        outcomes, _ = write_batch(db.cursor(), sql_for(db), requests, None)
    return outcomes


def write_batch(
    cursor: Any, sql: Sql, requests: Sequence[AppendRequest], known: Known | None
) -> tuple[list[Outcome], Known]:
    """`write_events` on a DB-API cursor, taking seqs from `known` rows where it can.

    Returns the outcomes and the rows as this transaction leaves them, for `known` once
    it committed. A known row found stale is dropped from `known` at once.
    """
    now = SYSTEM.time()
    if known and len(requests) == 1:  # the lone append: its own short way
        req = requests[0]
        row = known.get(req.session_id)
        if row is not None and _plain(req, row[1]):
            last, token = row
            bump = sql.bump if req.kind is None else sql.bump_unbound
            cursor.execute(bump, (last + 1, now, req.session_id, last, token))
            if cursor.rowcount == 1:
                cursor.execute(sql.insert, _event(req, last + 1))
                return [last + 1], {req.session_id: (last + 1, token)}
            known.pop(req.session_id, None)
    outcomes: list[Outcome | None] = [None] * len(requests)
    events: list[tuple[Any, ...]] = []
    learned: Known = {}
    rest: Sequence[int] = range(len(requests))
    if known:
        rest = _from_known(cursor, sql, requests, known, now, outcomes, events, learned)
    if rest:
        _from_locked_rows(cursor, sql, requests, rest, now, outcomes, events, learned)
    if events:
        sql.insert_events(cursor, events)
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(requests), "every append has an outcome"
    return done, learned


def _from_known(
    cursor: Any,
    sql: Sql,
    requests: Sequence[AppendRequest],
    known: Known,
    now: float,
    outcomes: list[Outcome | None],
    events: list[tuple[Any, ...]],
    learned: Known,
) -> list[int]:
    """Append what can be appended from known rows; returns the indexes left to do."""
    by_session: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        by_session.setdefault(req.session_id, []).append(i)
    rest: list[int] = []
    for sid in sorted(by_session):  # the servers' row locks, in the order lock_rows takes them
        indexes = by_session[sid]
        row = known.get(sid)
        if row is None or not all(_plain(requests[i], row[1]) for i in indexes):
            rest += indexes
            continue
        last, token = row
        bump = sql.bump_unbound if any(requests[i].kind for i in indexes) else sql.bump
        cursor.execute(bump, (last + len(indexes), now, sid, last, token))
        if cursor.rowcount != 1:
            known.pop(sid, None)
            rest += indexes
            continue
        for i in indexes:
            last += 1
            outcomes[i] = last
            events.append(_event(requests[i], last))
        learned[sid] = (last, token)
    rest.sort()  # batch order within a session
    return rest


def _plain(req: AppendRequest, token: int) -> bool:
    """Whether `req` changes its session row only by taking the next seq, with `token`."""
    return (
        req.type not in ROW_EVENTS
        and req.idempotency_key is None
        and (req.token is None or req.token == token)
    )


def _event(req: AppendRequest, seq: int) -> tuple[Any, ...]:
    return (
        req.session_id,
        seq,
        req.type,
        req.turn_id,
        req.payload_json,
        req.created_at,
        req.writer,
        req.token,
    )


def _delivery(req: AppendRequest, row: SessionRow, now: float) -> tuple[Any, ...]:
    """The outbox row of an event its session's target is sent: pending, due at once."""
    return (
        "d" + uuid.uuid4().hex,
        row.deliver_to,
        req.session_id,
        row.last_seq,
        req.kind,
        DeliveryStatus.PENDING,
        0,
        0.0,
        req.created_at,
        "",
        now,
    )


def _from_locked_rows(
    cursor: Any,
    sql: Sql,
    requests: Sequence[AppendRequest],
    indexes: Sequence[int],
    now: float,
    outcomes: list[Outcome | None],
    events: list[tuple[Any, ...]],
    learned: Known,
) -> None:
    """Append `requests[i]` for `i` in `indexes` from their rows read under the lock."""
    duplicate_of: dict[int, int] = {}
    first_with_key: dict[tuple[str, str], int] = {}
    todo: list[int] = []
    for i in indexes:
        req = requests[i]
        if req.idempotency_key is not None:
            key = (req.session_id, req.idempotency_key)
            if key in first_with_key:
                duplicate_of[i] = first_with_key[key]
                continue
            cursor.execute(sql.find_key, key)
            seen = cursor.fetchone()
            if seen is not None:
                outcomes[i] = _replay(req, int(seen[0]), seen[1])
                continue
            first_with_key[key] = i
        todo.append(i)

    session_ids = sorted({requests[i].session_id for i in todo})
    rows: dict[str, SessionRow] = {}
    if session_ids:
        cursor.execute(sql.lock_rows(len(session_ids)), session_ids)
        for (
            sid,
            last,
            token,
            pending,
            active,
            turn,
            attempts,
            resend,
            status,
            to,
            kinds,
        ) in cursor.fetchall():
            rows[sid] = SessionRow(
                int(last),
                int(token),
                bool(pending),
                active,
                turn,
                int(attempts),
                resend,
                status,
                to,
                kinds or "",
            )
    keys: list[tuple[str, str, int, str | None]] = []
    deliveries: list[tuple[Any, ...]] = []
    last_user: dict[str, int] = {}  # user messages (any input) appended in this batch
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
        if req.type in INPUT_EVENTS:
            last_user[req.session_id] = row.last_seq
        elif req.read_to is not None:
            # The turn read up to `read_to`; a message after that is still waiting for one.
            latest = last_user.get(req.session_id) or _last_user_seq(cursor, sql, req.session_id)
            row.pending = latest > req.read_to
        outcomes[i] = row.last_seq
        events.append(_event(req, row.last_seq))
        if row.delivers(req.kind):
            deliveries.append(_delivery(req, row, now))
        if req.idempotency_key is not None:
            keys.append((req.session_id, req.idempotency_key, row.last_seq, req.idempotency_digest))
    touched = sorted({event[0] for event in events if event[0] in rows})
    if touched:
        cursor.executemany(
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
    if keys:
        cursor.executemany(sql.insert_key, keys)
    if deliveries:  # the outbox: in the transaction of the events they carry
        cursor.executemany(sql.insert_delivery, deliveries)
    for sid, r in rows.items():
        learned[sid] = (r.last_seq, r.lease_token)
    for i, first_index in duplicate_of.items():
        first = outcomes[first_index]
        if isinstance(first, int):
            outcomes[i] = _replay(requests[i], first, requests[first_index].idempotency_digest)
        else:
            outcomes[i] = first


def _replay(req: AppendRequest, seq: int, digest: str | None) -> Outcome:
    """The outcome of an append whose key was used before: a replay, or a conflict.

    A key stored without a digest (before digests were kept, or by a caller that sends
    none) matches any request.
    """
    if digest is not None and req.idempotency_digest not in (None, digest):
        return IdempotencyConflict(req.session_id, seq)
    return ReplayedSeq(seq)


def _last_user_seq(cursor: Any, sql: Sql, session_id: str) -> int:
    """The seq of the session's newest input (a user message or a subagent's result; 0 if
    none); read under the lock."""
    cursor.execute(sql.last_user, (session_id, *sorted(INPUT_EVENTS)))
    found = cursor.fetchone()
    return int(found[0]) if found else 0
