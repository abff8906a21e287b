"""When the pool and ownership look again: at deadlines and on request, never on a tick.

Two loops, each the shared reconcile loop (`supervisor.runtime.loops.reconcile`: its
error policy and its count of passes), each pass run when it is due and not before:

- `Tending`, the pool's: tend the slots and workers (`tend`: start the workers of slots
  due for a restart, abort hung workers). It returns the time it needs to look again (a
  slot's restart, a worker's heartbeat timeout); `stir()` says that the slots changed (a
  worker started or exited, the first became ready), so that the loop takes the new
  deadlines at once.
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

from supervisor.contract.clock import Clock
from supervisor.runtime.loops import QUIET, PassObserver, Wake, reconcile

SLACK = 0.01  # seconds a loop wakes past a deadline (the reconcile loop's): never early
MAX_REST = 60.0  # seconds a loop sleeps at most when nothing is due
PASS_GAP = 0.25  # seconds between the passes that time alone asks for
RETRY = 1.0  # seconds before a failed pass is tried again


class Tending:
    """Runs `tend` when it is due (see the module's docstring)."""

    def __init__(
        self, tend: Callable[[float], float], clock: Clock, observer: PassObserver = QUIET
    ) -> None:
        self.tend = tend  # (now) -> when to tend again
        self.clock = clock
        self.observer = observer
        self.stirred = Wake()

    def stir(self) -> None:
        """The slots changed: look at their deadlines again."""
        self.stirred.wake()

    async def run(self) -> None:
        """Tend until cancelled."""
        await reconcile(
            "pool-tending",
            self._pass,
            interval=lambda: MAX_REST,
            wake=self.stirred,
            clock=self.clock,
            retry=RETRY,
            observer=self.observer,
        )

    async def _pass(self) -> float:
        now = self.clock.monotonic()
        return min(MAX_REST, self.tend(now) - now)


class Dispatching:
    """Runs dispatch passes when they are due (see the module's docstring)."""

    def __init__(
        self,
        dispatch: Callable[[], Awaitable[bool]],
        next_pass_in: Callable[[], float],
        wanted: asyncio.Event,
        clock: Clock,
        observer: PassObserver = QUIET,
    ) -> None:
        self.dispatch = dispatch  # one pass; True when its budget ran out
        self.next_pass_in = next_pass_in  # seconds until time alone asks for a pass
        self.wanted = wanted
        self.clock = clock
        self.observer = observer
        self.woken = Wake()  # the loop's own: `wanted` is the one that asks
        self._timed_at = float("-inf")  # when time alone last asked for a pass
        self._retry_at = float("inf")  # when a failed pass is tried again

    async def run(self) -> None:
        """Dispatch until cancelled."""
        await reconcile(
            "ownership-dispatch",
            self._pass,
            interval=lambda: MAX_REST,
            wake=self.woken,
            clock=self.clock,
            retry=RETRY,
            observer=self.observer,
            wakes=(self.wanted,),
        )

    def _due_in(self, now: float) -> float:
        """Seconds until time asks for a pass (none sooner than `PASS_GAP` after the last
        it asked for; a failed one's retry at its time)."""
        timed = max(now + self.next_pass_in(), self._timed_at + PASS_GAP)
        return min(timed, self._retry_at) - now

    async def _pass(self) -> float:
        now = self.clock.monotonic()
        if not self.wanted.is_set():
            due = self._due_in(now)
            if due > 0:
                return min(MAX_REST, due)  # woken early: rest on
            self._timed_at = now
        self.wanted.clear()
        self._retry_at = float("inf")
        try:
            spent = await self.dispatch()
        except Exception:
            self._retry_at = self.clock.monotonic() + RETRY
            raise  # logged once per streak by the loop, which rests RETRY
        if spent:
            self.wanted.set()  # the pass's budget ran out: more is waiting
            return 0.0
        return min(MAX_REST, max(0.0, self._due_in(self.clock.monotonic())))
