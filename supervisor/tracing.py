"""The supervisor's spans of turns: each run's root, its assignment, what started it.

A run of a turn is one trace (`supervisor.core.traces`: its ids are derived from the
turn and the event that opened the run). Its root span, `turn`, is the supervisor's: it
is opened when the worker signals the run's opening event (`committed` with the turn),
backdated to when the input that started it arrived, and ended when the turn's
`turn_ended` is signalled, or failed when the worker dies, releases the session or is
fenced out, or the daemon stops. A root kept here outlives a SIGKILL of the worker,
whose own spans (children of the root) are lost with what it had queued.

What started a run (`turnkeeper.turn.trigger`) is the input the supervisor saw arrive
for the session since its previous run opened: a request to the API (intake), a
schedule's fire, a task's or a subagent's result; a continuation is recovery's (its
assignment continued an interrupted turn) or its worker's own. The intake request's
span is a trace of its own, *linked* from the root rather than its parent: the request
ends at its 202 before any turn begins, a turn may answer several queued messages, and a
message may wait behind a turn in flight. Each assignment is a short span too; its
`traceparent` crosses the control plane in the `assign` message, and the worker's run
links to it. A continuation's root links to the root of the run it continues.

With tracing off, every method returns at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from supervisor.contract import control
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.telemetry import Tracing
from supervisor.core.traces import SpanIds, Trigger, run_root, trigger_of
from supervisor.core.vocabulary import AssignReason, EventType
from supervisor.runtime.bus import Bus, Committed, WorkerExited

MAX_SESSIONS = 10_000  # sessions whose causes are remembered; the oldest are forgotten
MAX_CAUSES = 8  # causes remembered a session (the oldest say what started the run)
MAX_AGE = 3600.0  # seconds: an older cause does not backdate a root
_TRIGGER_OF_EVENT = {
    EventType.USER_MESSAGE: Trigger.SCHEDULE,  # the supervisor commits one for a schedule
    EventType.TASK_RESULT: Trigger.TASK_RESULT,
    EventType.SUBAGENT_RESULT: Trigger.SUBAGENT_RESULT,
}
RECOVERY_REASONS = frozenset({AssignReason.ADOPT, AssignReason.RESTART, AssignReason.HANDOFF})


@dataclass
class _Cause:
    trigger: str
    at: float  # the wall clock's seconds
    span: SpanIds | None = None


@dataclass
class _Session:
    causes: list[_Cause] = field(default_factory=list)
    assigned: SpanIds | None = None
    reason: str = ""
    run: Any = None  # the root span of the run in flight
    worker: str = ""


class TurnTraces:
    """The root spans of the runs of turns, and the spans that lead to them."""

    def __init__(self, tracing: Tracing | None, bus: Bus | None = None, clock: Clock = SYSTEM):
        self.tracing = tracing
        self.clock = clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self._workers_own: set[tuple[str, int]] = set()  # a worker's input, not a schedule's
        if tracing is not None and bus is not None:
            bus.subscribe(Committed, self._committed_here)
            bus.subscribe(WorkerExited, self._worker_exited)

    @property
    def on(self) -> bool:
        return self.tracing is not None

    def _session(self, session_id: str) -> _Session:
        found = self.sessions.get(session_id)
        if found is None:
            found = self.sessions[session_id] = _Session()
            if len(self.sessions) > MAX_SESSIONS:
                self._forget(len(self.sessions) - MAX_SESSIONS)
        else:
            self.sessions.move_to_end(session_id)
        return found

    def _forget(self, count: int) -> None:
        """Forget the `count` least recently seen sessions with no run in flight (a run in
        flight is kept: its root ends when its turn does). Past twice MAX_SESSIONS, the
        oldest go whatever they hold: their roots are never ended, and never exported."""
        idle = [sid for sid, held in self.sessions.items() if held.run is None][:count]
        for sid in idle:
            del self.sessions[sid]
        while len(self.sessions) > 2 * MAX_SESSIONS:
            self.sessions.popitem(last=False)

    # --- what leads to a run ----------------------------------------------------------

    def request(self, name: str, session_id: str, attributes: dict[str, Any]) -> Any:
        """A span for an API request about the session (kind server), started; None when
        tracing is off. `arrived` makes it a cause of the session's next run."""
        if self.tracing is None:
            return None
        return self.tracing.start(
            name, kind="server", attributes={"turnkeeper.session.id": session_id, **attributes}
        )

    def arrived(self, session_id: str, trigger: Trigger, span: Any = None) -> None:
        """Input for the session arrived (committed): the next run's trigger and a link."""
        if self.tracing is None:
            return
        causes = self._session(session_id).causes
        if len(causes) < MAX_CAUSES:
            ids = Tracing.ids(span) if span is not None else None
            causes.append(_Cause(trigger, self.clock.time(), ids))

    def _committed_here(self, event: Committed) -> None:
        """An event the supervisor committed (a schedule's message, a result)."""
        if (event.session, event.seq) in self._workers_own:
            self._workers_own.discard((event.session, event.seq))
            return
        trigger = _TRIGGER_OF_EVENT.get(event.event_type)  # type: ignore[call-overload]
        if trigger is not None and event.wake:
            self.arrived(event.session, trigger)

    def assigning(self, session_id: str, worker: str, reason: str, cause: str | None) -> str | None:
        """The session is being assigned to `worker`: the assignment's span (ended at
        once), whose traceparent goes with the `assign`; None when tracing is off."""
        if self.tracing is None:
            return None
        attributes = {
            "turnkeeper.session.id": session_id,
            "turnkeeper.worker": worker,
            "turnkeeper.assign.reason": reason,
        }
        if cause:
            attributes["turnkeeper.assign.cause"] = cause
        span = self.tracing.start("assign", parent=None, attributes=attributes)
        span.end()
        ids = Tracing.ids(span)
        session = self._session(session_id)
        session.assigned, session.reason = ids, reason
        return ids.traceparent

    # --- the runs ---------------------------------------------------------------------

    def said(self, worker: str, message: control.Committed) -> None:
        """A worker's `committed` signal: a run opens, or its turn ended."""
        if self.tracing is None:
            return
        if message.event_type == EventType.USER_MESSAGE:
            self._workers_own.add((message.session, message.seq))  # an autonomous run's
            if len(self._workers_own) > MAX_SESSIONS:
                self._workers_own.clear()
        if message.turn is None:
            return
        if message.event_type in (EventType.TURN_STARTED, EventType.CONTINUATION):
            self._open(worker, message)
        elif message.event_type == EventType.TURN_ENDED:
            self._close(message.session, None)

    def _open(self, worker: str, message: control.Committed) -> None:
        assert self.tracing is not None and message.turn is not None
        session = self._session(message.session)
        self._close(message.session, "continued")  # a run still open: its worker went on
        causes, session.causes = session.causes, []
        now = self.clock.time()
        recent = [c.at for c in causes if now - c.at <= MAX_AGE]
        started = min(recent, default=now)
        trigger = trigger_of(
            message.event_type, [c.trigger for c in causes], session.reason in RECOVERY_REASONS
        )
        links = [c.span for c in causes if c.span is not None]
        if message.follows is not None:
            links.insert(0, run_root(message.turn, message.follows))
        if session.assigned is not None:
            links.append(session.assigned)
        attributes: dict[str, Any] = {
            "turnkeeper.session.id": message.session,
            "turnkeeper.turn.id": message.turn,
            "turnkeeper.turn.trigger": trigger.value,
            "turnkeeper.run.opened_at": message.seq,
            "turnkeeper.turn.continued": message.follows is not None
            or message.event_type == EventType.CONTINUATION,
            "turnkeeper.worker": worker,
        }
        if message.attempt is not None:
            attributes["turnkeeper.turn.attempt"] = message.attempt
        if message.follows is not None:
            attributes["turnkeeper.run.follows"] = message.follows
        session.run = self.tracing.start(
            "turn",
            ids=run_root(message.turn, message.seq),
            attributes=attributes,
            links=links,
            start_ns=int(started * 1e9),
        )
        session.worker = worker
        session.reason = ""

    def _close(self, session_id: str, failed: str | None) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.run is None:
            return
        run, session.run = session.run, None
        if failed is not None:
            Tracing.fail(run, failed)
        run.end()

    def stopped(self, session_id: str, why: str) -> None:
        """The session's run stopped without its turn ending (released, fenced out)."""
        self._close(session_id, why)

    def _worker_exited(self, event: WorkerExited) -> None:
        for session_id, session in list(self.sessions.items()):
            if session.run is not None and session.worker == event.identity:
                self._close(session_id, "worker_exited")

    def close_all(self, why: str) -> None:
        """Every run still open ends, failed with `why` (the daemon stops)."""
        for session_id in list(self.sessions):
            self._close(session_id, why)
