"""The one timer seam: every wait and every reading of the time goes through a `Clock`.

The daemon runs on `SystemClock`. A test of a timing rule hands the code a `FakeClock`
and moves it with `advance`: sleepers whose deadline has come are woken in deadline
order, so the test never sleeps and never races the machine's load.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """What code that waits or measures time is handed."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Wall-clock epoch seconds (what events are stamped with)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...


class SystemClock:
    """The real clocks and asyncio's sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM = SystemClock()


async def sleep_unless(clock: Clock, seconds: float, *events: asyncio.Event) -> bool:
    """Sleep `seconds` on `clock`, or less if one of `events` is set; True if cut short."""
    sleep = asyncio.ensure_future(clock.sleep(seconds))
    waits = {sleep, *(asyncio.ensure_future(event.wait()) for event in events)}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return not sleep.done()
    finally:
        for wait in waits:
            wait.cancel()


class FakeClock:
    """A clock a test moves by hand; `sleep` returns when `advance` reaches its deadline."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_800_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall - start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._wall_offset

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future

    @property
    def sleepers(self) -> int:
        """How many coroutines are waiting on this clock."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move the clock on, waking each sleeper whose deadline comes, in order."""
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not future.done():
                future.set_result(None)
            # Let the woken coroutine run up to its next wait before time moves on.
            for _ in range(5):
                await asyncio.sleep(0)
        self._now = target
