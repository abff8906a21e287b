"""When the pool looks again: at deadlines and on request, never on a tick.

The pool's housekeeping has two kinds of work, each run when it is due and not before:

- Tending the slots and workers (`tend`: start the workers of slots due for a restart,
  abort hung workers). It returns the time it needs to look again (a slot's restart, a
  worker's heartbeat timeout); `stir()` says that the slots changed (a worker started or
  exited), so that the loop takes the new deadlines.
- Dispatch passes (who owns which session). One runs at once when something asks for it
  (`wanted`: new input, a touch, an interrupt, a dead worker's sessions, a ready worker,
  recovery) and again at once while its budget runs out (`dispatch` returns True). Time
  alone asks for one too (`next_pass_in`: a full pass, an attempt come due), but no more
  than one such pass every `PASS_GAP`; a failed pass is tried again after `RETRY`.

In between, the loop sleeps: an idle pool reads nothing and scans nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from supervisor.contract.clock import Clock, sleep_unless
from supervisor.contract.logs import log

SLACK = 0.01  # seconds the loop wakes past a deadline: never early, so never a spin
MAX_REST = 60.0  # seconds the loop sleeps at most when nothing is due
PASS_GAP = 0.25  # seconds between the passes that time alone asks for
RETRY = 1.0  # seconds before a failed dispatch pass is tried again


class Housekeeper:
    """Runs `tend` and dispatch passes when they are due (see the module's docstring)."""

    def __init__(
        self,
        tend: Callable[[float], float],
        dispatch: Callable[[], Awaitable[bool]],
        next_pass_in: Callable[[], float],
        wanted: asyncio.Event,
        clock: Clock,
    ) -> None:
        self.tend = tend  # (now) -> when to tend again
        self.dispatch = dispatch  # one pass; True when its budget ran out
        self.next_pass_in = next_pass_in  # seconds until time alone asks for a pass
        self.wanted = wanted
        self.clock = clock
        self.stirred = asyncio.Event()
        self.log = log("pool")

    def stir(self) -> None:
        """The slots changed: look at their deadlines again."""
        self.stirred.set()

    async def run(self) -> None:
        """Tend and dispatch until cancelled."""
        timed_at = float("-inf")  # when time alone last asked for a pass
        retry_at = float("inf")
        while True:
            now = self.clock.monotonic()
            deadline = self.tend(now)
            self.stirred.clear()
            timed = min(max(now + self.next_pass_in(), timed_at + PASS_GAP), retry_at)
            if not self.wanted.is_set() and now < timed:
                await self._rest(min(deadline, timed) - now)
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

    async def _rest(self, seconds: float) -> None:
        """Sleep `seconds` (and SLACK), or until a pass is wanted or the slots change."""
        rest = min(MAX_REST, max(0.0, seconds)) + SLACK
        await sleep_unless(self.clock, rest, self.wanted, self.stirred)
