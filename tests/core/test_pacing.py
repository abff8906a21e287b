"""Recovery's pace, driven with a fake clock: a backlog of interrupted sessions is worked
off at `max_per_pass` every `pass_interval`, not left to the retry timer; the breaker
holds it back."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract.config import RecoveryConfig
from supervisor.core.pacing import Pace, Pacer
from supervisor.core.recovery import Trigger, boot_scan_plan
from tests.clock import FakeClock


def shipped() -> Pace:
    settings = RecoveryConfig()
    return Pace(settings.max_per_pass, settings.pass_interval, settings.retry_interval)


class Backlog:
    """Interrupted sessions nobody touches, and the passes that continue them: each pass
    takes the oldest `max_per_pass` (unless the breaker holds it back) and tells
    `Pacer` what it found, as `supervisor.pool.recoverer` does."""

    def __init__(self, pace: Pace, count: int, clock: FakeClock) -> None:
        self.clock = clock
        self.booted = clock.time()
        self.waiting = {f"s{i:04}": self.booted - 60 + i for i in range(count)}
        self.pacer = Pacer(pace, self.booted)
        self.continued: dict[str, float] = {}  # session -> seconds after the boot
        self.triggers: list[Trigger] = []
        self.tripped = False

    def run(self, trigger: Trigger) -> None:
        now = self.clock.time()
        self.triggers.append(trigger)
        if self.tripped:  # the decision table suppresses every one
            self.pacer.ran(trigger, now, left=0, held=len(self.waiting))
            return
        plan = boot_scan_plan(self.waiting.items(), self.pacer.pace.max_per_pass)
        for session in plan:
            del self.waiting[session]
            self.continued[session] = now - self.booted
        self.pacer.ran(trigger, now, left=len(self.waiting), held=0)

    def until(self, seconds: float) -> None:
        """Let time run to `seconds` after the boot, a pass at each time one is due."""
        end = self.booted + seconds
        while self.clock.time() + self.pacer.due_in(self.clock.time()) <= end:
            self.clock.sleep_blocking(self.pacer.due_in(self.clock.time()))
            self.run(self.pacer.trigger)
        self.clock.sleep_blocking(end - self.clock.time())


def test_with_the_defaults_100_interrupted_sessions_are_continued_within_2_minutes() -> None:
    clock = FakeClock()
    backlog = Backlog(shipped(), 100, clock)
    backlog.run(Trigger.BOOT_SCAN)
    assert len(backlog.continued) == 10  # the cap holds for each pass
    backlog.until(120.0)
    assert not backlog.waiting
    assert max(backlog.continued.values()) == 45.0  # 10 passes, 5 s apart
    # Oldest first, 10 a pass, every pass a boot scan's.
    order = sorted(backlog.continued, key=lambda s: (backlog.continued[s], s))
    assert order == sorted(backlog.continued)
    times = sorted(set(backlog.continued.values()))
    assert times == [5.0 * n for n in range(10)]
    assert all(list(backlog.continued.values()).count(t) == 10 for t in times)
    assert backlog.triggers == [Trigger.BOOT_SCAN] * 10
    # Then the retry timer, 5 minutes after the last pass.
    assert backlog.pacer.trigger is Trigger.RETRY_TIMER
    assert backlog.pacer.due_in(clock.time()) == 45.0 + 300.0 - 120.0


def test_the_pace_leaves_nothing_to_the_retry_timer_where_the_cap_alone_would() -> None:
    clock = FakeClock()
    backlog = Backlog(shipped(), 1_000, clock)
    backlog.run(Trigger.BOOT_SCAN)
    backlog.until(299.0)  # before the retry timer's first pass
    assert len(backlog.continued) == 600  # 60 passes; once, it was 10
    backlog.until(495.0)
    assert not backlog.waiting
    assert shipped().worked_off_in(1_000) == 495.0


def test_a_tripped_breaker_holds_the_backlog_back_until_it_clears() -> None:
    clock = FakeClock()
    backlog = Backlog(shipped(), 100, clock)
    backlog.tripped = True  # 3 unclean boots in the window
    backlog.run(Trigger.BOOT_SCAN)
    assert backlog.pacer.held and backlog.pacer.trigger is Trigger.BOOT_SCAN
    backlog.until(250.0)
    assert not backlog.continued and backlog.triggers == [Trigger.BOOT_SCAN]
    # The pass a retry interval later is held back too, and so is the next.
    backlog.until(301.0)
    assert not backlog.continued and len(backlog.triggers) == 2
    # The breaker clears (the window drained, or a reset): the held-back scan comes at
    # once and paces the backlog as at a boot.
    backlog.tripped = False
    backlog.pacer.cleared(clock.time())
    assert backlog.pacer.due_in(clock.time()) == 0.0
    backlog.until(301.0 + 45.0)
    assert not backlog.waiting
    assert min(backlog.continued.values()) == 301.0
    assert max(backlog.continued.values()) == 346.0


def test_a_breaker_that_clears_with_nothing_held_back_asks_for_no_pass() -> None:
    pacer = Pacer(shipped(), 0.0)
    pacer.ran(Trigger.BOOT_SCAN, 0.0, left=0, held=0)
    pacer.cleared(10.0)
    assert pacer.due_in(10.0) == 290.0 and pacer.trigger is Trigger.RETRY_TIMER


def test_a_cap_of_zero_continues_nothing_and_paces_nothing() -> None:
    clock = FakeClock()
    backlog = Backlog(Pace(0, 5.0, 300.0), 30, clock)
    backlog.run(Trigger.BOOT_SCAN)
    backlog.until(299.0)
    assert not backlog.continued and len(backlog.triggers) == 1


def test_the_first_retry_comes_one_interval_after_the_boot() -> None:
    pacer = Pacer(shipped(), 1_000.0)
    assert pacer.trigger is Trigger.RETRY_TIMER
    assert not pacer.is_due(1_299.0) and pacer.is_due(1_300.0)


def test_a_reload_changes_the_pace_from_the_next_pass_on() -> None:
    pacer = Pacer(shipped(), 0.0)
    pacer.ran(Trigger.RETRY_TIMER, 0.0, left=5, held=0)
    pacer.reconfigure(Pace(10, 1.0, 300.0))
    assert pacer.due_in(0.0) == 5.0  # already planned
    pacer.ran(Trigger.RETRY_TIMER, 5.0, left=5, held=0)
    assert pacer.due_in(5.0) == 1.0 and pacer.trigger is Trigger.RETRY_TIMER


def test_only_the_boot_scan_and_the_retry_timer_are_paced() -> None:
    pacer = Pacer(shipped(), 0.0)
    with pytest.raises(ValueError, match="subagent_resume"):
        pacer.ran(Trigger.SUBAGENT_RESUME, 0.0, left=1, held=0)


@pytest.mark.parametrize(
    ("cap", "interval", "retry"),
    [(-1, 5.0, 300.0), (10, 0.0, 300.0), (10, 5.0, -1.0)],
    ids=["negative-cap", "zero-interval", "negative-retry"],
)
def test_a_pace_that_cannot_be_is_refused(cap: int, interval: float, retry: float) -> None:
    with pytest.raises(ValueError):
        Pace(cap, interval, retry)


@given(
    count=st.integers(0, 400),
    cap=st.integers(1, 50),
    interval=st.floats(0.5, 60.0),
)
def test_any_backlog_is_worked_off_at_the_pace(count: int, cap: int, interval: float) -> None:
    pace = Pace(cap, interval, 300.0)
    clock = FakeClock()
    backlog = Backlog(pace, count, clock)
    backlog.run(Trigger.BOOT_SCAN)
    backlog.until(pace.worked_off_in(count) + interval / 2)  # the last pass, not the next
    assert not backlog.waiting
    assert len(backlog.triggers) == max(1, pace.passes_for(count))
    # No pass continues more than its cap, and passes are `interval` apart.
    by_time: dict[float, int] = {}
    for at in backlog.continued.values():
        by_time[at] = by_time.get(at, 0) + 1
    assert all(n <= cap for n in by_time.values())
    starts = sorted(by_time)
    assert all(b - a == pytest.approx(interval, abs=1e-6) for a, b in pairwise(starts))
