"""The rolling restart (a reload that changed a key the workers read, `reload --workers`):
every worker replaced, its sessions handed over at event boundaries, none lost.

Slot after slot: a new worker is started in the slot and given `timeout` to be ready;
then the old one lets go (`let_go`): it releases its sessions at their next event
boundary (`timeout` at most), is asked to stop, and has `shutdown.kill_grace` to exit
before SIGKILL. A new worker that dies before it is ready, or is not ready in time, stops
the roll: the old worker goes on in its slot, the slots after it keep theirs, and the
roll says why (a configuration the workers cannot start with replaces no one else).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Collection
from typing import Any

from supervisor.contract.clock import Clock
from supervisor.contract.config import Config
from supervisor.core.slots import Slot, SlotState
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.plane import ControlPlane
from supervisor.pool.processes import send_signal

POLL = 0.05  # seconds between looks at a worker being replaced or retired


class RollingRestart:
    """The rolling restart part of `supervisor.pool.pool.Pool`."""

    log: Any
    config: Config
    slots: list[Slot]
    current: dict[int, WorkerHandle]
    stopping: bool
    clock: Callable[[], float]
    timer: Clock
    plane: ControlPlane

    def _spawn(self, slot: Slot, spare: bool = True) -> None: ...

    async def rolling_restart(
        self, timeout: float = 60.0, only: Collection[int] | None = None
    ) -> str | None:
        """Replace every worker (of the slots `only` names): new one first, sessions
        handed over at event boundaries. None when done; else why it stopped part way."""
        return await _rolling_restart(self, timeout, only)

    async def let_go(self, worker: WorkerHandle, timeout: float) -> None:
        """Hand the worker's sessions over at their event boundaries (`timeout` at most),
        then ask it to stop; SIGKILL if it has not exited `shutdown.kill_grace` later."""
        worker.retiring = True  # takes no session from now on
        deadline = self.clock() + timeout
        for session_id in list(worker.sessions):
            self.plane.send(worker, "release", session=session_id)
        while worker.sessions and worker.alive and self.clock() < deadline:
            await self.timer.sleep(POLL)
        worker.stop_requested = True
        if not self.plane.send(worker, "stop"):  # not connected yet: it stops on SIGTERM
            send_signal(worker.pid, signal.SIGTERM)
        grace = self.config.shutdown.kill_grace
        deadline = self.clock() + grace
        while worker.alive and self.clock() < deadline:
            await self.timer.sleep(POLL)
        if worker.alive:
            self.log.warning(
                "worker {} did not stop within {:g} s (shutdown.kill_grace) of being asked "
                "to; killing it",
                worker.identity,
                grace,
            )
            send_signal(worker.pid, signal.SIGKILL)


async def _rolling_restart(
    pool: RollingRestart, timeout: float, only: Collection[int] | None
) -> str | None:
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
            await pool.timer.sleep(POLL)
        if not new.ready:
            why = "died before it was ready" if not new.alive else f"not ready in {timeout:g} s"
            if not _put_back(pool, slot, old, new):
                await pool.let_go(old, timeout)  # its slot started another meanwhile
            reason = (
                f"worker {new.identity}, replacing {old.identity}, {why}: the rolling restart "
                f"stopped there, the workers not yet replaced go on (see the log)"
            )
            pool.log.error("{}", reason)
            return reason
        await pool.let_go(old, timeout)
    pool.log.info("rolling restart done")
    return None


def _put_back(pool: RollingRestart, slot: Slot, old: WorkerHandle, new: WorkerHandle) -> bool:
    """`new` did not start: `old` goes on serving its slot, as if it had never been
    replaced (a slot record of its own, running). False if the slot has moved on (it
    started another worker meanwhile): `old` is to let go all the same."""
    if new.alive:
        new.stop_requested = True
        send_signal(new.pid, signal.SIGKILL)
    if not old.alive:
        return True  # gone too: its slot starts a worker again, as after any crash
    if pool.current.get(slot.index) not in (new, None) or slot not in pool.slots:
        return False
    kept = Slot(
        slot.index,
        slot.policy,
        state=SlotState.RUNNING,
        ready_at=pool.clock(),
        generation=slot.generation,
    )
    pool.slots[pool.slots.index(slot)] = kept
    old.slot, old.retiring = kept, False
    pool.current[slot.index] = old
    return True
