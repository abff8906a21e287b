"""Whether the database takes writes, as intake has seen it: readiness fails meanwhile.

A request that could not be stored marks the store failed; the next write that works, or
a probe write at most every `STORAGE_PROBE` seconds from readiness checks, clears it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import peewee

from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.logs import log
from supervisor.core.vocabulary import Rejection
from supervisor.metrics import Metrics
from supervisor.store import StorageUnavailable

STORAGE_PROBE = 5.0  # seconds between write probes while the store takes no writes


class StorageHealth:
    """The last write failure intake saw, until a write works again."""

    def __init__(
        self, probe_write: Callable[[], None], metrics: Metrics, clock: Clock = SYSTEM
    ) -> None:
        self._probe_write = probe_write
        self._metrics = metrics
        self._clock = clock
        self.error: str | None = None  # why the last write failed, until one works
        self._failed_at = 0.0
        self.log = log("intake")

    def failed(self, exc: Exception) -> None:
        """A request could not be stored: readiness fails until a write works again."""
        self._metrics.intake_rejections.labels(Rejection.STORAGE_UNAVAILABLE).inc()
        if self.error is None:
            self.log.error("the database takes no writes: {}; intake answers 503", exc)
        self.error = str(exc)
        self._failed_at = self._clock.monotonic()

    def worked(self) -> None:
        """A write worked."""
        if self.error is not None:
            self.error = None
            self.log.info("the database takes writes again")

    async def ok(self) -> bool:
        """Whether the store takes writes; after a failure, probed every STORAGE_PROBE s."""
        if self.error is None:
            return True
        if self._clock.monotonic() - self._failed_at < STORAGE_PROBE:
            return False
        try:
            await asyncio.to_thread(self._probe_write)
        except (StorageUnavailable, peewee.DatabaseError) as exc:
            self.error = str(exc)
            self._failed_at = self._clock.monotonic()
            return False
        self.worked()
        return True
