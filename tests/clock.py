"""The fake clock of the timing tests: `sleep` returns when `advance` reaches its deadline.

Sleepers whose deadline has come are woken in deadline order, so a test never sleeps and
never races the machine's load.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


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

    def perf_counter(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future

    def sleep_blocking(self, seconds: float) -> None:
        """Move the clock on at once (nobody else can move it while this thread waits).

        Coroutines asleep on the clock are not woken here: the next `advance` wakes those
        whose deadline has passed.
        """
        if seconds > 0:
            self._now += seconds

    @property
    def sleepers(self) -> int:
        """How many coroutines are waiting on this clock."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    @property
    def wakes_at(self) -> float | None:
        """The earliest deadline a coroutine waits for on this clock; None if none waits."""
        waiting = [deadline for deadline, _, f in self._sleepers if not f.done()]
        return min(waiting, default=None)

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


class SteppingClock:
    """Time that moves only when a coroutine sleeps: each sleep advances it at once, and is
    kept in `slept` (to the hundredth). For loops whose waits a test reads back."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 2))
        self.now += seconds
        await asyncio.sleep(0)

    def sleep_blocking(self, seconds: float) -> None:
        self.now += seconds
