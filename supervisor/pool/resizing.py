"""The pool resized by a reload (`pool.workers`, `pool.spare`): slots added or retired,
no session lost; and the waits on the slots' workers being ready.

Growing adds slots at the end and starts their workers at once. Shrinking retires the
slots that serve least first (`retire_order`): one that gave up (FATAL), then one waiting
to start its worker again, then one whose worker is starting, then an idle spare, then
an idle worker, then the least busy; the highest index first among equals. A retired
slot's worker lets go as in the rolling restart (`RollingRestart.let_go`: its sessions
handed over at event boundaries, then asked to stop, SIGKILL after
`shutdown.kill_grace`), and its slot goes. Which live workers are spares follows
`pool.spare`: spares beyond it become ordinary workers, and idle workers become spares
while there are too few. A reload that replaces the workers also starts again the slots
that gave up (`revive`): what kept their workers from starting may be fixed.
"""

from __future__ import annotations

import asyncio

from supervisor.contract.config import Config
from supervisor.core.slots import Slot, SlotState
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.housekeeping import Housekeeper
from supervisor.pool.rolling import POLL, RollingRestart


def retire_order(slot: Slot, worker: WorkerHandle | None) -> tuple[int, int, int]:
    """Sorts the slots a shrink retires first first (the module's docstring)."""
    if slot.state is SlotState.FATAL:
        rank = 0
    elif worker is None or not worker.alive:
        rank = 1  # waiting to start its worker again (or held at boot)
    elif not worker.ready:
        rank = 2
    elif not worker.sessions:
        rank = 3 if worker.spare else 4
    else:
        rank = 5
    return rank, len(worker.sessions) if worker is not None else 0, -slot.index


class Resizing(RollingRestart):
    """The resizing part of `supervisor.pool.pool.Pool` (a retired slot's worker lets go
    as the rolling restart's do)."""

    held: list[Slot]
    retired: dict[int, int]  # a retired slot's index -> its last generation
    workers: dict[str, WorkerHandle]
    fatal: asyncio.Event
    housekeeper: Housekeeper

    def reconfigure(self, config: Config) -> None:
        """A reload: `config` is in force. A worker started with its heartbeat interval is
        judged by its hang timeout from now on; the others keep the pair they were started
        with until they are replaced."""
        self.config = config
        for worker in self.workers.values():
            if worker.heartbeat_interval == config.pool.heartbeat_interval:
                worker.hang_timeout = config.pool.hang_timeout
        self.housekeeper.stir()  # a hang check may be due sooner

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
        """Retire the slots beyond `pool.workers + pool.spare`, those that serve least
        first, one after another; returns their indexes, in that order."""
        wanted = self.config.pool.workers + self.config.pool.spare
        ordered = sorted(self.slots, key=lambda s: retire_order(s, self.current.get(s.index)))
        extra = ordered[: max(0, len(self.slots) - wanted)]
        for slot in extra:
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
            await self.let_go(worker, timeout)
        if slot in self.held:
            self.held.remove(slot)
        self.slots.remove(slot)
        self.retired[slot.index] = slot.generation
        self.housekeeper.stir()

    def revive(self) -> list[int]:
        """Start the workers of the slots that gave up (FATAL) again, each slot afresh;
        returns their indexes."""
        revived = []
        for position, slot in enumerate(self.slots):
            if slot.state is SlotState.FATAL and not self.stopping:
                fresh = Slot(slot.index, slot.policy, generation=slot.generation)
                self.slots[position] = fresh
                self._spawn(fresh)
                revived.append(slot.index)
        if revived:
            self.log.info("slot {} gave up before: its worker is started again", revived)
            self.settle_spares()
        return revived

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

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until every slot has a ready worker or is fatal; True if any is ready."""
        deadline = self.clock() + timeout
        while self.clock() < deadline:
            settled = [
                s.state is SlotState.FATAL
                or ((w := self.current.get(s.index)) is not None and w.ready)
                for s in self.slots
            ]
            if all(settled):
                return not self.fatal.is_set()
            await self.timer.sleep(POLL)
        return False
