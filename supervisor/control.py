"""Control-plane messages between the supervisor (ROUTER) and its workers (DEALERs).

One JSON frame per message, with a `type`. The database is the source of truth: every
message only signals, and is safe to lose or to receive twice, because the receiver
re-reads the database before it acts.

worker -> supervisor:
    hello       {worker, pid}                  connected, store open: ready for sessions
    heartbeat   {worker, sessions, turns}      alive; sent from the worker's event loop
    committed   {session, event}               an event was committed (for live streams)
    turn_done   {session, turn_id, outcome}    a turn ended
    released    {session}                      stopped at an event boundary, lease released
    lease_lost  {session}                      fenced out: the session is someone else's

supervisor -> worker:
    assign      {session, token, reason}       own this session with this lease token;
                                               reason: new | adopt | handoff | restart
                                               | stale
    release     {session}                      stop at the next event boundary, release
    wake        {session}                      re-read the session: there may be work
    interrupt   {session}                      cancel the turn in flight (operator)
    stop        {}                             release everything and exit 0
"""

from __future__ import annotations

import json
from typing import Any

FROM_WORKER = frozenset({"hello", "heartbeat", "committed", "turn_done", "released", "lease_lost"})
FROM_SUPERVISOR = frozenset({"assign", "release", "wake", "interrupt", "stop"})

# What a continuation note says about the cause, by assignment reason.
CONTINUATION_CAUSE = {
    "adopt": "worker_crash",
    "restart": "daemon_restart",
    "handoff": "handoff",
    "stale": "lease_expired",
    "new": "interrupted",
}


class ProtocolError(ValueError):
    """A frame that is not a message of the control plane."""


def encode(type: str, **fields: Any) -> bytes:
    """One message as its frame."""
    if type not in FROM_WORKER | FROM_SUPERVISOR:
        raise ProtocolError(f"unknown message type {type!r}")
    return json.dumps({"type": type, **fields}, separators=(",", ":")).encode()


def decode(frame: bytes, allowed: frozenset[str]) -> dict[str, Any]:
    """The message in `frame`; ProtocolError unless it is a JSON object of an allowed type."""
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    if not isinstance(message, dict) or message.get("type") not in allowed:
        raise ProtocolError(f"unexpected message: {str(message)[:200]}")
    return message
