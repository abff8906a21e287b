"""The housekeeping loops on a fake clock, the pool's tending and ownership's dispatching:
they run at deadlines and on request, never on a tick, so an idle pool does nothing at
all while time stands still."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from supervisor.pool.housekeeping import PASS_GAP, RETRY, SLACK, Dispatching, Tending
from tests.clock import FakeClock

FULL = 5.0  # the stand-in ownership's seconds between full passes


class Stage:
    """Both loops over stand-ins that count what they call."""

    def __init__(self, clock: FakeClock, *, tend_in: float = 30.0) -> None:
        self.clock = clock
        self.tend_in = tend_in  # tend asks to be called again this much later
        self.tends: list[float] = []
        self.passes: list[float] = []
        self.outcomes: list[bool | Exception] = []  # what the next passes return or raise
        self.full_due = 0.0
        self.always_due = False  # time asks for a pass at every moment
        self.wanted = asyncio.Event()
        self.tending = Tending(self.tend, clock)
        self.dispatching = Dispatching(self.dispatch, self.next_pass_in, self.wanted, clock)

    def tend(self, now: float) -> float:
        self.tends.append(now)
        return now + self.tend_in

    async def dispatch(self) -> bool:
        now = self.clock.monotonic()
        self.passes.append(now)
        if now >= self.full_due:
            self.full_due = now + FULL
        outcome = self.outcomes.pop(0) if self.outcomes else False
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def next_pass_in(self) -> float:
        return 0.0 if self.always_due else max(0.0, self.full_due - self.clock.monotonic())


async def settle() -> None:
    """Let every ready coroutine run until each waits again."""
    for _ in range(20):
        await asyncio.sleep(0)


def staged(test: Callable[[Stage, FakeClock], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        clock = FakeClock()
        stage = Stage(clock, **kwargs)
        tasks = [
            asyncio.create_task(stage.tending.run()),
            asyncio.create_task(stage.dispatching.run()),
        ]
        await settle()
        try:
            await test(stage, clock)
            assert not any(task.done() for task in tasks)  # nothing ended a loop
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_an_idle_loop_waits_while_time_stands_still() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        assert len(stage.passes) == 1 and len(stage.tends) == 1  # the first of each, then rest
        for _ in range(100):
            await asyncio.sleep(0)
        assert len(stage.passes) == 1 and len(stage.tends) == 1
        assert clock.sleepers == 2  # one a loop

    staged(test)


def test_a_wanted_pass_runs_at_once_and_only_once() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        stage.wanted.set()
        await settle()
        assert stage.passes == [1_000.0, 1_000.0]
        assert not stage.wanted.is_set()
        await settle()
        assert len(stage.passes) == 2

    staged(test)


def test_a_pass_whose_budget_ran_out_is_followed_by_another_at_once() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        stage.outcomes = [True, True, False]
        stage.wanted.set()
        await settle()
        assert stage.passes == [1_000.0] * 4  # the first, then three asked for

    staged(test)


def test_time_asks_for_the_full_pass_at_its_deadline_not_before() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        await clock.advance(FULL - 0.1)
        await settle()
        assert len(stage.passes) == 1
        await clock.advance(0.1 + 2 * SLACK)
        await settle()
        assert len(stage.passes) == 2 and stage.passes[1] >= 1_000.0 + FULL

    staged(test)


def test_tend_runs_at_the_deadline_it_returned() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        tended = len(stage.tends)
        await clock.advance(2.0)
        await settle()
        assert len(stage.tends) == tended
        await clock.advance(1.0 + 2 * SLACK)
        await settle()
        assert len(stage.tends) == tended + 1

    staged(test, tend_in=3.0)


def test_a_stir_makes_it_tend_again_without_a_pass() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        tended, passes = len(stage.tends), len(stage.passes)
        stage.tending.stir()
        await settle()
        assert (len(stage.tends), len(stage.passes)) == (tended + 1, passes)

    staged(test)


def test_a_failed_pass_is_tried_again_after_the_retry_delay() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        stage.outcomes = [RuntimeError("database gone")]
        stage.wanted.set()
        await settle()
        assert len(stage.passes) == 2
        await clock.advance(RETRY - 0.1)
        await settle()
        assert len(stage.passes) == 2
        await clock.advance(0.1 + 2 * SLACK)
        await settle()
        assert len(stage.passes) == 3

    staged(test)


def test_a_pass_asks_for_no_tend_and_a_tend_for_no_pass() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        tended, passes = len(stage.tends), len(stage.passes)
        stage.wanted.set()
        await settle()
        assert (len(stage.tends), len(stage.passes)) == (tended, passes + 1)
        stage.tending.stir()
        await settle()
        assert (len(stage.tends), len(stage.passes)) == (tended + 1, passes + 1)

    staged(test)


def test_time_asks_for_no_more_than_one_pass_every_gap() -> None:
    async def test(stage: Stage, clock: FakeClock) -> None:
        stage.always_due = True  # as an attempt come due that no pass can serve
        stage.wanted.set()
        await settle()
        passes = len(stage.passes)
        for _ in range(5):  # 2.5 gaps
            await clock.advance(PASS_GAP / 2)
            await settle()
        assert len(stage.passes) - passes == 2

    staged(test)
