"""The fake clock: sleepers wake in deadline order as a test moves time, and never early."""

from __future__ import annotations

import asyncio

from supervisor.contract.clock import SYSTEM
from tests.clock import FakeClock


def test_sleepers_wake_in_deadline_order_and_only_when_their_time_comes() -> None:
    async def go() -> list[tuple[str, float]]:
        clock = FakeClock(start=0.0)
        woke: list[tuple[str, float]] = []

        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append((name, clock.monotonic()))

        tasks = [asyncio.create_task(sleeper(n, s)) for n, s in [("b", 5), ("a", 2), ("c", 9)]]
        await asyncio.sleep(0)
        assert clock.sleepers == 3
        await clock.advance(1.9)
        assert woke == []
        await clock.advance(3.1)  # to 5.0
        assert woke == [("a", 2.0), ("b", 5.0)]
        await clock.advance(10)
        await asyncio.gather(*tasks)
        assert clock.monotonic() == 15.0
        return woke

    assert asyncio.run(go()) == [("a", 2.0), ("b", 5.0), ("c", 9.0)]


def test_the_wall_clock_moves_with_the_monotonic_one() -> None:
    async def go() -> float:
        clock = FakeClock(start=10.0, wall=1000.0)
        await clock.advance(2.5)
        return clock.time()

    assert asyncio.run(go()) == 1002.5
    assert SYSTEM.time() > 1.7e9 and SYSTEM.monotonic() > 0
