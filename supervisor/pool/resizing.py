"""The pool resized by a reload (`pool.workers`, `pool.spare`): slots added or retired,
no session lost.

Growing adds slots at the end and starts their workers at once. Shrinking retires the
highest slots the way the rolling restart retires a worker: its sessions are released at
their next event boundary and handed over to the other workers, then it is asked to stop
(SIGKILL if it has not exited by the timeout), and its slot goes. Which live workers are
spares follows `pool.spare`: spares beyond it become ordinary workers, and idle workers
become spares while there are too few.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from supervisor.contract.clock import Clock
from supervisor.contract.config import Config
from supervisor.core.slots import Slot, SlotState
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.housekeeping import Housekeeper
from supervisor.pool.plane import ControlPlane
from supervisor.pool.processes import send_signal

POLL = 0.05  # seconds between looks at a retiring worker


class Resizing:
    """The resizing part of `supervisor.pool.pool.Pool`."""

    log: Any
    config: Config
    slots: list[Slot]
    held: list[Slot]
    retired: dict[int, int]  # a retired slot's index -> its last generation
    current: dict[int, WorkerHandle]
    stopping: bool
    clock: Callable[[], float]
    timer: Clock
    plane: ControlPlane
    housekeeper: Housekeeper

    def _spawn(self, slot: Slot, spare: bool = True) -> None: ...

    def grow(self) -> list[int]:
        """Add the slots `pool.workers + pool.spare` asks for beyond those there are and
        start their workers (spares first, while there are too few); returns their
        indexes."""
        wanted = self.config.pool.workers + self.config.pool.spare
        added = []
        while len(self.slots) < wanted and not self.stopping:
            index = max((s.index for s in self.slots), default=-1) + 1
            # A slot added again goes on counting: no two workers of a boot share a name.
            slot = Slot(index, generation=self.retired.pop(index, 0))
            self.slots.append(slot)
            self._spawn(slot)
            added.append(slot.index)
        if added:
            self.log.info("slot {} added: the pool has {} now", added, len(self.slots))
        self.settle_spares()
        return added

    async def shrink(self, timeout: float = 60.0) -> list[int]:
        """Retire the highest slots beyond `pool.workers + pool.spare`, one after another;
        returns their indexes."""
        wanted = self.config.pool.workers + self.config.pool.spare
        extra = sorted(self.slots, key=lambda s: s.index)[wanted:]
        for slot in reversed(extra):
            await self._retire(slot, timeout)
        if extra:
            retired = [s.index for s in extra]
            self.log.info("slot {} retired: the pool has {} now", retired, len(self.slots))
        self.settle_spares()
        return [s.index for s in extra]

    async def _retire(self, slot: Slot, timeout: float) -> None:
        slot.stop_requested()  # its worker's exit is final: the slot is not started again
        worker = self.current.get(slot.index)
        if worker is not None and worker.alive:
            worker.retiring = True  # takes no session from now on
            deadline = self.clock() + timeout
            for session_id in list(worker.sessions):
                self.plane.send(worker, "release", session=session_id)
            while worker.sessions and worker.alive and self.clock() < deadline:
                await self.timer.sleep(POLL)
            worker.stop_requested = True
            if not self.plane.send(worker, "stop"):  # not connected yet: it stops on SIGTERM
                send_signal(worker.pid, signal.SIGTERM)
            while worker.alive and self.clock() < deadline:
                await self.timer.sleep(POLL)
            if worker.alive:
                self.log.warning(
                    "worker {} did not stop within {:g} s of its slot's retirement; killing it",
                    worker.identity,
                    timeout,
                )
                send_signal(worker.pid, signal.SIGKILL)
        if slot in self.held:
            self.held.remove(slot)
        self.slots.remove(slot)
        self.retired[slot.index] = slot.generation
        self.housekeeper.stir()

    def settle_spares(self) -> None:
        """Mark as many live workers spare as `pool.spare` says: extras first become
        ordinary workers (highest slot first), then idle workers become spares."""
        live = sorted(
            (w for w in self.current.values() if w.alive and not (w.retiring or w.stop_requested)),
            key=lambda w: w.slot.index,
        )
        spares = [w for w in live if w.spare]
        wanted = self.config.pool.spare
        for worker in spares[wanted:]:
            worker.spare = False
        idle = [w for w in live if not w.spare and not w.sessions]
        for worker in idle[: max(0, wanted - len(spares))]:
            worker.spare = True

    async def settled(self, indexes: list[int], timeout: float = 60.0) -> bool:
        """Wait until the workers of these slots are ready (or their slots gave up); True
        if they all are ready in time."""
        deadline = self.clock() + timeout
        while self.clock() < deadline and not self.stopping:
            slots = [s for s in self.slots if s.index in indexes]
            ready = [(w := self.current.get(s.index)) is not None and w.ready for s in slots]
            if all(ready):
                return True
            if all(r or s.state is SlotState.FATAL for r, s in zip(ready, slots, strict=True)):
                return False
            await self.timer.sleep(POLL)
        return False
