"""Autonomous runs that stopped between turns, resumed by recovery's guarded pass.

A run whose last checkpoint says it is unfinished, and whose next wake time has come, goes
on by itself: its prompt is appended as the next user message (the pool assigns it like
any input). The breaker holds this back like every other unattended work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from supervisor.contract.logs import log
from supervisor.core import autonomy
from supervisor.core.recovery import Trigger
from supervisor.pool.counting import Counts
from supervisor.store import ReplayedSeq, Store

RUN_TAIL = 20  # events read to find an autonomous run's newest checkpoint


@dataclass(frozen=True)
class Resumer:
    """Resumes autonomous runs, with what that needs of recovery."""

    store: Store
    metrics: Counts
    clock: Callable[[], float]  # wall time: a checkpoint's next wake is wall time
    quieted: Callable[[str, tuple[Any, ...]], bool]  # recovery's: True if not logged yet
    wanted: asyncio.Event  # set: the pool has input to hand out

    async def resume(self, trigger: Trigger, tripped: bool) -> int:
        """Autonomous runs that stopped between turns (no turn in flight) go on by
        themselves: their prompt is appended as the next user message. Returns how many
        the breaker (`tripped`) held back."""
        held = 0
        for info in await asyncio.to_thread(self.store.sessions.idle_autonomous):
            # The newest checkpoint is among the last events: a stopped run costs a short
            # index range scan, not a read of its log.
            events = await asyncio.to_thread(self.store.events.tail, info.id, RUN_TAIL)
            if not autonomy.unfinished(events):
                continue
            checkpoint = autonomy.last_checkpoint(events) or {}
            prompt = str(checkpoint.get("prompt", ""))  # every checkpoint carries it
            wake = checkpoint.get("next_wake_at")
            if wake is not None and float(wake) > self.clock():
                continue
            if tripped:
                held += 1
                key = ("autonomous resume suppressed", trigger)
                if self.quieted(info.id, key):
                    self.metrics.recovery.labels("resume_run", "daemon_restart", "suppressed").inc()
                    log("recovery", session=info.id).warning(
                        "breaker tripped: autonomous resume suppressed"
                    )
                continue
            # A claim: the key makes a second resume after this checkpoint (another daemon's
            # pass at the same time, or a later pass of this one) append nothing.
            at = next(e.seq for e in reversed(events) if e.type == "checkpoint")
            seq = await asyncio.to_thread(
                self.store.events.append,
                info.id,
                "user_message",
                {"text": prompt, "autonomous": True, "resumed": True},
                writer="supervisor",
                idempotency_key=f"autonomous-resume:{at}",
            )
            if isinstance(seq, ReplayedSeq):
                continue  # resumed already, by this daemon or another
            self.metrics.recovery.labels("resume_run", "daemon_restart", "started").inc()
            log("recovery", session=info.id).info(
                "autonomous run resumed after {} turns", checkpoint.get("turns", 0)
            )
            self.wanted.set()
        return held
