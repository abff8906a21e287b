"""The stop's parts that are not a service's: the step log every stop step goes through
(capped, timed and logged, whatever it raises) and the stop's constants."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from supervisor.contract.clock import SYSTEM
from supervisor.contract.logs import log

STOP_REQUEST = "stop-request.json"  # written by `turnkeeper stop --drain`, read at SIGTERM
READY_TIMEOUT = 60.0


class StepLog:
    """The stop's steps (`supervisor.runtime.service.Steps`): each capped, timed and
    logged, whatever it raises; their durations and failures are kept for the boot row
    and for `comes_back`."""

    def __init__(self, seconds: dict[str, float], failed: set[str]) -> None:
        self.seconds = seconds
        self.failed = failed

    async def run(self, name: str, cap: float, work: Callable[[], Awaitable[object]]) -> None:
        started = SYSTEM.monotonic()
        try:
            await asyncio.wait_for(work(), cap)
        except TimeoutError:
            self.failed.add(name)
            log("shutdown").error(
                "{} did not finish within its cap of {:.1f} s; moving on", name, cap
            )
        except Exception as exc:  # a full disk, a database gone: the stop goes on
            self.failed.add(name)
            log("shutdown").error("{} failed: {}; moving on", name, exc)
        seconds = SYSTEM.monotonic() - started
        self.seconds[name] = seconds
        log("shutdown").info("{} done in {:.2f} s (cap {:g} s)", name, seconds, cap)
