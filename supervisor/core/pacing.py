"""The pace of recovery's unattended passes: how many interrupted sessions each one
continues, and when the next one comes.

Pure code: no database, no clock; the caller passes the time in and says what each pass
found (h11's manner: `Pacer` owns its state and changes only through its event methods).

Rules
-----
- A pass (the boot scan, the retry timer) continues at most `max_per_pass` of the
  interrupted sessions it would continue, oldest interruption first
  (`supervisor.core.recovery.boot_scan_plan`); the rest are left.
- A pass that left some has the next pass `pass_interval` after it started, with the
  same trigger: a backlog of N is worked off in ceil(N / max_per_pass) passes, the last
  one (ceil(N / max_per_pass) - 1) * pass_interval after the first, not left to the
  retry timer.
- A pass that left none: the next is the retry timer's, `retry_interval` after it started.
  The first retry comes `retry_interval` after the boot.
- A pass the breaker held back (it suppressed a session, or held an autonomous run back)
  paces nothing: the passes wait for the retry timer, and when the breaker clears the
  held-back pass comes at once, with the trigger it had. A tripped breaker so stops a
  backlog where it stands, however many sessions it holds.
- `max_per_pass` = 0: the passes continue nothing, so nothing is ever left to pace.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.recovery import Trigger


@dataclass(frozen=True)
class Pace:
    """How fast recovery's passes work a backlog off."""

    max_per_pass: int  # sessions one pass continues at most
    pass_interval: float  # seconds between passes while some are left
    retry_interval: float  # seconds between passes otherwise

    def __post_init__(self) -> None:
        if self.max_per_pass < 0:
            raise ValueError(f"max_per_pass cannot be negative: {self.max_per_pass}")
        if self.pass_interval <= 0 or self.retry_interval <= 0:
            raise ValueError("pass_interval and retry_interval must be positive")

    def passes_for(self, backlog: int) -> int:
        """How many passes continue a backlog of `backlog` sessions (0 with no cap)."""
        if backlog <= 0 or self.max_per_pass == 0:
            return 0
        return -(-backlog // self.max_per_pass)

    def worked_off_in(self, backlog: int) -> float:
        """Seconds from the first pass to the last one a backlog of `backlog` needs."""
        return max(0, self.passes_for(backlog) - 1) * self.pass_interval


class Pacer:
    """When recovery's next unattended pass is due, and with which trigger."""

    def __init__(self, pace: Pace, booted_at: float) -> None:
        self.pace = pace
        self._due = booted_at + pace.retry_interval
        self._trigger = Trigger.RETRY_TIMER
        self._held = False

    # --- reads ----------------------------------------------------------------------

    @property
    def trigger(self) -> Trigger:
        """What the next pass is: the retry timer, or a backlog's next pass (the trigger
        of the pass that left it)."""
        return self._trigger

    @property
    def held(self) -> bool:
        """The breaker held the last pass back: the next one waits for it to clear."""
        return self._held

    def due_in(self, now: float) -> float:
        """Seconds from `now` until the next pass (0: due)."""
        return max(0.0, self._due - now)

    def is_due(self, now: float) -> bool:
        """Whether the next pass is due at `now`."""
        return now >= self._due

    # --- events ---------------------------------------------------------------------

    def ran(self, trigger: Trigger, started: float, *, left: int, held: int) -> None:
        """A pass of `trigger` that started at `started` left `left` sessions it would
        have continued past the cap, and the breaker held `held` back."""
        if trigger not in (Trigger.BOOT_SCAN, Trigger.RETRY_TIMER):
            raise ValueError(f"{trigger.value} is not one of recovery's paced passes")
        self._held = held > 0
        if self._held:
            self._trigger = trigger
            self._due = started + self.pace.retry_interval
        elif left > 0 and self.pace.max_per_pass > 0:
            self._trigger = trigger
            self._due = started + self.pace.pass_interval
        else:
            self._trigger = Trigger.RETRY_TIMER
            self._due = started + self.pace.retry_interval

    def cleared(self, now: float) -> None:
        """The breaker let go: a pass it held back comes at once."""
        if self._held:
            self._held = False
            self._due = now

    def reconfigure(self, pace: Pace) -> None:
        """A reload's pace: the next pass keeps its time; the ones after take the new one."""
        self.pace = pace
