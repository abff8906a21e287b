"""The rolling restart (SIGHUP, `turnkeeper reload`): every worker replaced, its sessions
handed over at event boundaries, none lost."""

from __future__ import annotations

import signal
from collections.abc import Callable, Collection
from typing import Any

from supervisor.contract.clock import Clock
from supervisor.core.slots import Slot
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.plane import ControlPlane
from supervisor.pool.processes import send_signal


class RollingRestart:
    """The rolling restart part of `supervisor.pool.pool.Pool`."""

    log: Any
    slots: list[Slot]
    current: dict[int, WorkerHandle]
    stopping: bool
    clock: Callable[[], float]
    timer: Clock
    plane: ControlPlane

    def _spawn(self, slot: Slot, spare: bool = True) -> None: ...

    async def rolling_restart(
        self, timeout: float = 60.0, only: Collection[int] | None = None
    ) -> None:
        """Replace every worker (of the slots `only` names): new one first, sessions
        handed over at event boundaries."""
        await _rolling_restart(self, timeout, only)


async def _rolling_restart(
    pool: RollingRestart, timeout: float, only: Collection[int] | None
) -> None:
    slots = [s for s in pool.slots if only is None or s.index in only]
    pool.log.info("rolling restart of {} workers", len(slots))
    for slot in slots:
        old = pool.current.get(slot.index)
        if old is None or pool.stopping:
            continue
        old.retiring = True
        slot.exited(pool.clock(), requested=True)
        pool._spawn(slot)
        new = pool.current[slot.index]
        deadline = pool.clock() + timeout
        while not new.ready and new.alive and pool.clock() < deadline:
            await pool.timer.sleep(0.05)
        for session_id in list(old.sessions):
            pool.plane.send(old, "release", session=session_id)
        while old.sessions and old.alive and pool.clock() < deadline:
            await pool.timer.sleep(0.05)
        old.stop_requested = True
        pool.plane.send(old, "stop")
        while old.alive and pool.clock() < deadline:
            await pool.timer.sleep(0.05)
        if old.alive:
            send_signal(old.pid, signal.SIGKILL)
    pool.log.info("rolling restart done")
