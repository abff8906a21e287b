"""What a principal does to a session's life: interrupt its turn, close it, release it.

Each function runs inside the caller's write transaction (`Sessions` opens it), so the
events it writes and the row it changes commit together or not at all. The rules:

- interrupt: the turn in flight ends `interrupted_by_operator` and the lease is revoked
  (a new token, no owner): the worker running it can commit nothing more, and recovery,
  which continues only active turns, never resurrects it.
- close: the same for a turn in flight, then the session is `closed`: no pending input,
  no lease, and the event log refuses new user messages (`SessionClosed`). Recovery and
  assignment read only open sessions. Its history is kept. Closing a closed session
  changes nothing.
- release: a quarantined session is open again. Its poisoned turn (the one that kept
  killing workers) is ended `failed` if it is still active, and a notice tells the user
  it will not be retried; the attempts are reset, so the next user message starts a new
  turn under the usual accounting.
"""

from __future__ import annotations

import json
from typing import Any

import peewee

from supervisor.core.vocabulary import EventType, SessionStatus, TurnOutcome, Writer
from supervisor.store.errors import SessionNotFound
from supervisor.store.eventlog import make_request, write_events
from supervisor.store.events import AppendRequest
from supervisor.store.models import Event, Session

RELEASED = "released"  # the reason of a released session's turn_ended and notice

Written = tuple[int, EventType]  # an event written here: its seq and type, to signal


def append_all(db: peewee.Database, requests: list[AppendRequest]) -> list[int]:
    """Append `requests` in the open transaction; the first refusal aborts it."""
    seqs: list[int] = []
    for outcome in write_events(db, requests):
        if isinstance(outcome, Exception):
            raise outcome
        seqs.append(outcome)
    return seqs


def revoked() -> dict[Any, Any]:
    """The row changes that take the lease from whoever holds it: no worker writes on."""
    return {
        Session.owner: None,
        Session.lease_expires_at: None,
        Session.lease_token: Session.lease_token + 1,
    }


def locked_row(session_id: str) -> Session:
    """The session row, locked for the open write transaction: on the server databases
    (`SELECT ... FOR UPDATE`) two daemons that decide on one row take turns, and the second
    decides on what the first wrote; SQLite's `BEGIN IMMEDIATE` already serializes them."""
    query = Session.select().where(Session.id == session_id)
    if Session._meta.database.for_update:
        query = query.for_update()
    row = query.first()
    if row is None:
        raise SessionNotFound(session_id)
    return row


def locked_row_if_any(session_id: str | None) -> Session | None:
    """`locked_row`, or None when there is no such session (or no id): a registry row
    whose session was deleted, or that never had one."""
    if session_id is None:
        return None
    try:
        return locked_row(session_id)
    except SessionNotFound:
        return None


# What a turn's model call streamed so far: its turn id, the text, and whether it is whole.
Streamed = tuple[str, str, bool]
CUT = "interrupted"  # the finish_reason of an answer an interrupt cut (as the worker's)


def _turn_ended(row: Session, writer: str, payload: dict[str, Any]) -> list[AppendRequest]:
    """The active turn's `turn_ended`, if a turn is active."""
    if row.active_turn_id is None:
        return []
    return [
        make_request(
            row.id, EventType.TURN_ENDED, payload, turn_id=row.active_turn_id, writer=writer
        )
    ]


def interrupt(
    db: peewee.Database, session_id: str, by: str, streamed: Streamed | None = None
) -> list[Written]:
    """End the turn in flight as `interrupted_by_operator`; the events written (the cut
    answer, if any, then `turn_ended`), none if no turn ran.

    `streamed`: what the turn's model call in flight streamed so far (turn id, text, and
    whether every delta of it arrived). If it is the active turn's, it is committed first
    as the cut answer (`model_response`, finish reason "interrupted"): the text the user
    watched being written stays in the log. Its worker, fenced out by this transaction,
    can commit nothing more."""
    row = locked_row(session_id)
    ended = _turn_ended(
        row, Writer.INTAKE, {"outcome": TurnOutcome.INTERRUPTED_BY_OPERATOR, "by": by}
    )
    if not ended:
        return []
    if (
        streamed is not None
        and streamed[0] == row.active_turn_id
        and streamed[1]
        and not _answered(session_id, streamed[0], streamed[1])
    ):
        turn, text, complete = streamed
        cut: dict[str, Any] = {"text": text, "tool_calls": [], "finish_reason": CUT, "usage": {}}
        if not complete:
            cut["incomplete"] = True  # deltas were lost on the way: the text has gaps
        answer = make_request(
            session_id, EventType.MODEL_RESPONSE, cut, turn_id=turn, writer=Writer.INTAKE
        )
        ended.insert(0, answer)
    seqs = append_all(db, ended)
    Session.update(revoked()).where(Session.id == session_id).execute()
    return _written(seqs, ended)


def close(db: peewee.Database, session_id: str, by: str) -> list[Written]:
    """Close the session; the events written, none if it was closed already."""
    row = locked_row(session_id)
    if row.status == SessionStatus.CLOSED:
        return []
    events = _turn_ended(
        row, Writer.SUPERVISOR, {"outcome": TurnOutcome.INTERRUPTED_BY_OPERATOR, "by": by}
    )
    text = f"This session was closed by {by}: it takes no more messages. Create a new one."
    events.append(
        make_request(
            session_id,
            EventType.NOTICE,
            {"text": text, "reason": SessionStatus.CLOSED, "by": by},
            writer=Writer.SUPERVISOR,
        )
    )
    seqs = append_all(db, events)
    changes = revoked() | {Session.status: SessionStatus.CLOSED, Session.pending: False}
    Session.update(changes).where(Session.id == session_id).execute()
    return _written(seqs, events)


def release(db: peewee.Database, session_id: str, by: str) -> list[Written]:
    """Lift a quarantine; the events written, none if the session was not quarantined."""
    row = locked_row(session_id)
    if row.status != SessionStatus.QUARANTINED:
        return []
    poisoned = row.active_turn_id or _last_turn(session_id)
    events = _turn_ended(
        row, Writer.SUPERVISOR, {"outcome": TurnOutcome.FAILED, "reason": RELEASED}
    )
    text = (
        f"The quarantine was lifted by {by}. The turn that kept failing was ended and will "
        "not be retried; send your message again to start a new turn."
    )
    events.append(
        make_request(
            session_id,
            EventType.NOTICE,
            {"text": text, "reason": RELEASED, "by": by},
            turn_id=poisoned,
            writer=Writer.SUPERVISOR,
        )
    )
    seqs = append_all(db, events)
    changes = revoked() | {
        Session.status: SessionStatus.OPEN,
        Session.quarantined_at: None,
        Session.quarantine_reason: None,
        Session.attempt_turn_id: None,
        Session.attempt_count: 0,
    }
    Session.update(changes).where(Session.id == session_id).execute()
    return _written(seqs, events)


def _written(seqs: list[int], events: list[AppendRequest]) -> list[Written]:
    return [(seq, EventType(event.type)) for seq, event in zip(seqs, events, strict=True)]


def _answered(session_id: str, turn_id: str, text: str) -> bool:
    """Whether the turn's newest answer already holds `text`: its worker committed it, and
    the supervisor, which had not yet heard so, holds the text it streamed. No cut then:
    it would be that answer a second time."""
    newest = (
        Event.select(Event.payload)
        .where(
            (Event.session_id == session_id)
            & (Event.turn_id == turn_id)
            & (Event.type == EventType.MODEL_RESPONSE)
        )
        .order_by(Event.seq.desc())
        .first()
    )
    if newest is None:
        return False
    try:
        payload = json.loads(newest.payload)  # stored as JSON text
    except (TypeError, ValueError):
        return False
    return isinstance(payload, dict) and str(payload.get("text", "")).startswith(text)


def _last_turn(session_id: str) -> str | None:
    """The turn the latest `turn_ended` ended: a quarantine's turn, ended by recovery."""
    turn: str | None = (
        Event.select(Event.turn_id)
        .where((Event.session_id == session_id) & (Event.type == EventType.TURN_ENDED))
        .order_by(Event.seq.desc())
        .limit(1)
        .scalar()
    )
    return turn
