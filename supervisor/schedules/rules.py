"""When a schedule fires, decided over plain data: its times, the newest one decided, now.

Pure code: the scheduler (`supervisor.schedules.service`) reads a schedule's due times
(`Times`, which `supervisor.contract.cron.Cron` is) and its newest fire row, hands them to
`decide` with the time, and carries out the fires it gets back: each committed as a row
keyed by (schedule, scheduled time) before its message is injected, so a time fires once
whatever crashes, restarts or other daemons do.

Rules
-----
- `since` is the newest time already decided (a fire row: fired, caught up or skipped),
  or, before the first, the moment the schedule was armed (its creation): no time at or
  before it fires. Due are the times in (since, now].
- A due time is missed when no daemon was up at it, or it came more than `LATE` seconds
  ago (the database or the loop held the scheduler up); the others are on time. A daemon
  was up at a time when this scheduler had started by then, or when another registered
  daemon (`Facts.up`, from the hosts table: `up_span`) had started by then and renewed
  its row after it (or, still live, at most `RENEWED` seconds before it: it renews every
  second). So a daemon that boots just after a time another one was up for does not
  judge it missed (and skip it) before that one fires it. A time before a missed one is
  missed too: times are decided in order, the missed ones coalesce.
- On time: each fires (`fired`), oldest first.
- Missed, misfire `run_once`: the newest missed time fires once (`caught_up`) if it is no
  older than `misfire_grace`; the older ones are skipped. Past the grace, or misfire
  `skip`: none runs, and the newest missed time is recorded as `skipped`, so that the
  decision is made once, by one daemon.
- Each decision says why (for the log); each time is counted by its outcome, the skipped
  ones that get no row of their own too (at most `MAX_MISSED` of them are counted).
- A fire's message carries the schedule and the scheduled time; its idempotency key is
  derived from both (`idempotency_key`), so injecting it again appends nothing.
- A fire committed but not injected (its daemon died in between) is owed: a booting
  daemon finishes every owed fire at once, and each daemon, on its passes, those at
  least `OWED_AGE` seconds old on the database clock (not a live daemon's injection in
  flight; were it raced, the key above, or for a new session the fire row's lock, keeps
  it to one message).
- A schedule's times are at least `schedules.min_interval` apart, checked when it is made:
  the shortest gap between two consecutive of its next `GAP_SAMPLE` times (`shortest_gap`).
  Sustained frequency is what costs (a turn, and maybe a session, per time); a shorter gap
  further out than the sample is rare by construction. With 5 fields every gap is at
  least 60 s; with 6, two seconds in one minute are under 60 s apart and show at once.
- A turn of a session of kind `scheduled` is never continued: interrupted (`interruption`),
  it ends with a notice (`INTERRUPTED_NOTICE`), and the schedule's next fire runs on time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any, Protocol

from supervisor.core.vocabulary import Cause, FireOutcome, Misfire

LATE = 60.0  # seconds past its time that a time the scheduler was up for is still on time
MAX_MISSED = 10_000  # missed times counted at most, newest first (older: "at least")
OWED_AGE = 10.0  # seconds a committed fire waits for its own daemon before any finishes it
RENEWED = 3.0  # seconds past its last renewal a live daemon counts as up (it renews every 1 s)
GAP_SAMPLE = 200  # next times of a new schedule whose gaps are checked against min_interval
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
    up: tuple[tuple[float, float], ...] = ()  # when other daemons were up (`up_span`)


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


def up_span(started_at: float, last_seen: float, live: bool) -> tuple[float, float]:
    """When a registered daemon (a hosts row, on the database clock) was surely up: from
    its start to its last renewal, or `RENEWED` past it while it is live (a crashed one
    looks live until its row runs out: this bounds what it is believed for)."""
    return started_at, last_seen + (RENEWED if live else 0.0)


def was_up(moment: float, facts: Facts) -> bool:
    """Whether a daemon was up at `moment`: this scheduler, or another (`Facts.up`)."""
    return moment >= facts.started or any(a <= moment <= b for a, b in facts.up)


def decide(newest_first: Sequence[float], more: bool, facts: Facts) -> list[Fire]:
    """What to record for the due times (`due`), oldest first (see the module's rules)."""
    late = facts.now - LATE
    split = next(
        (i for i, t in enumerate(newest_first) if t < late or not was_up(t, facts)),
        len(newest_first),
    )
    on_time, missed = newest_first[:split], newest_first[split:]
    fires = [Fire(t, FireOutcome.FIRED, "on time") for t in reversed(on_time)]
    if not missed:
        return fires
    newest = missed[0]
    older = len(missed) - 1
    count = f"{'at least ' if more else ''}{len(missed)} time{'' if len(missed) == 1 else 's'}"
    why = (
        f"the scheduler was held up over {LATE:g} s"
        if was_up(newest, facts)
        else "while no daemon ran"
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


def shortest_gap(times: Sequence[float]) -> float | None:
    """The shortest gap between two consecutive `times` (ascending); None for fewer than 2."""
    return min((b - a for a, b in pairwise(times)), default=None)


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
