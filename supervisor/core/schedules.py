"""When a schedule fires, decided over plain data: its times, the newest one decided, now.

Pure code: the scheduler (`supervisor.pool.scheduler`) reads a schedule's due times
(`Times`, which `supervisor.contract.cron.Cron` is) and its newest fire row, hands them to
`decide` with the time, and carries out the fires it gets back: each committed as a row
keyed by (schedule, scheduled time) before its message is injected, so a time fires once
whatever crashes, restarts or other daemons do.

Rules
-----
- `since` is the newest time already decided (a fire row: fired, caught up or skipped),
  or, before the first, the moment the schedule was armed (its creation): no time at or
  before it fires. Due are the times in (since, now].
- A due time is missed when it came before the scheduler started (no daemon ran, or none
  fired it), or more than `LATE` seconds ago (the database or the loop held the scheduler
  up); the later ones are on time.
- On time: each fires (`fired`), oldest first.
- Missed, misfire `run_once`: the newest missed time fires once (`caught_up`) if it is no
  older than `misfire_grace`; the older ones are skipped. Past the grace, or misfire
  `skip`: none runs, and the newest missed time is recorded as `skipped`, so that the
  decision is made once, by one daemon.
- Each decision says why (for the log); each time is counted by its outcome, the skipped
  ones that get no row of their own too (at most `MAX_MISSED` of them are counted).
- A fire's message carries the schedule and the scheduled time; its idempotency key is
  derived from both (`idempotency_key`), so injecting it again appends nothing.
- A turn of a session of kind `scheduled` is never continued: interrupted (`interruption`),
  it ends with a notice (`INTERRUPTED_NOTICE`), and the schedule's next fire runs on time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from supervisor.core.vocabulary import Cause, FireOutcome, Misfire

LATE = 60.0  # seconds past its time that a time the scheduler was up for is still on time
MAX_MISSED = 10_000  # missed times counted at most, newest first (older: "at least")
RELEASED_GRACE = 10.0  # seconds a released turn (no owner) waits before it counts as left
NOT_CONTINUED = "not_continued"  # the reason of the notice and turn_ended that end one
INTERRUPTED_NOTICE = (
    "This scheduled run was interrupted ({cause}). A scheduled turn is never continued: "
    "it ended here, and the schedule's next run starts on time."
)


class Times(Protocol):
    """A schedule's times (`supervisor.contract.cron.Cron` is one)."""

    def after(self, moment: float) -> float | None:
        """The first time strictly after `moment`; None if there is none."""
        ...

    def back(self, upto: float, since: float, limit: int) -> tuple[list[float], bool]:
        """The times in (since, upto], newest first, at most `limit`; and whether older
        ones were left out."""
        ...


@dataclass(frozen=True)
class Facts:
    """What `decide` reads of a schedule and of the scheduler."""

    since: float  # the newest time decided, or when the schedule was armed
    started: float  # when this scheduler started watching (this daemon's boot)
    now: float
    misfire: Misfire = Misfire.RUN_ONCE
    grace: float = 3600.0  # schedules.misfire_grace


@dataclass(frozen=True)
class Fire:
    """One time to record, with its outcome and why."""

    scheduled_for: float
    outcome: FireOutcome
    reason: str
    passed_over: int = 0  # older missed times this decision skips without a row of their own

    @property
    def injected(self) -> bool:
        """Whether its message goes to a session (every outcome but `skipped`)."""
        return self.outcome is not FireOutcome.SKIPPED


def misfire(value: str) -> Misfire:
    """A stored misfire policy; an unknown one (a newer daemon's) misses nothing by skip."""
    try:
        return Misfire(value)
    except ValueError:
        return Misfire.SKIP


def due(times: Times, facts: Facts) -> tuple[list[float], bool]:
    """The due times, newest first (at most MAX_MISSED), and whether more were left out."""
    return times.back(facts.now, facts.since, MAX_MISSED)


def decide(newest_first: Sequence[float], more: bool, facts: Facts) -> list[Fire]:
    """What to record for the due times (`due`), oldest first (see the module's rules)."""
    threshold = max(facts.started, facts.now - LATE)
    missed = [t for t in newest_first if t < threshold]
    on_time = sorted(t for t in newest_first if t >= threshold)
    fires = [Fire(t, FireOutcome.FIRED, "on time") for t in on_time]
    if not missed:
        return fires
    newest = missed[0]
    older = len(missed) - 1
    count = f"{'at least ' if more else ''}{len(missed)} time{'' if len(missed) == 1 else 's'}"
    why = (
        "while no daemon ran"
        if newest < facts.started
        else f"the scheduler was held up over {LATE:g} s"
    )
    head = f"missed {count} ({why}), the newest {_when(newest)}"
    age = facts.now - newest
    also = f", {older} older skipped" if older else ""
    if facts.misfire is Misfire.SKIP:
        decided = Fire(newest, FireOutcome.SKIPPED, f"{head}; misfire skip: none runs", older)
    elif age > facts.grace:
        past = f"{age:.0f} s old, past schedules.misfire_grace ({facts.grace:g} s)"
        decided = Fire(
            newest, FireOutcome.SKIPPED, f"{head}; run_once, but {past}: none runs", older
        )
    else:
        decided = Fire(newest, FireOutcome.CAUGHT_UP, f"{head}; run_once: it runs now{also}", older)
    return [decided, *fires]


def next_due(times: Times, since: float, now: float) -> float | None:
    """When the schedule is due next: its first time after both `since` and `now`."""
    return times.after(max(since, now))


def idempotency_key(schedule_id: str, scheduled_for: float) -> str:
    """The key a fire's message is injected with: one message per (schedule, time)."""
    return f"schedule:{schedule_id}:{scheduled_for:.0f}"


def message(
    schedule_id: str, text: str, owner: str, scheduled_for: float, outcome: FireOutcome
) -> dict[str, Any]:
    """The payload of a fire's `user_message`."""
    return {
        "text": text,
        "by": owner,
        "schedule": schedule_id,
        "scheduled_for": int(scheduled_for),
        "outcome": outcome.value,
    }


def interruption(
    owner: str | None,
    lease_expires_at: float | None,
    updated_at: float,
    now: float,
    *,
    host_prefix: str,
    boot_prefix: str,
) -> Cause | None:
    """Why a scheduled session's turn in flight is interrupted, if it is: nobody runs it.

    `now` is the database's time; `host_prefix` is "<host>/", `boot_prefix` this boot's
    "<host>/<boot8>" (the start of its workers' lease owners).
    """
    if owner is None:
        # Released (a stop): a moment's grace for a handoff to its next worker.
        return Cause.INTERRUPTED if now - updated_at > RELEASED_GRACE else None
    if owner.startswith(host_prefix) and not owner.startswith(boot_prefix + "/"):
        return Cause.DAEMON_RESTART  # an earlier boot of this host: its workers are gone
    if lease_expires_at is not None and lease_expires_at >= now:
        return None  # its owner still renews the lease: the turn runs
    return Cause.LEASE_EXPIRED if owner.startswith(host_prefix) else Cause.HOST_LOST


def interrupted_notice(cause: Cause) -> str:
    """The notice that ends an interrupted scheduled turn."""
    return INTERRUPTED_NOTICE.format(cause=cause.text)


def _when(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
