"""When a reconcile loop looks next: the rule on plain times, and a loop (the daemon's own
`reconcile`) that rests by it on a fake clock, acting on each due time at that time, across
a restart too, however long its sweep."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.timers import rest
from supervisor.runtime.loops import SLACK, Wake, reconcile
from tests.clock import FakeClock

SWEEP = 60.0


@pytest.mark.parametrize(
    ("due", "judged", "now", "wait"),
    [
        ([], 100.0, 100.0, SWEEP),  # nothing waits: the sweep
        ([None], 100.0, 100.0, SWEEP),  # a row with no time of its own
        ([130.0], 100.0, 100.5, 29.5),  # from now, not from the judging
        ([130.0, 110.0, None], 100.0, 100.0, 10.0),  # the earliest
        ([500.0], 100.0, 100.0, SWEEP),  # at most the sweep
        ([100.2], 100.0, 100.5, 0.0),  # due meanwhile: at once
        ([99.9, 90.0], 100.0, 100.0, SWEEP),  # judged by this pass: not waited for again
        ([100.0], 100.0, 100.5, 0.0),  # due as it judged: looked at again, at once
        ([90.0, 140.0], 100.0, 101.0, 39.0),
    ],
)
def test_the_rest_lasts_until_the_earliest_time_after_the_pass_judged(
    due: list[float | None], judged: float, now: float, wait: float
) -> None:
    assert rest(due, judged=judged, now=now, longest=SWEEP) == pytest.approx(wait)


times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(st.lists(st.none() | times), times, st.floats(0, 100), st.floats(0, 1e4))
def test_a_rest_is_never_negative_nor_past_the_sweep_nor_past_a_time_ahead(
    due: list[float | None], judged: float, since: float, longest: float
) -> None:
    now = judged + since
    wait = rest(due, judged=judged, now=now, longest=longest)
    assert 0.0 <= wait <= longest
    ahead = [t for t in due if t is not None and t >= judged]
    assert all(now + wait <= max(t, now) + 1e-6 for t in ahead)  # none ahead is slept past
    if not ahead:
        assert wait == longest  # a row left due never spins the loop


class Outbox:
    """Rows due at times on the clock, as a database holds them: each acted on once, and
    the time it was acted on kept."""

    def __init__(self, clock: FakeClock, due: list[float]) -> None:
        self.clock = clock
        self.waiting = sorted(due)
        self.acted: dict[float, float] = {}

    async def step(self) -> float:
        judged = self.clock.time()
        for moment in [t for t in self.waiting if t <= judged]:
            self.waiting.remove(moment)
            self.acted[moment] = judged
        return rest(self.waiting, judged=judged, now=self.clock.time(), longest=SWEEP)


def test_a_loop_acts_on_each_time_at_that_time_across_a_restart() -> None:
    async def main() -> None:
        clock = FakeClock()
        start = clock.time()
        outbox = Outbox(clock, [start + 7.0, start + 19.5, start + 45.0, start + 200.0])

        def run() -> asyncio.Task[None]:
            return asyncio.ensure_future(
                reconcile("t", outbox.step, interval=lambda: SWEEP, wake=Wake(), clock=clock)
            )

        async def asleep() -> None:
            while clock.sleepers != 1:
                await asyncio.sleep(0)

        loop = run()
        await asleep()
        await clock.advance(10.0)
        loop.cancel()  # the daemon stops (any way: the times are the outbox's)
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await clock.advance(5.0)  # down for 5 s
        loop = run()  # the next boot passes at once
        await asleep()
        await clock.advance(300.0)
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        for due, acted in outbox.acted.items():
            assert 0.0 <= acted - due <= SLACK + 1e-9, (due - start, acted - due)
        assert sorted(outbox.acted) == [start + 7.0, start + 19.5, start + 45.0, start + 200.0]

    asyncio.run(main())
