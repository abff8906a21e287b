"""Recorded event logs replayed through the rules, as Temporal's replay tests do.

Each `logs/<scenario>.json` is the event log of sessions a real daemon served while its
workers or itself were SIGKILLed mid-turn (written by `tests/replay/record.py`, which says
how). Here, in process and with fixed times, every log is replayed through the pure rules
the daemon decides with after a crash:

- the session row is rebuilt from the log by the event log's own reducer
  (`supervisor.store.events.advance`) and must end as the recorded row did;
- every prefix of the log that leaves the session with work (a turn in flight, or input
  no turn has read) is a plausible crash point. For each, one dispatch pass of the
  ownership engine (`supervisor.core.engine.plan`) is run in two worlds, its worker
  SIGKILLed (`worker_killed`) and the daemon restarted (`daemon_restarted`), one second
  after the prefix's last event; the session it judges gets recovery's decision
  (`supervisor.core.recovery`), which `engine.after_judgement` and `engine.runner_step`
  carry on to what the next worker does. A third judgement (`stale`) is made a freshness
  later. The invariants: exactly one decision per session with work; a turn that ended
  is never continued, even judged from a stale row; only a continuable tail is
  continued, within the attempts, and its worker continues it (a queued message
  supersedes it);
- where the log shows what came of an interruption (a continuation note, repaired tool
  results, a resend notice, a turn ended for a queued message), the rules judged at that
  time, in the world its cause names, must give exactly that: the action, the cause, the
  attempt, the repaired results, the notice's text. A worker's own continuations (a cut
  answer) follow `supervisor.core.continuation` and the attempt schedule;
- the worker's history rebuilt from the log (`workers.history`, and `workers.cache`'s
  incremental log, which must agree with it at every prefix) is well formed: every tool
  call answered right after the message that asked for it, no tool result without its
  call, no two assistant messages in a row, and what a continuation would send the model
  at each crash point too.

Determinism check: the whole sequence of judgements of each log is kept next to it in
`logs/<scenario>.expected.json`. A change to the rules that alters any decision on a
recorded log fails `test_the_judgements_are_the_recorded_ones` with a diff. When the
change is meant, rewrite the expectations and review their diff:

    TURNKEEPER_REPLAY_UPDATE=1 .venv/bin/python -m pytest -q tests/replay

Pure code over the recorded files: no process, no sleep, no database.
"""

from __future__ import annotations

import difflib
import json
import os
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from supervisor.contract.sections import RecoveryConfig
from supervisor.core import continuation, engine, recovery
from supervisor.core.engine import Assign, Judge, Memory, Move, SessionView, Step, WorkerView
from supervisor.core.notices import notice
from supervisor.core.recovery import Action, Decision, Interruption, Trigger
from supervisor.core.tail import CONTINUABLE_TAILS, Resume, TailClass, resume_from
from supervisor.core.vocabulary import INPUT_EVENTS, AssignReason, Cause, EventType, TurnOutcome
from supervisor.pool.recoverer import TAIL_EVENTS
from supervisor.store import EventRecord
from supervisor.store.events import SessionRow, advance, make_request
from workers import history
from workers.cache import SessionLog
from workers.continuation import SUPERSEDED
from workers.models import Message

LOGS = Path(__file__).resolve().parent / "logs"
EXPECTED = ".expected.json"
LOG_FILES = sorted(p for p in LOGS.glob("*.json") if not p.name.endswith(EXPECTED))
UPDATE = os.environ.get("TURNKEEPER_REPLAY_UPDATE") == "1"
FORMAT = 1

# The worlds a crash point is judged in, and the cause a continuation note tells in each.
KILLED, RESTARTED = "worker_killed", "daemon_restarted"
WORLDS = (KILLED, RESTARTED)
WORLD_OF_CAUSE: dict[str | None, str] = {
    Cause.WORKER_CRASH: KILLED,
    Cause.DAEMON_RESTART: RESTARTED,
}
OWN_CAUSES = frozenset({Cause.MAX_TOKENS, Cause.MODEL_ERROR})  # a worker's own continuation
HOST, BOOT, OLD_BOOT = "host-a", "boot-1", "boot-0"
DEAD, LIVE = "w1.0", "w2.0"
MONOTONIC = 1000.0
AFTER = 1.0  # a crash point is judged this long after its last event


# --- the recorded logs ----------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One session of a recorded log."""

    log: str  # the scenario
    name: str
    id: str
    kind: str
    row: dict[str, Any]  # the session row at the end of the recording
    events: tuple[EventRecord, ...]


@dataclass(frozen=True)
class Log:
    path: Path
    header: dict[str, Any]
    sessions: tuple[Recorded, ...]
    settings: RecoveryConfig

    @property
    def expected_path(self) -> Path:
        return self.path.with_name(self.path.stem + EXPECTED)


@cache
def load(path: Path) -> Log:
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT, f"{path.name}: log format {data['format']}, not {FORMAT}"
    sessions = tuple(
        Recorded(
            data["scenario"],
            s["name"],
            s["id"],
            s["kind"],
            s["row"],
            tuple(
                EventRecord(
                    s["id"],
                    e["seq"],
                    e["type"],
                    e["turn_id"],
                    e["payload"],
                    e["created_at"],
                    e["writer"],
                    e["lease_token"],
                )
                for e in s["events"]
            ),
        )
        for s in data["sessions"]
    )
    settings = RecoveryConfig(**data["config"].get("recovery", {}))
    return Log(path, data, sessions, settings)


def logs_param() -> Any:
    return pytest.mark.parametrize("path", LOG_FILES, ids=[p.stem for p in LOG_FILES])


# --- the session row, rebuilt from the log --------------------------------------------


@dataclass(frozen=True)
class State:
    """The session row after a prefix of its log: what `advance` keeps, and the rest the
    log shows (recovery's charges by the notes that follow them, quarantine, the newest
    lease token)."""

    last_seq: int
    pending: bool
    active_turn_id: str | None
    attempt_turn_id: str | None
    attempt_count: int
    resend_requested: bool
    status: str
    lease_token: int


def states(session: Recorded) -> list[State]:
    """The row after each prefix: `states(s)[k]` is the row after the first k events."""
    row = SessionRow(
        last_seq=0,
        lease_token=0,
        pending=False,
        active_turn_id=None,
        attempt_turn_id=None,
        attempt_count=0,
    )
    last_input, token = 0, 0
    found = [_state(row, token)]
    for event in session.events:
        request = make_request(
            session.id,
            event.type,
            event.payload,
            token=event.lease_token,
            turn_id=event.turn_id,
            writer=event.writer,
            created_at=event.created_at,
        )
        advance(row, request)
        assert row.last_seq == event.seq, f"{session.name}: seq {event.seq} out of order"
        # What `write_batch` adds to `advance`: a turn that did not read the newest input
        # leaves the session pending.
        if event.type in INPUT_EVENTS:
            last_input = row.last_seq
        elif request.read_to is not None:
            row.pending = last_input > request.read_to
        attempt = event.payload.get("attempt")
        if (
            event.type == EventType.CONTINUATION
            and isinstance(attempt, int)
            and row.attempt_turn_id == event.turn_id
        ):
            row.attempt_count = max(row.attempt_count, attempt + 1)  # its charge came first
        if event.type == EventType.NOTICE and event.payload.get("resend"):
            row.resend_requested_at = event.created_at
            if event.payload.get("reason") == "quarantined":
                row.status = "quarantined"
        token = max(token, event.lease_token or 0)
        found.append(_state(row, token))
    return found


def _state(row: SessionRow, token: int) -> State:
    return State(
        row.last_seq,
        row.pending,
        row.active_turn_id,
        row.attempt_turn_id,
        row.attempt_count,
        row.resend_requested_at is not None,
        row.status,
        token,
    )


@dataclass(frozen=True)
class RowView:
    """The session row `recovery.interruption` reads (a `SessionInfo` has these)."""

    active_turn_id: str | None
    attempt_turn_id: str | None
    attempt_count: int
    lease_expires_at: float | None
    owner: str | None
    status: str
    pending: bool
    updated_at: float


# --- one crash point, judged ----------------------------------------------------------


@dataclass(frozen=True)
class Judged:
    """What the rules do with a session after a crash: the engine's command for it, and
    for a judged turn recovery's decision and what the next worker does with it."""

    world: str
    command: Assign | Judge
    facts: Interruption | None = None
    decision: Decision | None = None
    reason: AssignReason | None = None  # the assignment that follows, if any
    step: Step | None = None  # what the worker given the session does first

    def describe(self, now: float) -> str:
        if isinstance(self.command, Assign):
            return f"assign {self.command.reason.value} -> {_value(self.step)}"
        d = self.decision
        assert d is not None
        text = f"judge {self.command.trigger.value}: {d.action.value}"
        if d.action is Action.CONTINUE:
            text += f" ({d.cause}, attempt {d.attempt})"
        if d.action is Action.CONTINUE_AT and d.at is not None:
            text += f" in {d.at - now:.2f} s"
        text += " +quarantine" if d.quarantine else ""
        text += " (suppressed)" if d.suppressed else ""
        if self.reason is not None:
            text += f" -> {self.reason.value}/{_value(self.step)}"
        return text


def _value(step: Step | None) -> str:
    return "-" if step is None else step.value


def judge(
    session: Recorded,
    prefix: tuple[EventRecord, ...],
    state: State,
    world: str,
    now: float,
    settings: RecoveryConfig,
    *,
    turn: str | None = None,
) -> Judged:
    """One dispatch pass over the session after a crash at the end of `prefix`, in
    `world`, at `now`: the engine's command for it and, for a judged turn, recovery's
    decision and the next worker's first step. `turn` judges that turn as the active one
    (a stale read of the row)."""
    assert session.kind != "subagent", "subagents have rules of their own: not replayed here"
    killed = world == KILLED
    owner = f"{HOST}/{BOOT if killed else OLD_BOOT}/{DEAD}"
    active = state.active_turn_id if turn is None else turn
    view = SessionView(
        id=session.id,
        owner=owner,
        lease_expires_at=now - AFTER,  # ran out: the crash stopped its renewal
        pending=state.pending,
        last_seq=state.last_seq,
        active_turn_id=active,
        lease_token=state.lease_token,
        status=state.status,
        kind=session.kind,
    )
    workers = {LIVE: WorkerView(LIVE, last_heartbeat=MONOTONIC)}
    if killed:
        workers[DEAD] = WorkerView(DEAD, alive=False, last_heartbeat=MONOTONIC)
    memory = Memory(died=True) if killed else Memory(picked=Trigger.BOOT_SCAN)
    facts = engine.Facts(
        owner_prefix=f"{HOST}/{BOOT}",
        host_prefix=f"{HOST}/",
        heartbeat_interval=0.2,
        live_hosts=(HOST,),
    )
    commands = engine.plan(
        [view],
        workers,
        {session.id: DEAD} if killed else {},
        {},
        {session.id: memory},
        facts,
        now=now,
        wall=now,
        monotonic=MONOTONIC,
        tokens={session.id: state.lease_token} if killed else {},
    )
    moves = [c for c in commands if isinstance(c, Move)]
    assert moves == ([Move(session.id, DEAD, renewing=False)] if killed else []), commands
    decided = [c for c in commands if not isinstance(c, Move)]
    assert len(decided) == 1, f"not one command for a session with work: {commands}"
    command = decided[0]
    assert isinstance(command, Assign | Judge), command
    assert command.worker == LIVE, command
    leased = replace(view, lease_token=state.lease_token + 1)  # the next lease
    if isinstance(command, Assign):
        step = engine.runner_step(leased, leased.lease_token, command.reason)
        return Judged(world, command, reason=command.reason, step=step)
    row = RowView(
        active_turn_id=active,
        attempt_turn_id=state.attempt_turn_id,
        attempt_count=state.attempt_count,
        lease_expires_at=view.lease_expires_at,
        owner=owner,
        status=state.status,
        pending=state.pending,
        updated_at=prefix[-1].created_at,
    )
    found = recovery.interruption(
        row,
        prefix[-TAIL_EVENTS:],
        command.trigger,
        now,
        host_prefix=f"{HOST}/",
        last_attempt_at=None,
        died=memory.died,
    )
    decision = recovery.decide(found, command.trigger, now, False, settings)
    assert decision == recovery.decide(found, command.trigger, now, False, settings)
    _, reason = engine.after_judgement(decision, command.trigger)
    if reason is None:
        return Judged(world, command, found, decision)
    step = engine.runner_step(leased, leased.lease_token, reason)
    return Judged(world, command, found, decision, reason, step)


def crash_points(session: Recorded) -> list[int]:
    """The prefixes (by length) after which the session has work: a crash there leaves
    it something to do. Not inside one transaction: a resend notice and its turn_ended
    are committed together."""
    rows = states(session)
    events = session.events
    points = []
    for k in range(1, len(events) + 1):
        state = rows[k]
        if not (state.active_turn_id or state.pending):
            continue
        if k < len(events) and _one_commit(events[k - 1], events[k]):
            continue
        points.append(k)
    return points


def _one_commit(first: EventRecord, second: EventRecord) -> bool:
    return (
        first.type == EventType.NOTICE
        and second.type == EventType.TURN_ENDED
        and first.writer == second.writer == "supervisor"
        and first.turn_id == second.turn_id
    )


def judgements(log: Log) -> dict[str, Any]:
    """Every crash point of every session of `log`, judged in each world and stale: the
    snapshot kept in `<scenario>.expected.json`, checked for the invariants on the way."""
    out: dict[str, Any] = {"scenario": log.header["scenario"], "sessions": {}}
    for session in log.sessions:
        rows = states(session)
        entries = []
        for k in crash_points(session):
            prefix, state = session.events[:k], rows[k]
            now = prefix[-1].created_at + AFTER
            entry: dict[str, Any] = {"after": prefix[-1].seq, "turn": state.active_turn_id}
            judged = {w: judge(session, prefix, state, w, now, log.settings) for w in WORLDS}
            for world, j in judged.items():
                check_judged(session, prefix, state, j, log.settings)
                if j.facts is not None:
                    entry["tail"] = j.facts.tail.value
                entry[world] = j.describe(now)
            if isinstance(judged[RESTARTED].command, Judge):
                later = now + log.settings.freshness
                stale = judge(session, prefix, state, RESTARTED, later, log.settings)
                check_judged(session, prefix, state, stale, log.settings)
                entry["stale"] = stale.describe(later)
            entries.append(entry)
        out["sessions"][session.name] = {
            "crash_points": entries,
            "history": roles(history.to_messages(session.events)),
        }
    return out


def check_judged(
    session: Recorded,
    prefix: tuple[EventRecord, ...],
    state: State,
    j: Judged,
    settings: RecoveryConfig,
) -> None:
    """The invariants of one judgement."""
    where = f"{session.log}/{session.name} after seq {prefix[-1].seq} ({j.world})"
    if isinstance(j.command, Assign):
        assert state.active_turn_id is None, f"{where}: a new turn over a turn in flight"
        assert j.command.reason is AssignReason.NEW and j.step is Step.START, where
        return
    assert j.decision is not None and j.facts is not None
    d, f = j.decision, j.facts
    assert state.active_turn_id is not None, f"{where}: judged with no turn in flight"
    assert j.command.trigger is (
        Trigger.USER_MESSAGE
        if state.pending
        else (Trigger.WORKER_DEATH if j.world == KILLED else Trigger.BOOT_SCAN)
    ), f"{where}: judged for {j.command.trigger}"
    if d.action is Action.CONTINUE:
        assert f.tail in CONTINUABLE_TAILS, f"{where}: continued from tail {f.tail}"
        assert d.attempt is not None and 1 <= d.attempt <= len(settings.attempt_delays), where
        assert not state.pending, f"{where}: continued over a queued user message"
        assert j.step is Step.CONTINUE, f"{where}: the worker does {j.step}, not continue"
        reason = AssignReason.ADOPT if j.world == KILLED else AssignReason.RESTART
        assert j.reason is reason, f"{where}: assigned {j.reason}, not {reason}"
        check_continuation_history(session, prefix, state.active_turn_id, where)
    elif d.action is Action.DRIVE_WITH_QUEUED_MESSAGE:
        assert state.pending and j.step is Step.SUPERSEDE, f"{where}: {j.step}"
    else:
        assert j.reason is None and j.step is None, where


# --- what the log shows came of each interruption -------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the log shows came of an interrupted turn: its events from index `crash` (the
    length of the prefix it came after: the crash point) to the decisive one, `event`."""

    kind: str  # continue, end_answered, drive, finalize, own_continue
    crash: int  # index of its first event (a repaired result, a notice, or `event`)
    event: EventRecord  # the note, or the turn_ended

    @property
    def label(self) -> str:
        p = self.event.payload
        if self.kind in ("continue", "own_continue"):
            return f"{self.kind} {p.get('cause')}"
        return f"{self.kind} {p.get('reason')}" if self.kind == "finalize" else self.kind

    @property
    def repaired(self) -> bool:
        return self.kind in ("continue", "end_answered", "drive")


def outcomes(session: Recorded) -> list[Outcome]:
    """Every interruption the log shows the outcome of, in log order."""
    events = session.events
    found = []
    for i, event in enumerate(events):
        kind = _outcome_kind(event)
        if kind is None:
            continue
        start = i
        if kind == "finalize" and i and _one_commit(events[i - 1], event):
            start = i - 1
        elif kind != "own_continue":
            while start and _repair_of(events[start - 1], event):
                start -= 1
        found.append(Outcome(kind, start, event))
    return found


def _outcome_kind(event: EventRecord) -> str | None:
    p = event.payload
    if event.type == EventType.CONTINUATION:
        return "own_continue" if p.get("cause") in OWN_CAUSES else "continue"
    if event.type != EventType.TURN_ENDED:
        return None
    if event.writer == "supervisor":
        return "finalize"
    if p.get("recovered"):
        return "end_answered"
    if p.get("outcome") == TurnOutcome.INTERRUPTED and p.get("reason") == SUPERSEDED:
        return "drive"
    return None


def _repair_of(event: EventRecord, outcome: EventRecord) -> bool:
    """`event` is a result the next owner wrote for a call that lost its own, just
    before `outcome`, under the same lease."""
    return (
        event.type == EventType.TOOL_RESULT
        and bool(event.payload.get("repaired"))
        and event.turn_id == outcome.turn_id
        and event.lease_token == outcome.lease_token
    )


def check_outcome(log: Log, session: Recorded, outcome: Outcome) -> list[str]:
    """The rules, judged when the outcome was written, give the outcome the log shows."""
    events, rows = session.events, states(session)
    prefix, state = events[: outcome.crash], rows[outcome.crash]
    event = outcome.event
    where = f"{session.log}/{session.name} seq {event.seq} ({outcome.kind})"
    problems: list[str] = []
    if state.active_turn_id != event.turn_id:
        return [f"{where}: turn {event.turn_id} is not the one in flight ({state})"]
    if outcome.kind == "own_continue":
        return check_own_continuation(log, session, outcome, where)
    # A recovery outcome the next owner wrote comes under a new lease.
    if event.writer == "worker" and (event.lease_token or 0) <= state.lease_token:
        problems.append(f"{where}: written under lease {event.lease_token}, not a new one")
    now = events[outcome.crash].created_at
    cause = _cause_of(outcome, events)
    worlds = [WORLD_OF_CAUSE[cause]] if cause in WORLD_OF_CAUSE else list(WORLDS)
    for world in worlds:
        j = judge(session, prefix, state, world, now, log.settings)
        said = j.describe(now)
        d, f = j.decision, j.facts
        if d is None or f is None:
            problems.append(f"{where}: not judged: {said}")
            continue
        if outcome.kind == "continue":
            attempt = event.payload.get("attempt")
            if d.action is not Action.CONTINUE or d.attempt != attempt:
                problems.append(f"{where}: {world} judges {said}; the log continued it ({attempt})")
            elif cause in WORLD_OF_CAUSE and d.cause != cause:
                problems.append(f"{where}: {world} continues for {d.cause}, the note says {cause}")
        elif outcome.kind == "end_answered":
            if d.action is not Action.CONTINUE or f.tail is not TailClass.ANSWERED:
                problems.append(f"{where}: {world} judges {said}; the log ended it answered")
        elif outcome.kind == "drive":
            if d.action is not Action.DRIVE_WITH_QUEUED_MESSAGE or j.step is not Step.SUPERSEDE:
                problems.append(f"{where}: {world} judges {said}; a queued message drove it")
        else:  # finalize: a notice and the turn's end, by recovery
            reason = event.payload.get("reason")
            expected = {
                "unsafe_tail": (Action.NOTICE_RESEND, False),
                "quarantined": (Action.NOTICE_RESEND, True),
                "stale": (Action.FINALIZE_STALE, False),
            }.get(str(reason))
            if expected is None or (d.action, d.quarantine) != expected:
                problems.append(f"{where}: {world} judges {said}; the log ended it ({reason})")
                continue
            told = notice(d, f, session.id)
            written = events[outcome.crash].payload
            if (told.text, told.reason) != (written.get("text"), written.get("reason")):
                problems.append(f"{where}: the notice would say {told}, the log has {written}")
    if outcome.repaired:
        problems += check_repairs(session, outcome, where)
    return problems


def _cause_of(outcome: Outcome, events: tuple[EventRecord, ...]) -> str | None:
    """The cause the outcome tells: a note's, or the one a resend notice names in words."""
    if outcome.kind == "continue":
        return str(outcome.event.payload.get("cause"))
    if outcome.kind == "finalize":
        text = str(events[outcome.crash].payload.get("text", ""))
        return next((c.value for c in Cause if f"({c.text})" in text), None)
    return None


def check_repairs(session: Recorded, outcome: Outcome, where: str) -> list[str]:
    """The results the next owner wrote for calls that lost theirs are the repairs the
    rules make of the log before the crash, in order; and a continuation that has to run
    the model again writes its note, one whose answer is committed only ends the turn."""
    prefix = session.events[: outcome.crash]
    log = SessionLog(prefix)
    turn = outcome.event.turn_id
    assert turn is not None
    if outcome.kind == "drive":  # only the superseded turn's own calls
        missing = history.missing_results(history.turn_events(log, turn))
    else:  # every call of the log: a chat API rejects one unanswered anywhere
        missing = log.missing_results()
    wanted = [m.payload() for m in missing]
    written = [e.payload for e in session.events[outcome.crash : outcome.event.seq - 1]]
    problems = []
    if written != wanted:
        problems.append(f"{where}: repaired {written}, the rules repair {wanted}")
    if outcome.kind in ("continue", "end_answered"):
        own = history.missing_results(history.turn_events(log, turn))
        tail = Resume.RUN if own else history.classify_tail(history.turn_events(log, turn))
        ends = tail is Resume.ANSWERED
        if ends != (outcome.kind == "end_answered"):
            problems.append(f"{where}: the worker would go on as {tail.value}")
    return problems


def check_own_continuation(log: Log, session: Recorded, outcome: Outcome, where: str) -> list[str]:
    """A worker continuing its own turn (a cut answer, a model error that may pass): the
    rules of `supervisor.core.continuation` say it goes on, as the attempt it names,
    within the attempts, no earlier than the schedule allows, under the same lease."""
    events, rows = session.events, states(session)
    note, prefix, state = outcome.event, events[: outcome.crash], rows[outcome.crash]
    turn = note.turn_id
    assert turn is not None
    delays = tuple(log.settings.attempt_delays)
    own = history.turn_events(prefix, turn)
    cause = Cause(str(note.payload.get("cause")))
    outcome_ = TurnOutcome.TRUNCATED if cause is Cause.MAX_TOKENS else TurnOutcome.FAILED
    problems = []
    if continuation.cause_of(outcome_, cause is Cause.MODEL_ERROR) is not cause:
        problems.append(f"{where}: a turn ending {outcome_} is not continued for {cause}")
    if not continuation.goes_on(cause, resume_from(own)):
        problems.append(f"{where}: its tail ({resume_from(own).value}) does not go on")
    attempt = continuation.attempts_charged(state, turn) + 1
    if note.payload.get("attempt") != attempt or attempt > len(delays):
        problems.append(f"{where}: attempt {note.payload.get('attempt')}, the rules {attempt}")
    # The run that came to the cut started after the newest of these was committed, so
    # the due time it gave is no earlier than this one.
    runs = [e for e in own if e.type in (EventType.TURN_STARTED, EventType.CONTINUATION)]
    due = recovery.next_attempt_at(attempt - 1, runs[-1].created_at, delays)
    if due is None or note.created_at < due:
        problems.append(f"{where}: written at {note.created_at}, due at {due}")
    if note.lease_token != prefix[-1].lease_token:
        problems.append(f"{where}: its own continuation under another lease")
    return problems


def check_spent(log: Log, session: Recorded) -> list[str]:
    """A turn its worker ended cut or failed after continuing it (`attempts` in its
    `turn_ended`) had spent every attempt the schedule allows, no more."""
    rows, delays = states(session), len(log.settings.attempt_delays)
    problems = []
    for k, event in enumerate(session.events):
        spent = event.payload.get("attempts")
        if event.type != EventType.TURN_ENDED or spent is None:
            continue
        charged = continuation.attempts_charged(rows[k], event.turn_id)
        if not spent == charged == delays:
            problems.append(
                f"{session.name} seq {event.seq}: ended after {spent} attempts, {charged} "
                f"charged, {delays} allowed"
            )
    return problems


# --- the history the worker rebuilds --------------------------------------------------


def roles(messages: list[Message]) -> str:
    """The shape of a conversation: u(ser), a(ssistant) with its call count, t(ool), n(ote)."""
    out = []
    for m in messages:
        if m.note:
            out.append("n")
        elif m.role == "assistant" and m.tool_calls:
            out.append(f"a{len(m.tool_calls)}")
        else:
            out.append(m.role[0])
    return " ".join(out)


def malformed(messages: list[Message]) -> list[str]:
    """What a chat model's API would refuse in `messages`: a tool call not answered
    right after the message that asked for it, a result of no call asked just before, a
    conversation that opens with the assistant, two assistant messages in a row."""
    problems = []
    if messages and messages[0].role != "user":
        problems.append(f"opens with {messages[0].role}")
    open_calls: set[str] = set()
    previous: Message | None = None
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                problems.append(f"#{i}: a result of no open call ({m.tool_call_id})")
            open_calls.discard(m.tool_call_id or "")
        else:
            if open_calls:
                problems.append(f"#{i}: {m.role} before the results of {sorted(open_calls)}")
                open_calls = set()
            if m.role == "assistant":
                if previous is not None and previous.role == "assistant":
                    problems.append(f"#{i}: two assistant messages in a row")
                open_calls = {c.id for c in m.tool_calls}
                if len(open_calls) != len(m.tool_calls):
                    problems.append(f"#{i}: a call id asked twice")
        previous = m
    if open_calls:
        problems.append(f"ends with calls unanswered: {sorted(open_calls)}")
    return problems


def check_continuation_history(
    session: Recorded, prefix: tuple[EventRecord, ...], turn: str, where: str
) -> None:
    """What a continuation of `turn` after a crash at the end of `prefix` sends the
    model, built as `workers.turns.resume_turn` builds it: the calls that lost their
    results repaired, what the turn read, then the note. Well formed, and the same from
    the worker's incremental log as from the plain function."""
    log = SessionLog(prefix)
    repaired = [
        EventRecord(session.id, prefix[-1].seq + 1 + n, "tool_result", turn, m.payload(), 0.0, "")
        for n, m in enumerate(log.missing_results())
    ]
    this_turn = history.turn_events(log, turn)
    if not history.missing_results(this_turn) and (
        history.classify_tail(this_turn) is Resume.ANSWERED
    ):
        return  # answered: the turn is only ended, no model call
    note = Message("user", "[turnkeeper] continue", note=True)
    sent = [*log.messages(repaired, turn), note]
    plain = [*history.to_messages(history.read_by(turn, [*prefix, *repaired])), note]
    assert sent == plain, f"{where}: the worker's log and the plain history differ"
    problems = malformed(sent)
    assert not problems, f"{where}: a continuation would send {roles(sent)}: {problems}"


# --- the tests ------------------------------------------------------------------------


def test_the_logs_are_recorded_and_cover_the_scenarios() -> None:
    """The recordings hold what these tests are for: a worker killed mid-turn and its
    turn continued, a daemon killed and its turns continued after the restart, a tool
    call in flight at a kill, a resend notice, a queued message driving the next turn,
    and a multi-turn session with no fault."""
    assert LOG_FILES, f"no recorded log in {LOGS.name}/: see record.py"
    kinds: Counter[str] = Counter()
    for path in LOG_FILES:
        for session in load(path).sessions:
            found = outcomes(session)
            for outcome in found:
                kinds[outcome.label] += 1
                if outcome.crash < outcome.event.seq - 1 and outcome.kind != "finalize":
                    kinds["repaired tool call"] += 1
            ended = [e for e in session.events if e.type == EventType.TURN_ENDED]
            if len(ended) >= 3 and all(o.kind == "own_continue" for o in found):
                kinds["multi-turn, no fault"] += 1
    for wanted in (
        "continue worker_crash",
        "continue daemon_restart",
        "repaired tool call",
        "finalize unsafe_tail",
        "drive",
        "own_continue max_tokens",
        "multi-turn, no fault",
    ):
        assert kinds[wanted], f"no recorded log shows {wanted!r}: {dict(kinds)}"


@logs_param()
def test_the_log_replays_to_the_recorded_session_row(path: Path) -> None:
    """The event log's reducer, fed the log, ends where the recorded row ended, and the
    log's seqs are contiguous from 1."""
    for session in load(path).sessions:
        assert [e.seq for e in session.events] == list(range(1, len(session.events) + 1))
        final = states(session)[-1]
        row = session.row
        got = {
            "status": final.status,
            "last_seq": final.last_seq,
            "pending": final.pending,
            "active_turn_id": final.active_turn_id,
            "attempt_turn_id": final.attempt_turn_id,
            "attempt_count": final.attempt_count,
            "resend_requested": final.resend_requested,
        }
        assert got == {k: row[k] for k in got}, session.name


@logs_param()
def test_every_interruption_gets_the_decision_the_log_shows_next(path: Path) -> None:
    """Judged when it was, in the world its cause names, each interruption the log shows
    the outcome of gets that outcome from the rules, and only one outcome."""
    log = load(path)
    problems = []
    for session in log.sessions:
        found = outcomes(session)
        crashes = Counter((o.event.turn_id, o.crash) for o in found)
        problems += [f"{session.name}: {n} outcomes after {c}" for c, n in crashes.items() if n > 1]
        for outcome in found:
            problems += check_outcome(log, session, outcome)
        problems += check_spent(log, session)
    assert not problems, "\n".join(problems)


@logs_param()
def test_a_turn_that_ended_is_never_continued(path: Path) -> None:
    """In the log, nothing of a turn comes after its `turn_ended`; and judged from a stale
    row that still names it, at any point after its end, in either world, an ended turn
    is never continued nor superseded."""
    log = load(path)
    for session in log.sessions:
        rows = states(session)
        ended: dict[str, int] = {}
        for k, event in enumerate(session.events, start=1):
            turn = event.turn_id
            if turn in ended:
                pytest.fail(f"{session.name}: {event.type} of turn {turn} after its end")
            if event.type == EventType.TURN_ENDED and turn is not None:
                ended[turn] = k
            for stale, since in ended.items():
                prefix = session.events[:k]
                now = prefix[-1].created_at + AFTER
                for world in WORLDS:
                    j = judge(session, prefix, rows[k], world, now, log.settings, turn=stale)
                    assert j.decision is not None, j
                    assert j.decision.action not in (
                        Action.CONTINUE,
                        Action.DRIVE_WITH_QUEUED_MESSAGE,
                    ), f"{session.name}: turn {stale}, ended at {since}, judged {j.describe(now)}"
                    assert j.decision.action is Action.SKIP, j.describe(now)


@logs_param()
def test_the_rebuilt_history_is_well_formed(path: Path) -> None:
    """The conversation the worker rebuilds from the whole log is one a chat model takes,
    every call of a session at rest has its result, and the worker's incremental log,
    fed one event at a time, agrees with the plain rebuild at every prefix."""
    for session in load(path).sessions:
        events = session.events
        messages = history.to_messages(events)
        assert not malformed(messages), (session.name, roles(messages), malformed(messages))
        if not (states(session)[-1].active_turn_id or session.row["pending"]):
            assert history.missing_results(events) == [], session.name
        grown = SessionLog()
        for k, event in enumerate(events, start=1):
            assert grown.add([event])
            assert grown.messages() == history.to_messages(events[:k]), (session.name, k)
            assert grown.missing_results() == history.missing_results(events[:k])


@logs_param()
def test_the_judgements_are_the_recorded_ones(path: Path) -> None:
    """Every crash point of the log judged as when it was recorded (the determinism
    check): a rule change that alters a decision fails here with the diff.
    TURNKEEPER_REPLAY_UPDATE=1 writes the expectations anew instead."""
    log = load(path)
    got = judgements(log)
    text = json.dumps(got, indent=1, ensure_ascii=False) + "\n"
    expected_path = log.expected_path
    if UPDATE:
        expected_path.write_text(text)
        return
    if not expected_path.exists():
        pytest.fail(
            f"{expected_path.name} is missing: run with TURNKEEPER_REPLAY_UPDATE=1 to write "
            "it, and review it"
        )
    expected = expected_path.read_text()
    if expected != text:
        diff = difflib.unified_diff(
            expected.splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"{expected_path.name} (recorded)",
            f"{expected_path.name} (the rules now)",
        )
        pytest.fail(
            "the rules judge a recorded log differently (TURNKEEPER_REPLAY_UPDATE=1 rewrites "
            "the expectations, if that is meant):\n" + "".join(diff),
            pytrace=False,
        )
