"""Auto-continue: what recovery does with a session's turn, decided from looked-up facts.

Pure code: no database, no clock, no logging. The caller looks the facts up (the session
row, its lease, the tail of its event log), passes them in with the time and the
breaker's state, carries out the `Decision` it gets back and logs its reason.

Rules
-----
- Interrupted is a lookup, not a guess from the history: the session has a turn in flight
  (`active_turn_id`, no `turn_ended` for it) and its owner's lease is not live. A live
  lease of another host is that host's turn; a live lease of ours is a turn still running.
  The tail class decides only how to go on.
- Attempts: at most `MAX_ATTEMPTS` (3) continuation attempts per interrupted turn: the
  first at once, the second 5 s after the first started, the third 30 s after the second
  (`ATTEMPT_DELAYS`, the default of `recovery.attempt_delays`). `attempts` counts the
  continuation attempts already charged for the turn; the turn's own first run is not one
  of them. The caller charges an attempt in the database before it starts; the store
  clears the charge when the turn ends. When the third has failed, the user gets a notice
  asking to resend and the session is quarantined: never left silent. A worker that
  continues its own turn (a cut answer, a model error that may pass) charges the same
  attempts (`supervisor.core.continuation`); one that died waiting for its attempt left a
  note followed by a charge, which is not a note to put a note on (row 11).
- Only CONTINUE charges an attempt. Everything else is free, in particular what did not
  really try: another host's lease, not interrupted, still running, a queued user message.
- Freshness: an interruption is fresh while `now - interrupted_at <= freshness`; exactly
  `freshness` seconds old is still continued, anything older is finalized with a notice.
- The breaker stops only unattended triggers (BOOT_SCAN, RETRY_TIMER, AUTONOMOUS_RESUME,
  SUBAGENT_RESUME):
  they SKIP (`suppressed`) wherever they would have acted. A user's message and the first
  touch of a session still run, bounded by the attempts.
- `auto_continue = false`: recovery leaves interrupted turns alone, except that a queued
  user message still drives the next turn and spent attempts still quarantine.

Decisions: the first row that matches wins.

| #  | when                                                    | decision                   |
|----|---------------------------------------------------------|----------------------------|
| 1  | session not open (quarantined, closed)                  | SKIP                       |
| 2  | no turn in flight                                       | SKIP (not interrupted)     |
| 3  | a `turn_ended` of this turn is committed                | SKIP (already ended)       |
| 4  | lease live, held by another host                        | SKIP (that host's turn)    |
| 5  | lease live                                              | SKIP (still running)       |
| 6  | tail OPERATOR_INTERRUPT or ENDED_IN_ERROR               | SKIP (terminal)            |
| 7  | breaker tripped, unattended trigger                     | SKIP (suppressed)          |
| 8  | attempts >= MAX_ATTEMPTS                                | NOTICE_RESEND + quarantine |
| 9  | a user message is queued after the turn                 | DRIVE_WITH_QUEUED_MESSAGE  |
| 10 | auto_continue off                                       | SKIP                       |
| 11 | tail LAST_IS_CONTINUATION_NOTE                          | NOTICE_RESEND (unsafe)     |
| 12 | now - interrupted_at > freshness                        | FINALIZE_STALE             |
| 13 | attempts > 0 and the next attempt is not due            | CONTINUE_AT(due)           |
| 14 | a continuable tail                                      | CONTINUE (charged)         |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol

from supervisor.core.continuation import attempts_charged, charged_after_note
from supervisor.core.tail import (
    CONTINUABLE_TAILS,
    ENDED_TAILS,
    UNSAFE_TAILS,
    TailClass,
    TailEvent,
    classify_tail,
)

# The attempt schedule: delay before continuation attempt n+1, from the start of attempt n.
ATTEMPT_DELAYS: tuple[float, ...] = (0.0, 5.0, 30.0)
MAX_ATTEMPTS = len(ATTEMPT_DELAYS)


class Trigger(Enum):
    """What asked recovery to look at a session."""

    FIRST_TOUCH = "first_touch"  # a request touched the session (lazy resume)
    USER_MESSAGE = "user_message"  # the user sent the session a message
    WORKER_DEATH = "worker_death"  # its worker died during this boot (crash, OOM, hang)
    BOOT_SCAN = "boot_scan"  # the bounded scan for sessions nobody touches
    RETRY_TIMER = "retry_timer"  # the periodic pass for attempts that failed transiently
    AUTONOMOUS_RESUME = "autonomous_resume"  # an autonomous run resuming by itself
    SUBAGENT_RESUME = "subagent_resume"  # the subagents' own pass picked an interrupted child

    @property
    def unattended(self) -> bool:
        """True when no user is waiting: work that the breaker suppresses."""
        return self in UNATTENDED


UNATTENDED = frozenset(
    {Trigger.BOOT_SCAN, Trigger.RETRY_TIMER, Trigger.AUTONOMOUS_RESUME, Trigger.SUBAGENT_RESUME}
)


class Action(Enum):
    """What the caller does with the session."""

    CONTINUE = "continue"  # charge an attempt, write a continuation note with the cause, run
    CONTINUE_AT = "continue_at"  # the next attempt is not due yet; look again at `at`
    DRIVE_WITH_QUEUED_MESSAGE = "drive_with_queued_message"  # that message runs the next turn
    FINALIZE_STALE = "finalize_stale"  # too old to continue: end the turn with a notice
    NOTICE_RESEND = "notice_resend"  # end the turn, ask the user to resend, mark the session
    SKIP = "skip"  # nothing to do


@dataclass(frozen=True)
class Interruption:
    """The facts about one session's turn that recovery decides from."""

    active_turn_id: str | None  # the turn in flight by the session row; None: none
    tail: TailClass  # the classified tail; looked at only once the turn is interrupted
    interrupted_at: float  # when the turn's last event was committed
    status: str = "open"  # the session's status: "open", "quarantined", "closed"
    lease_live: bool = False  # the session's lease has not expired
    lease_other_host: bool = False  # the lease is held by another turnkeeper host
    ended_outcome: str | None = None  # outcome of a `turn_ended` of this turn, if committed
    queued_user_message: bool = False  # a user message was committed after the turn began
    attempts: int = 0  # continuation attempts already charged for this turn
    last_attempt_at: float | None = None  # when the latest of those started
    cause: str = "daemon_restart"  # why it stopped, for the note: worker_crash, max_tokens, ...

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"attempts cannot be negative: {self.attempts}")


class RecoverySettings(Protocol):
    """The settings `decide` reads; `supervisor.contract.config.RecoveryConfig` is one."""

    @property
    def auto_continue(self) -> bool:
        """Whether interrupted turns are continued at all."""

    @property
    def freshness(self) -> float:
        """Seconds after which an interruption is finalized instead of continued."""

    @property
    def attempt_delays(self) -> tuple[float, ...]:
        """The attempt schedule; its length is the number of attempts (`ATTEMPT_DELAYS`)."""


@dataclass(frozen=True)
class Decision:
    """What to do with one session, and why (the reason is for the log)."""

    action: Action
    reason: str
    at: float | None = None  # CONTINUE_AT: when the next attempt is due
    quarantine: bool = False  # NOTICE_RESEND after the last attempt failed
    suppressed: bool = False  # SKIP because the breaker is tripped; log it once
    cause: str | None = None  # CONTINUE: the cause the continuation note tells
    attempt: int | None = None  # CONTINUE: which attempt this is, 1 to MAX_ATTEMPTS

    @property
    def charged(self) -> bool:
        """True when the caller must charge a turn attempt before acting."""
        return self.action is Action.CONTINUE


def next_attempt_at(
    attempts: int, since: float, delays: tuple[float, ...] = ATTEMPT_DELAYS
) -> float | None:
    """When attempt `attempts + 1` may start, given the previous one started at `since`.

    None when all attempts are spent.
    """
    if attempts < 0:
        raise ValueError(f"attempts cannot be negative: {attempts}")
    if attempts >= len(delays):
        return None
    return since + delays[attempts]


@dataclass(frozen=True)
class _Case:
    facts: Interruption
    trigger: Trigger
    now: float
    breaker_tripped: bool
    settings: RecoverySettings

    @property
    def age(self) -> float:
        return self.now - self.facts.interrupted_at

    @property
    def due_at(self) -> float | None:
        # Without a recorded start, the last committed event stands in for it.
        since = self.facts.last_attempt_at
        return next_attempt_at(
            self.facts.attempts,
            self.facts.interrupted_at if since is None else since,
            tuple(self.settings.attempt_delays),
        )

    @property
    def max_attempts(self) -> int:
        return len(self.settings.attempt_delays)

    def not_due(self) -> bool:
        due = self.due_at
        return self.facts.attempts > 0 and due is not None and self.now < due

    def fields(self) -> dict[str, Any]:
        f = self.facts
        due = self.due_at
        return {
            "status": f.status,
            "outcome": f.ended_outcome,
            "tail": f.tail.value,
            "trigger": self.trigger.value,
            "attempts": f.attempts,
            "attempt": f.attempts + 1,
            "max": self.max_attempts,
            "age": self.age,
            "freshness": self.settings.freshness,
            "due_in": 0.0 if due is None else due - self.now,
            "cause": f.cause,
        }


class _Rule(NamedTuple):
    when: Callable[[_Case], bool]
    action: Action
    reason: str  # formatted with `_Case.fields()`
    quarantine: bool = False
    suppressed: bool = False


_RULES: tuple[_Rule, ...] = (
    _Rule(lambda c: c.facts.status != "open", Action.SKIP, "session is {status}"),
    _Rule(
        lambda c: c.facts.active_turn_id is None, Action.SKIP, "not interrupted: no turn in flight"
    ),
    _Rule(
        lambda c: c.facts.ended_outcome is not None, Action.SKIP, "turn already ended ({outcome})"
    ),
    _Rule(
        lambda c: c.facts.lease_live and c.facts.lease_other_host,
        Action.SKIP,
        "leased by another host",
    ),
    _Rule(lambda c: c.facts.lease_live, Action.SKIP, "turn still running: its lease is live"),
    _Rule(
        lambda c: c.facts.tail in ENDED_TAILS,
        Action.SKIP,
        "terminal tail ({tail}): never continued",
    ),
    _Rule(
        lambda c: c.breaker_tripped and c.trigger.unattended,
        Action.SKIP,
        "breaker tripped: {trigger} suppressed",
        suppressed=True,
    ),
    _Rule(
        lambda c: c.facts.attempts >= c.max_attempts,
        Action.NOTICE_RESEND,
        "{attempts} attempts failed: asking the user to resend, quarantining",
        quarantine=True,
    ),
    _Rule(
        lambda c: c.facts.queued_user_message,
        Action.DRIVE_WITH_QUEUED_MESSAGE,
        "a queued user message drives the next turn",
    ),
    _Rule(lambda c: not c.settings.auto_continue, Action.SKIP, "auto_continue is off"),
    _Rule(
        lambda c: c.facts.tail in UNSAFE_TAILS,
        Action.NOTICE_RESEND,
        "unsafe tail ({tail}): asking the user to resend",
    ),
    _Rule(
        lambda c: c.age > c.settings.freshness,
        Action.FINALIZE_STALE,
        "interrupted {age:.0f} s ago, older than freshness {freshness:g} s",
    ),
    _Rule(_Case.not_due, Action.CONTINUE_AT, "attempt {attempt} of {max} is due in {due_in:.1f} s"),
    _Rule(
        lambda c: c.facts.tail in CONTINUABLE_TAILS,
        Action.CONTINUE,
        "continuing ({tail}, {cause}): attempt {attempt} of {max}",
    ),
)


def decide(
    facts: Interruption,
    trigger: Trigger,
    now: float,
    breaker_tripped: bool,
    settings: RecoverySettings,
) -> Decision:
    """What recovery does with this session now: the first matching row of the table."""
    case = _Case(facts, trigger, now, breaker_tripped, settings)
    for rule in _RULES:
        if not rule.when(case):
            continue
        return Decision(
            action=rule.action,
            reason=rule.reason.format(**case.fields()),
            at=case.due_at if rule.action is Action.CONTINUE_AT else None,
            quarantine=rule.quarantine,
            suppressed=rule.suppressed,
            cause=facts.cause if rule.action is Action.CONTINUE else None,
            attempt=facts.attempts + 1 if rule.action is Action.CONTINUE else None,
        )
    raise AssertionError(f"no recovery rule matched {facts}")  # every tail class has a row


def boot_scan_plan(candidates: Iterable[tuple[str, float]], max_per_pass: int) -> list[str]:
    """The sessions a scan continues: oldest interruption first, at most `max_per_pass`.

    `candidates` are (session_id, interrupted_at) of the sessions the scan would continue.
    The caller writes the plan to the boot row's `attempted` list before starting any; if
    that write fails, the scan does not run.
    """
    if max_per_pass < 0:
        raise ValueError(f"max_per_pass cannot be negative: {max_per_pass}")
    plan: list[str] = []
    seen: set[str] = set()
    for session_id, _ in sorted(candidates, key=lambda c: (c[1], c[0])):
        if len(plan) >= max_per_pass:
            break
        if session_id not in seen:
            seen.add(session_id)
            plan.append(session_id)
    return plan


class StampedEvent(TailEvent, Protocol):
    """An event with the time it was committed (a `supervisor.store.EventRecord`)."""

    @property
    def created_at(self) -> float: ...


def interruption(
    row: Any,
    events: Sequence[StampedEvent],
    trigger: Trigger,
    now: float,
    *,
    host_prefix: str,
    last_attempt_at: float | None,
    died: bool,
) -> Interruption:
    """The facts `decide` reads, from a session row (`SessionInfo`) and its latest events.

    `last_attempt_at` is when this boot last charged an attempt at the turn; `died` that
    the session's worker died during this boot (not only its lease ran out).
    """
    turn = row.active_turn_id
    tail = classify_tail(events, turn) if turn else TailClass.ANSWERED
    own = [e for e in events if e.turn_id == turn]
    last = own[-1] if own else (events[-1] if events else None)
    notes = [e.created_at for e in own if e.type == "continuation"]
    started = [t for t in (last_attempt_at, *notes) if t]
    attempts = attempts_charged(row, turn)
    if tail is TailClass.LAST_IS_CONTINUATION_NOTE and charged_after_note(own, attempts):
        # Its worker charged the next attempt and died waiting: the turn stands as it did.
        tail = classify_tail([e for e in events if e.type != "continuation"], turn)
    lease_expired = row.lease_expires_at is not None and row.lease_expires_at < now
    other_host = bool(row.owner) and not str(row.owner).startswith(host_prefix)
    return Interruption(
        active_turn_id=turn,
        tail=tail,
        interrupted_at=last.created_at if last else row.updated_at,
        status=row.status,
        lease_live=other_host and not lease_expired,
        lease_other_host=other_host,
        queued_user_message=row.pending,
        attempts=attempts,
        last_attempt_at=max(started) if started else None,
        cause=cause_of(tail, trigger, lease_expired and not died, other_host=other_host),
    )


def cause_of(
    tail: TailClass, trigger: Trigger, lease_expired: bool, *, other_host: bool = False
) -> str:
    """What the continuation note tells as the cause of the interruption."""
    if tail is TailClass.CUT_BY_MAX_TOKENS:
        return "max_tokens"
    if other_host:
        return "host_lost"  # its lease was another daemon's, which stopped renewing it
    if trigger is Trigger.WORKER_DEATH:
        return "lease_expired" if lease_expired else "worker_crash"
    return "daemon_restart"
