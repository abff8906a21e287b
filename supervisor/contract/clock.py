"""The one timer seam: every wait and every reading of the time goes through a `Clock`.

The daemon runs on `SystemClock` (`SYSTEM`). A test of a timing rule hands the code a fake
clock of its own and moves it by hand, so the test never sleeps and never races the
machine's load. Code with no clock handed to it uses `SYSTEM`; nothing else in the project
reads the time or waits on its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio


class Clock(Protocol):
    """What code that waits or measures time is handed."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Wall-clock epoch seconds (what events are stamped with)."""
        ...

    def perf_counter(self) -> float:
        """Seconds on the finest clock there is, for measuring how long something took."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...

    def sleep_blocking(self, seconds: float) -> None:
        """Block this thread `seconds` (threads and synchronous code only)."""
        ...


class SystemClock:
    """The real clocks, asyncio's sleep and the thread's."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def perf_counter(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        import asyncio  # here, not at import: the command line's start stays light

        await asyncio.sleep(seconds)

    def sleep_blocking(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM = SystemClock()


async def sleep_unless(clock: Clock, seconds: float, *events: asyncio.Event) -> bool:
    """Sleep `seconds` on `clock`, or less if one of `events` is set; True if cut short."""
    import asyncio  # (see SystemClock.sleep)

    sleep = asyncio.ensure_future(clock.sleep(seconds))
    waits = {sleep, *(asyncio.ensure_future(event.wait()) for event in events)}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return not sleep.done()
    finally:
        for wait in waits:
            wait.cancel()
