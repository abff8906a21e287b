"""Subagents: the rules of a child run, from its spawn to the one result its parent gets.

Pure code: no database, no clock, no logging. The store (`supervisor.store.subagents`)
reads the facts and writes what these functions decide; the pool's reconciler
(`supervisor.subagents.service`) and recovery carry the decisions out.

Rules
-----
- A spawn is refused (the model reads why, as the tool's error result) when the child
  would be deeper than `subagents.max_depth` (a top session's children are at depth 1),
  or when the parent has `subagents.max_children` children running already.
- A child's run has ended when its session has no turn in flight, no pending input and
  no subagent of its own running, or when its session is no longer open (its running
  subagents are then cancelled with it). Its outcome (`outcome`) is read from its last
  `turn_ended` and the final answer of that turn.
- Every child gets exactly one `subagent_result` in its parent: the result event and the
  registry row's final state are written in one transaction, and only while the row is
  still `running`.
- A running registry row is reconciled (`reconcile`), by the daemon that holds its claim:

| #  | the child session                                       | step                    |
|----|---------------------------------------------------------|-------------------------|
| 1  | gone (no row)                                           | REPORT (failed)         |
| 2  | not open (closed, quarantined)                          | REPORT                  |
| 3  | a turn in flight                                        | RECOVER (recovery's)    |
| 4  | pending input, no turn                                  | WAIT (the pool runs it) |
| 5  | idle, with subagents of its own running                 | WAIT (their results     |
|    |                                                         | make it pending)        |
| 6  | idle                                                    | REPORT                  |

- Recovery of a child's interrupted turn is recovery's table (`supervisor.core.recovery`)
  with the subagent settings (`Settings`): `subagents.freshness` and
  `subagents.max_recoveries` attempts; its own pass (trigger `subagent_resume`, which the
  breaker suppresses like any unattended work) with its own cap per pass
  (`subagents.max_per_boot`). What recovery would finalize or quarantine ends the child
  (`final_status`): stale -> `finalized`, attempts spent -> `wedged` (never picked again),
  an unsafe tail -> `failed`.
- With `recovery.auto_continue` off, an interrupted child that recovery would have
  continued ends `failed` instead (`decide`): nobody resumes it by hand, and its parent
  must not wait for it for ever.
- A child's turn whose last event is a continuation note (it died again before its
  continuation got anywhere) is continued once more (`decide`), where a session's would
  end with a notice asking the user to resend: there is no user to resend a child's task,
  and its attempts (`subagents.max_recoveries`) still bound it, then it is `wedged`.
- A cancelled child (its parent interrupted or closed) is reported without waking the
  parent: an operator who stopped it did not ask for another turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from supervisor.core import recovery
from supervisor.core.recovery import Action, Decision, Interruption, Trigger
from supervisor.core.tail import TailClass, TailEvent
from supervisor.core.vocabulary import EventType, SessionStatus, SubagentStatus, TurnOutcome

RESULT_MAX = 16_000  # characters of a child's answer given to its parent
SUMMARY_MAX = 300  # characters of it kept in the registry, for listings
TASK_MAX = 100_000  # characters of a task


class Refused(Exception):
    """A spawn the limits do not allow; the message is for the model that asked."""


def refusal(
    parent_depth: int, running_children: int, *, max_depth: int, max_children: int
) -> str | None:
    """Why a session at `parent_depth` with `running_children` may not spawn, or None."""
    if parent_depth + 1 > max_depth:
        if max_depth == 0:
            return "subagents are turned off here (subagents.max_depth = 0)"
        return (
            f"this session is at subagent depth {parent_depth}; subagents.max_depth is "
            f"{max_depth}, so it cannot start another subagent: do the task itself"
        )
    if running_children >= max_children:
        return (
            f"this session has {running_children} subagents running, the limit "
            f"(subagents.max_children) is {max_children}: wait for a result first"
        )
    return None


def tree_refusal(open_in_tree: int, max_per_root: int) -> str | None:
    """Why a tree with `open_in_tree` subagents running may not grow, or None."""
    if open_in_tree >= max_per_root:
        return (
            f"this conversation's tree has {open_in_tree} subagents running, the "
            f"limit (subagents.max_total_per_root) is {max_per_root}: do the task itself"
        )
    return None


def check_task(task: Any) -> str:
    """The task as given, or ValueError saying what is wrong with it."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError("a subagent needs a task: a non-empty string")
    if len(task) > TASK_MAX:
        raise ValueError(f"a subagent's task is at most {TASK_MAX} characters")
    if "\x00" in task:
        raise ValueError("a subagent's task may not contain NUL characters")
    return task


def outcome(session_status: str | None, events: Sequence[TailEvent]) -> tuple[SubagentStatus, str]:
    """A finished child's status and the text its parent gets, from its session's status
    and its latest events (oldest first; from its last turn's start is enough)."""
    if session_status is None:
        return SubagentStatus.FAILED, "its session no longer exists"
    if session_status == SessionStatus.QUARANTINED:
        return SubagentStatus.WEDGED, "its turn failed every time it was run"
    ended = next((e for e in reversed(events) if e.type == EventType.TURN_ENDED), None)
    if ended is None:
        if session_status == SessionStatus.CLOSED:
            return SubagentStatus.CANCELLED, "its session was closed before it ran"
        return SubagentStatus.FAILED, "it ended without running a turn"
    result = ended.payload.get("outcome")
    if result in (TurnOutcome.COMPLETED, TurnOutcome.TRUNCATED):
        answer = _answer(events, ended.turn_id)
        return SubagentStatus.COMPLETED, answer[:RESULT_MAX]
    if result == TurnOutcome.INTERRUPTED_BY_OPERATOR:
        by = ended.payload.get("by")
        return SubagentStatus.CANCELLED, f"its turn was interrupted by {by or 'an operator'}"
    why = ended.payload.get("error") or ended.payload.get("reason")
    told = f"its turn ended {result or 'without an outcome'}" + (f": {why}" if why else "")
    return SubagentStatus.FAILED, told[:RESULT_MAX]


def _answer(events: Sequence[TailEvent], turn_id: str | None) -> str:
    """The text of the turn's last model answer (its final answer)."""
    for event in reversed(events):
        if event.type == EventType.MODEL_RESPONSE and event.turn_id == turn_id:
            return str(event.payload.get("text") or "")
    return ""


class Step(Enum):
    """What the reconciler does with a running registry row."""

    REPORT = "report"  # the run is over: report its outcome to the parent
    RECOVER = "recover"  # a turn in flight: recovery judges it (if its owner is gone)
    WAIT = "wait"  # pending input: the pool runs it


@dataclass(frozen=True)
class Child:
    """The facts about a child's session that `reconcile` reads (None: no session row)."""

    status: str | None
    active_turn_id: str | None = None
    pending: bool = False
    running_children: int = 0  # its own subagents still running

    @classmethod
    def of(cls, session: Any, running_children: int = 0) -> Child:
        """The facts of a session row (`SessionInfo`, or the model's), None for no row."""
        if session is None:
            return cls(None)
        active, pending = session.active_turn_id, bool(session.pending)
        return cls(session.status, active, pending, running_children)


def reconcile(child: Child) -> Step:
    """The step for a running registry row: the table in the module docstring."""
    if child.status is None or child.status != SessionStatus.OPEN:
        return Step.REPORT
    if child.active_turn_id:
        return Step.RECOVER
    if child.pending or child.running_children:
        return Step.WAIT
    return Step.REPORT


def final_status(quarantine: bool, stale: bool) -> SubagentStatus:
    """What recovery's giving up on a child's turn makes the child (see the docstring)."""
    if quarantine:
        return SubagentStatus.WEDGED
    return SubagentStatus.FINALIZED if stale else SubagentStatus.FAILED


class Settings:
    """Recovery's settings for children (`supervisor.core.recovery.RecoverySettings`):
    `subagents.freshness`, and `subagents.max_recoveries` attempts on recovery's schedule
    (its last delay repeated when there are more attempts than delays)."""

    def __init__(
        self, auto_continue: bool, attempt_delays: Sequence[float], freshness: float, attempts: int
    ) -> None:
        delays = tuple(attempt_delays) or (0.0,)
        self.auto_continue = auto_continue
        self.freshness = freshness
        self.attempt_delays = tuple(delays[min(i, len(delays) - 1)] for i in range(attempts))


AUTO_CONTINUE_OFF = "auto_continue is off: the subagent is not resumed"


def decide(
    facts: Interruption, trigger: Trigger, now: float, breaker_tripped: bool, settings: Settings
) -> Decision:
    """Recovery's decision for a child's turn (`recovery.decide` with `settings`), except
    that a note-on-note tail is continued and what only `auto_continue = false` leaves
    alone is given up on (see the rules)."""
    if facts.tail is TailClass.LAST_IS_CONTINUATION_NOTE:
        facts = replace(facts, tail=TailClass.UNANSWERED_USER_MESSAGE)  # goes on from there
    decision = recovery.decide(facts, trigger, now, breaker_tripped, settings)
    if decision.action is not Action.SKIP or settings.auto_continue:
        return decision
    on = Settings(True, settings.attempt_delays, settings.freshness, len(settings.attempt_delays))
    would = recovery.decide(facts, trigger, now, breaker_tripped, on)
    if would.action in (Action.SKIP, Action.FINALIZE_STALE):
        return would if would.action is Action.FINALIZE_STALE else decision
    return Decision(Action.NOTICE_RESEND, AUTO_CONTINUE_OFF)


def result_text(payload: dict[str, Any]) -> str:
    """A `subagent_result` as the parent's model reads it."""
    child = str(payload.get("subagent", ""))
    status = str(payload.get("status", ""))
    title = str(payload.get("title") or "")
    about = f" ({title})" if title else ""
    text = str(payload.get("text", ""))
    return f"[subagent {child}{about} {status}] {text}"
