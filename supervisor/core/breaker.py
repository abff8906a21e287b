"""The boot breaker: whether this boot runs side work, judged from the boot log.

Pure code: no database, no clock, no logging. The caller reads this host's boot rows,
passes them in with the time (seconds, the same clock as the rows' timestamps), and logs
the `BreakerState` it gets back.

Rules
-----
- Each boot writes its `agent_boot_log` row once it holds its host id and its database
  (a start refused before that, for its configuration, its lock, a database that did not
  answer in time or another daemon on its host id, writes none). A clean stop ends it
  `clean`; a start that failed before it served (a port taken, every worker slot fatal
  before one was ready) ends it `startup_failed`.
- A boot is *unclean* when it never ended (`ended_at` None: the process died) or ended
  with any outcome but `clean` and `startup_failed` (`unclean`: a task of the supervisor
  died, or every slot went fatal while it served). A `startup_failed` boot ran no session,
  so it cannot be the crash loop the breaker guards against (a turn that kills the
  daemon): a port conflict under `Restart=always` must not trip it and hold back the
  interrupted turns once the port is free. The current boot is never counted: it has not
  ended yet because it is running.
- Window: a boot counts while `started_at + window > now`. A boot exactly `window`
  seconds old no longer counts; one a hair younger still does. There is no upper bound: a
  boot stamped after `now` (the clock stepped back) is recent, so it counts.
- Tripped: at least `threshold` unclean boots in the window (3 within 300 s by default,
  so the 4th boot in a crash loop is the first to run with the breaker tripped).
- `clears_at`: the first time at which, with no further boots, fewer than `threshold`
  unclean boots are left in the window; `evaluate` at that time is not tripped. None when
  not tripped.
- Reset (`turnkeeper breaker reset` at `reset_at`): boots started at or before `reset_at`
  no longer count. Later unclean boots can trip it again.
- The boot log could not be read (`boots is None`): the breaker fails open, not tripped,
  and the reason says so. A breaker that cannot see must not stop the daemon's work.
- Retention: rows that started more than 24 h before now are pruned (`prune_before`).
  A window longer than that could not be judged from the rows that are kept.

| boot row                                   | counts toward the threshold |
|--------------------------------------------|-----------------------------|
| ended `clean`                              | no                          |
| ended `startup_failed`                     | no                          |
| ended `unclean` (or any other outcome)     | yes                         |
| never ended, an earlier boot               | yes                         |
| the current boot                           | no                          |
| `started_at + window <= now` (left window) | no                          |
| `started_at <= reset_at`                   | no                          |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.core.vocabulary import BootOutcome

RETENTION = 24 * 3600.0  # boot rows older than this (by started_at) are pruned
# The outcomes the breaker does not count: a clean stop, and a start that never served.
NOT_UNCLEAN = frozenset({BootOutcome.CLEAN, BootOutcome.STARTUP_FAILED})


@dataclass(frozen=True)
class BootRecord:
    """One row of the boot log, as much of it as the breaker needs."""

    started_at: float
    ended_at: float | None = None  # None: never ended (died), or it is the current boot
    outcome: str | None = None  # "clean", "startup_failed", "unclean"; None if never ended
    is_current: bool = False  # the boot doing the evaluating; never counted

    @property
    def unclean(self) -> bool:
        """True when this earlier boot died or ended unclean: not `clean`, not a start that
        failed before it served (`startup_failed`); the current boot never is."""
        return not self.is_current and (self.ended_at is None or self.outcome not in NOT_UNCLEAN)


@dataclass(frozen=True)
class BreakerState:
    """What the breaker decided, with a reason to log and to show in `/v1/status`."""

    tripped: bool  # side work (boot scan, retry timer, autonomous resume) is suppressed
    unclean_in_window: int  # unclean boots that count now
    reason: str
    clears_at: float | None = None  # when it clears by itself; None when not tripped
    fails_open: bool = False  # the boot log could not be read


def prune_before(now: float) -> float:
    """The cut-off for pruning: boot rows started before this time are deleted."""
    return now - RETENTION


def evaluate(
    boots: Sequence[BootRecord] | None,
    now: float,
    threshold: int,
    window: float,
    reset_at: float | None = None,
) -> BreakerState:
    """Decide whether the breaker is tripped at `now`, from this host's boot rows.

    `boots` in any order; None means the boot log could not be read.
    """
    if threshold < 1:
        raise ValueError(f"breaker threshold must be at least 1, not {threshold}")
    if not window > 0:
        raise ValueError(f"breaker window must be positive, not {window}")
    if boots is None:
        return BreakerState(
            tripped=False,
            unclean_in_window=0,
            reason="the boot log could not be read; the breaker fails open and side work runs",
            fails_open=True,
        )
    counted = sorted(
        boot.started_at
        for boot in boots
        if boot.unclean
        and boot.started_at + window > now
        and (reset_at is None or boot.started_at > reset_at)
    )
    count = len(counted)
    since = "" if reset_at is None else " since the reset"
    summary = f"{count} unclean boot{'' if count == 1 else 's'} in the last {window:g} s{since}"
    if count < threshold:
        return BreakerState(False, count, f"{summary} (threshold {threshold})")
    # The count drops below the threshold when the (count - threshold + 1) oldest have left.
    clears_at = counted[count - threshold] + window
    return BreakerState(
        tripped=True,
        unclean_in_window=count,
        reason=(
            f"{summary} (threshold {threshold}): side work is suppressed for "
            f"{clears_at - now:.0f} s more, or until `turnkeeper breaker reset`"
        ),
        clears_at=clears_at,
    )


class BootRow(Protocol):
    """A boot row as the store returns it (`supervisor.store.Boot`)."""

    @property
    def started_at(self) -> float: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def outcome(self) -> str | None: ...
    @property
    def breaker(self) -> dict[str, Any] | None: ...


def judge_rows(
    rows: Sequence[BootRow] | None,
    now: float,
    threshold: int,
    window: float,
    is_current: Callable[[Any], bool],
) -> BreakerState:
    """`evaluate` over boot rows: the newest reset recorded in any of them applies.

    `is_current(row)` says which row is the boot doing the judging. None: unreadable.
    """
    if rows is None:
        return evaluate(None, now, threshold, window)
    marks = [row.breaker or {} for row in rows]
    resets = [float(mark["reset_at"]) for mark in marks if "reset_at" in mark]
    records = [BootRecord(r.started_at, r.ended_at, r.outcome, is_current(r)) for r in rows]
    return evaluate(records, now, threshold, window, max(resets) if resets else None)
