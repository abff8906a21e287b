"""The reconcile loop every service runs, and the one verb that makes it look again.

A service's loop is a pass (`step`) run at once, then again when it is woken (`Wake`)
or when its interval has passed, until it is cancelled. One helper gives every loop the
same policy:

- The pass returns how long to rest before the next (None: the loop's interval).
- A pass that raises is logged once per streak of failures (a database gone fails
  every pass: one line, not one a second; its traceback at DEBUG), the next pass comes
  after `retry` seconds, and the first pass that works again says so. A loop never dies
  of its pass's error.
- Every pass is counted by the observer the service was given (the metrics), by loop and
  by outcome.
- A wake that comes during a pass is kept: the next rest is cut short at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from supervisor.contract.clock import Clock, sleep_unless
from supervisor.contract.logs import log

SLACK = 0.01  # seconds past a rest's end: a loop never wakes early, so never spins
MAX_REST = 3600.0  # the longest rest: a clock step or a lost wake costs at most this


class Wake:
    """Asks a loop to look again now. `wake()` from the event loop, `wake_threadsafe()`
    from a thread."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Look again now."""
        self.event.set()

    def wake_threadsafe(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.event.set)

    def bind(self) -> None:
        """From the loop's own task: `wake_threadsafe` calls reach this event loop."""
        self._loop = asyncio.get_running_loop()

    def clear(self) -> None:
        self.event.clear()

    def is_set(self) -> bool:
        return self.event.is_set()


class PassObserver(Protocol):
    """Counts the passes of the loops (`supervisor.metrics.Metrics.loop_pass` is one)."""

    def loop_pass(self, loop: str, ok: bool) -> None: ...


class _Quiet:
    def loop_pass(self, loop: str, ok: bool) -> None:
        pass


QUIET = _Quiet()


async def reconcile(
    name: str,
    step: Callable[[], Awaitable[float | None]],
    *,
    interval: Callable[[], float],
    wake: Wake,
    clock: Clock,
    retry: float | None = None,
    observer: PassObserver = QUIET,
    wakes: tuple[asyncio.Event, ...] = (),
    fatal: tuple[type[BaseException], ...] = (),
) -> None:
    """Pass at once, then on every wake and after every rest, until cancelled (see the
    module's docstring). `wakes`: more events that cut a rest short (left set: their
    owner clears them); `fatal`: errors that end the loop (and so its service, and the
    daemon) instead of a retry."""
    say = log(name.split("-")[0])
    wake.bind()
    failing = False
    while True:
        wake.clear()
        try:
            rest = await step()
        except fatal:
            raise
        except Exception as exc:
            wait = retry if retry is not None else interval()
            if not failing:
                # One line an operator reads (a full disk, a database gone); the traceback
                # for whoever debugs.
                say.error("{}: a pass failed ({}); trying again every {:g} s", name, exc, wait)
                say.opt(exception=exc).debug("{}: the pass that failed", name)
            failing, ok, rest = True, False, wait
        else:
            if failing:
                say.info("{}: passes work again", name)
            failing, ok = False, True
        observer.loop_pass(name, ok)
        if rest is None:
            rest = interval()
        await sleep_unless(clock, min(MAX_REST, max(0.0, rest)) + SLACK, wake.event, *wakes)
