"""Events and the rules of the log, as pure code: what an append is, what it does to its
session's row. `eventlog.py` writes them; nothing here touches the database.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import INPUT_EVENTS, TURN_EVENTS, EventType, SessionStatus, Writer
from supervisor.deliveries.rules import kind_of

EVENT_TYPES = frozenset(EventType)
WRITERS = frozenset(Writer)
# The events that change their session row beyond `last_seq` (see `advance`).
ROW_EVENTS = INPUT_EVENTS | {EventType.TURN_STARTED, EventType.TURN_ENDED}


def _encoder() -> Callable[[dict[str, Any]], str]:
    """`json.dumps(obj, ensure_ascii=False, allow_nan=False)` for a dict, built once.

    `json.dumps` with options builds a new encoder on every call (~2 us of an append's
    few). The C encoder here keeps no state between calls (no circular-reference marks:
    a cycle ends in RecursionError instead), so threads may share it.
    """
    python = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator
        return python.encode
    # markers, default, string encoder, indent, separators, sort_keys, skipkeys, allow_nan
    encoder = make(
        None, python.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, False
    )
    return lambda obj: "".join(encoder(obj, 0))


_encode = _encoder()


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
    lease_token: int | None = None  # the token the writer held; None for intake

    def to_dict(self) -> dict[str, Any]:
        """The API shape of an event."""
        return {
            "seq": self.seq,
            "type": self.type,
            "turn_id": self.turn_id,
            "payload": self.payload,
            "created_at": self.created_at,
        }


class ReplayedSeq(int):
    """The seq of an append that an idempotency key already made: nothing new was written.

    An `int` like any seq, so callers that only want the seq need not care; intake tells a
    replay from a first append with `isinstance(seq, ReplayedSeq)`.
    """


def scoped_key(principal: str, key: str) -> str:
    """The stored form of a client's Idempotency-Key: scoped to its principal.

    Two principals may use the same key on one session without meeting each other.
    """
    return hashlib.sha256(f"{principal}\n{key}".encode()).hexdigest()


CALL_ID_MAX = 200  # the width of the columns that keep a tool call's id


def call_key(call_id: str | None) -> str | None:
    """The stored form of a model's tool call id: its own, unless too long for the column
    or holding a NUL (a model's ids are its own), then hashed."""
    if call_id is not None and (len(call_id) > CALL_ID_MAX or "\x00" in call_id):
        return "sha256:" + hashlib.sha256(call_id.encode("utf-8", "replace")).hexdigest()
    return call_id


def request_digest(canonical: str) -> str:
    """What an idempotency key's first request was, to tell a replay from a reuse."""
    return hashlib.sha256(canonical.encode()).hexdigest()


class EventLimits:
    """How large one stored event may be: `store.max_event_bytes` of its payload's JSON.

    One per process: the daemon and each worker set it from their configuration when they
    open their store (`Store(..., max_event_bytes=...)`)."""

    max_event_bytes: int = 8 << 20


limits = EventLimits()


class EventTooLarge(ValueError):
    """An event whose payload is over `store.max_event_bytes`: nothing is written."""

    def __init__(self, type: str, size: int, limit: int) -> None:
        super().__init__(
            f"a {type} event of {size} bytes is over store.max_event_bytes ({limit}); "
            "it was not stored"
        )


@dataclass(slots=True)
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
    # With a key: the digest of the request that made it (a different one is a conflict).
    idempotency_digest: str | None = None
    # `turn_started` only: the last seq the turn read before it started. The session stays
    # pending if a user message came after it (the turn did not see that message).
    read_to: int | None = None
    # What a delivery target could be sent of it (`DeliveryKind`), if anything: such an
    # append reads its session row under the lock, for the session's target.
    kind: str | None = None
    # Resolved by the committer: a thread's Future, or an asyncio future of `loop`, or a
    # held `waiter` lock it releases once `outcome` is set.
    future: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    waiter: Any = None
    outcome: Any = None


def make_request(
    session_id: str,
    type: str,
    payload: dict[str, Any] | None = None,
    *,
    token: int | None = None,
    turn_id: str | None = None,
    writer: str = Writer.WORKER,
    idempotency_key: str | None = None,
    idempotency_digest: str | None = None,
    created_at: float | None = None,
) -> AppendRequest:
    """Validate an append in the caller's thread, so a bad one never reaches a batch.

    `created_at` defaults to now; a caller that also publishes the event live passes its
    own, so the live copy and the stored one agree.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type!r}; known: {', '.join(sorted(EVENT_TYPES))}")
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; known: {', '.join(sorted(WRITERS))}")
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise ValueError(f"event payload must be a JSON object, not {payload.__class__.__name__}")
    try:
        payload_json = _encode(payload)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"event payload is not JSON-serializable: {exc}") from exc
    # A character is at most 4 bytes of UTF-8: most payloads need no encoding to be judged.
    if len(payload_json) * 4 > limits.max_event_bytes:
        size = len(payload_json.encode("utf-8", "surrogatepass"))
        if size > limits.max_event_bytes:
            raise EventTooLarge(type, size, limits.max_event_bytes)
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
        idempotency_digest=idempotency_digest,
        created_at=SYSTEM.time() if created_at is None else created_at,
        read_to=_read_to(type, payload),
        kind=kind_of(type, payload),
    )


def _read_to(type: str, payload: dict[str, Any]) -> int | None:
    value = payload.get("read_to") if type == EventType.TURN_STARTED else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"turn_started read_to must be a seq (a whole number), not {value!r}")
    return value


@dataclass
class SessionRow:
    """The columns of a session row that appends maintain."""

    last_seq: int
    lease_token: int
    pending: bool
    active_turn_id: str | None
    attempt_turn_id: str | None
    attempt_count: int
    resend_requested_at: float | None = None
    status: str = "open"  # read only: appends never change it
    deliver_to: str | None = None  # read only: the target its deliveries go to
    deliver_kinds: str = ""  # read only: the `DeliveryKind`s it sends, space-separated

    def delivers(self, kind: str | None) -> bool:
        """Whether an event of delivery kind `kind` gets a delivery row."""
        return (
            kind is not None and self.deliver_to is not None and kind in self.deliver_kinds.split()
        )


def advance(row: SessionRow, event: AppendRequest) -> None:
    """Apply one appended event to its session row (pure; the rules of the event log).

    - every event takes the next seq;
    - `user_message` marks the session pending (it needs a turn), and clears a request
      to resend (recovery's mark after it ended a turn it could not continue);
    - `subagent_result`, `task_result` and `restart_result` mark it pending too (its next
      turn reads the result), unless the session is closed;
    - `turn_started` clears pending, makes its turn active and charges its first attempt
      (`write_events` keeps pending when a user message came after the turn's `read_to`);
    - `turn_ended` clears the active turn and its attempts.

    Continuation attempts are charged by recovery with the lease it hands the turn over
    with (`Leases.grant`), and by a worker before it continues its own turn
    (`Sessions.charge_attempt`), not by the note the worker then writes: a worker that
    dies before its note was still charged.
    """
    row.last_seq += 1
    if event.type == EventType.USER_MESSAGE:
        row.pending = True
        row.resend_requested_at = None
    elif event.type in (EventType.SUBAGENT_RESULT, EventType.TASK_RESULT, EventType.RESTART_RESULT):
        row.pending = row.pending or row.status != SessionStatus.CLOSED
    elif event.type == EventType.TURN_STARTED:
        row.pending = False
        row.active_turn_id = event.turn_id
        row.attempt_turn_id, row.attempt_count = event.turn_id, 1
    elif event.type == EventType.TURN_ENDED:
        row.active_turn_id = None
        row.attempt_turn_id, row.attempt_count = None, 0
