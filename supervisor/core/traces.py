"""Which trace a run of a turn is, as pure code: ids derived, W3C trace context read.

A run of a turn (its first, or a continuation after a crash, a restart, a cut answer)
is one trace (docs/architecture.md, "Traces"). Its trace id and the span id of its root
are a function of the turn and the seq of the event that opened the run (`turn_started`
or a `continuation` note): the supervisor, which emits the root span, and the worker,
whose spans are its children, name the same trace without asking each other, and a
continuation links to the run it continues by reading that run's opening seq from the
log, after a SIGKILL or a restart as well. No table holds a trace id.

Why the opening seq and not the attempt number: attempts count what recovery charged,
and a run is not always charged (a handoff in a rolling restart continues the turn under
the same attempt; a worker killed while it waited charged one it never ran). The seq of
the event that opened the run is unique to it and in the log.

A `traceparent` (W3C Trace Context, version 00) comes from another process: anything
that does not parse is ignored (None), never an error that stops a turn.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
MAX_TRACEPARENT = 128  # characters: longer is not a traceparent of any version we read


@dataclass(frozen=True)
class SpanIds:
    """A span's place: its trace id (128 bits) and span id (64 bits), both non-zero."""

    trace_id: int
    span_id: int

    @property
    def traceparent(self) -> str:
        """The W3C `traceparent` of this span, sampled."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"


def run_root(turn_id: str, opened_at: int) -> SpanIds:
    """The root span of the run of `turn_id` opened by the event at seq `opened_at`."""
    digest = hashlib.sha256(f"turnkeeper/run/{turn_id}/{opened_at}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return SpanIds(trace_id, span_id)


def parse_traceparent(value: object) -> SpanIds | None:
    """The span a `traceparent` names, or None for anything that is not one.

    Version 00 must be exactly four fields; a later version may append fields (read the
    first four, as the W3C rule says); version ff, all-zero ids and upper case are
    invalid.
    """
    if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
        return None
    found = _TRACEPARENT.fullmatch(value)  # `.` matches no newline: none slips in
    if found is None:
        return None
    version, trace, span, _flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return SpanIds(trace_id, span_id)


class Trigger(StrEnum):
    """What started a run of a turn (`turnkeeper.turn.trigger` on its root span)."""

    INTAKE = "intake"  # a user message or wake through the HTTP API
    SCHEDULE = "schedule"  # a schedule's fire
    TASK_RESULT = "task_result"  # a background task's outcome
    SUBAGENT_RESULT = "subagent_result"  # a subagent's outcome
    INPUT = "input"  # input this daemon did not see arrive (the CLI, another host)
    RECOVERY = "recovery"  # the supervisor continued an interrupted turn
    CONTINUATION = "continuation"  # its worker continued it (a cut answer, a model error)


def trigger_of(opening: str, causes: list[str], continued_by_recovery: bool) -> Trigger:
    """The trigger of a run opened by an event of type `opening` (`turn_started` or
    `continuation`), given the input the supervisor saw arrive for the session since the
    previous run opened (`causes`: Trigger values, oldest first) and whether its last
    assignment continued an interrupted turn."""
    if opening != "turn_started":
        return Trigger.RECOVERY if continued_by_recovery else Trigger.CONTINUATION
    for cause in causes:
        if cause in Trigger.__members__.values():
            return Trigger(cause)
    return Trigger.INPUT
