"""When the pool and ownership look again: at deadlines and on request, never on a tick.

Two loops, each run when its work is due and not before:

- `Tending`, the pool's: tend the slots and workers (`tend`: start the workers of slots
  due for a restart, abort hung workers). It returns the time it needs to look again (a
  slot's restart, a worker's heartbeat timeout); `stir()` says that the slots changed (a
  worker started or exited), so that the loop takes the new deadlines.
- `Dispatching`, ownership's: dispatch passes (who owns which session). One runs at once
  when something asks for it (`wanted`: new input, a touch, an interrupt, a dead worker's
  sessions, a ready worker, recovery) and again at once while its budget runs out
  (`dispatch` returns True). Time alone asks for one too (`next_pass_in`: a full pass,
  an attempt come due), but no more than one such pass every `PASS_GAP`; a failed pass
  is tried again after `RETRY`.

In between, each loop sleeps: an idle pool reads nothing and scans nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from supervisor.contract.clock import Clock, sleep_unless
from supervisor.contract.logs import log

SLACK = 0.01  # seconds a loop wakes past a deadline: never early, so never a spin
MAX_REST = 60.0  # seconds a loop sleeps at most when nothing is due
PASS_GAP = 0.25  # seconds between the passes that time alone asks for
RETRY = 1.0  # seconds before a failed dispatch pass is tried again


def rest_for(seconds: float) -> float:
    """How long a loop sleeps for a deadline `seconds` away."""
    return min(MAX_REST, max(0.0, seconds)) + SLACK


class Tending:
    """Runs `tend` when it is due (see the module's docstring)."""

    def __init__(self, tend: Callable[[float], float], clock: Clock) -> None:
        self.tend = tend  # (now) -> when to tend again
        self.clock = clock
        self.stirred = asyncio.Event()

    def stir(self) -> None:
        """The slots changed: look at their deadlines again."""
        self.stirred.set()

    async def run(self) -> None:
        """Tend until cancelled."""
        while True:
            now = self.clock.monotonic()
            deadline = self.tend(now)
            self.stirred.clear()
            await sleep_unless(self.clock, rest_for(deadline - now), self.stirred)


class Dispatching:
    """Runs dispatch passes when they are due (see the module's docstring)."""

    def __init__(
        self,
        dispatch: Callable[[], Awaitable[bool]],
        next_pass_in: Callable[[], float],
        wanted: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.dispatch = dispatch  # one pass; True when its budget ran out
        self.next_pass_in = next_pass_in  # seconds until time alone asks for a pass
        self.wanted = wanted
        self.clock = clock
        self.log = log("pool")

    async def run(self) -> None:
        """Dispatch until cancelled."""
        timed_at = float("-inf")  # when time alone last asked for a pass
        retry_at = float("inf")
        while True:
            now = self.clock.monotonic()
            timed = min(max(now + self.next_pass_in(), timed_at + PASS_GAP), retry_at)
            if not self.wanted.is_set() and now < timed:
                await sleep_unless(self.clock, rest_for(timed - now), self.wanted)
                continue
            if not self.wanted.is_set():
                timed_at = now
            self.wanted.clear()
            retry_at = float("inf")
            try:
                if await self.dispatch():
                    self.wanted.set()  # the pass's budget ran out: more is waiting
            except Exception:
                self.log.exception("dispatch failed; trying again in {:.0f} s", RETRY)
                retry_at = self.clock.monotonic() + RETRY
