"""Control-plane messages between the supervisor (ROUTER) and its workers (DEALERs).

One JSON frame per message, with a `type`. The database is the source of truth: every
message only signals, and is safe to lose or to receive twice, because the receiver
re-reads the database before it acts.

worker -> supervisor:
    hello       {worker, pid}                  connected, store open: ready for sessions
    heartbeat   {worker, sessions, turns,      alive; sent from the worker's event loop,
                 mcp, append_latency}          with its MCP servers by state and the
                                               append latencies since the last one
    committed   {session, event}               an event was committed (for live streams)
    turn_done   {session, turn_id, outcome}    a turn ended
    released    {session}                      stopped at an event boundary, lease released
    lease_lost  {session}                      fenced out: the session is someone else's

supervisor -> worker:
    assign      {session, token, reason,       own this session with this lease token;
                 cause}                        reason: new | adopt | handoff | restart
                                               | stale; cause: what stopped the turn,
                                               for the continuation note
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
# What stopped a turn, as the continuation note and recovery's notices tell the user.
CAUSE_TEXT = {
    "worker_crash": "the worker process running it stopped unexpectedly",
    "daemon_restart": "the turnkeeper daemon restarted",
    "handoff": "the session moved to another worker during a rolling restart",
    "lease_expired": "the worker running it stopped responding and lost the session",
    "interrupted": "its previous owner stopped",
    "max_tokens": "the model's answer was cut off by its output token limit",
}


# Upper bounds (seconds) of the append latency histogram, shared by workers and supervisor.
APPEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Observations since the last `take`: counts per bucket (the last is +Inf) and sum.

    Workers send these as deltas in their heartbeats; the supervisor adds them up.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._reset()

    def _reset(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.sum += value

    def take(self) -> dict[str, Any]:
        """The delta since the last take, as a JSON-able dict; starts a new one."""
        delta = {"counts": self.counts, "sum": self.sum}
        self._reset()
        return delta


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
