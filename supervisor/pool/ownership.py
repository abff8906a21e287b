"""Who owns which session: the supervisor's half of the lease protocol.

The supervisor is the only one that decides ownership. It assigns each session with work
to the least-loaded live worker under a new lease token (the spare first when a worker
died), wakes owners of new input, and moves a session whose owner stopped renewing its
lease. A turn in flight with no live owner is interrupted: recovery decides whether and
how it goes on, and a continuation is charged before the worker gets it.

`Ownership` is a part of `Pool` (see pool.py), kept apart so that either reads whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.recovery import Action, Trigger
from supervisor.core.slots import Slot
from supervisor.pool.recoverer import Judged, Recoverer
from supervisor.store import SessionInfo, SessionNotFound, Store

# The assignment reason a worker is given, by what made recovery continue the turn.
RECOVERY_REASON = {Trigger.WORKER_DEATH: "adopt"}


@dataclass(eq=False)
class Worker:
    """The supervisor's view of one worker process."""

    slot: Slot
    identity: str  # w<slot>.<generation>: its name in logs, status and lease owners
    process: Any  # multiprocess.Process
    spare: bool
    started: float
    route: bytes = field(default=b"", repr=False)  # its routing identity (control.py)
    secret: str = field(default="", repr=False)  # what its hello must carry
    hello: bool = False  # said a valid hello: its messages are read from now on
    ready: bool = False
    last_heartbeat: float = 0.0
    sessions: set[str] = field(default_factory=set)
    turns: int = 0
    retiring: bool = False  # replaced by a rolling restart; exits on request
    stop_requested: bool = False
    aborted_at: float | None = None
    child_row: int | None = None
    mcp: dict[str, int] = field(default_factory=dict)  # its MCP servers by state
    replacing: bool = False  # sent a malformed message: killed, its frames ignored

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None


class Ownership:
    """Session ownership, as a part of `Pool`, which provides these attributes."""

    config: Config
    store: Store
    recovery: Recoverer
    owner_prefix: str  # "<host>/<boot>": lease owners of this boot
    host_prefix: str
    clock: Callable[[], float]
    workers: dict[str, Worker]
    assigned: dict[str, Worker]
    woken: dict[str, int]
    busy: set[str]
    stopping: bool
    _poked: asyncio.Event
    log: Any

    def send(self, worker: Worker, type: str, **fields: Any) -> bool:
        raise NotImplementedError  # the pool's control plane

    def input(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one now."""
        owner = self.assigned.get(session_id)
        if owner is not None and owner.alive and self.send(owner, "wake", session=session_id):
            return
        self._poked.set()

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on (lazy resume)."""
        if session_id not in self.recovery.touched:
            self.recovery.touched.add(session_id)
            self._poked.set()

    def interrupt(self, session_id: str) -> None:
        """The operator ended the session's turn (already in the database): stop it now."""
        owner = self.assigned.pop(session_id, None)
        if owner is not None:
            owner.sessions.discard(session_id)
            self.send(owner, "interrupt", session=session_id)
        self._poked.set()

    async def dispatch(self) -> None:
        """Give every session with work an owner, and wake owners of new input.

        A session whose owner stopped renewing its lease (a frozen process, say) is given
        to another worker under a new token: the old owner is fenced out. A turn in flight
        with no live owner is interrupted; recovery decides whether and how it goes on.
        """
        now, sessions = await asyncio.to_thread(self._sessions_with_work)
        for info in sessions:
            owner = self.assigned.get(info.id)
            lease_live = info.lease_expires_at is not None and info.lease_expires_at >= now
            if owner is not None and owner.alive and lease_live:
                if info.pending and self.woken.get(info.id) != info.last_seq:
                    self.woken[info.id] = info.last_seq
                    self.send(owner, "wake", session=info.id)
                continue
            if owner is not None:
                owner.sessions.discard(info.id)
                del self.assigned[info.id]
                self.log.warning(
                    "{} stopped renewing the lease of session {}; moving it",
                    owner.identity,
                    info.id,
                )
            # Free, stale, or held by this host (a dead worker of ours, an earlier boot).
            # A live lease of another host is that host's to keep.
            ours = info.owner is None or info.owner.startswith(self.host_prefix)
            if info.id in self.busy or not (ours or not lease_live) or self.stopping:
                continue
            if info.active_turn_id is None:
                await self._assign(info, "new")
            else:
                await self._recover(info)

    def _sessions_with_work(self) -> tuple[float, list[SessionInfo]]:
        return self.store.now(), self.store.sessions.with_work()

    async def _recover(self, info: SessionInfo) -> None:
        recovery = self.recovery
        trigger = recovery.trigger_for(info, self.owner_prefix)
        due = recovery.waiting(info.id, recovery.clock())
        if trigger is None or due or recovery.settled(info, trigger):
            return  # left for the boot scan, the retry timer or a first touch
        if self._pick(prefer_spare=True) is None:
            return  # no worker is ready (yet): judge it when one is
        judged = await recovery.judge(info, trigger)
        action = judged.decision.action
        if action is Action.CONTINUE:
            await self._assign(info, RECOVERY_REASON.get(trigger, "restart"), judged)
        elif action is Action.DRIVE_WITH_QUEUED_MESSAGE:
            recovery.drive(info, judged)
            await self._assign(info, "new")
        else:
            await recovery.carry_out(info, judged)

    async def _adopt(self, session_ids: list[str], reason: str) -> None:
        """Hand sessions over at once (a rolling restart released them at a boundary)."""
        for session_id in session_ids:
            try:
                info = await asyncio.to_thread(self.store.sessions.get, session_id)
            except SessionNotFound:
                continue
            if info.status == "open" and (info.active_turn_id or info.pending):
                await self._assign(info, reason)

    async def _assign(self, info: SessionInfo, reason: str, judged: Judged | None = None) -> None:
        """Lease the session to the least-loaded worker and tell it.

        A continuation (`judged`) is charged in the database once a worker is found, before
        the lease: a worker that dies at once has still used up the attempt. A charge that
        no worker took is refunded.
        """
        if info.id in self.busy or self.stopping:
            return
        target = self._pick(prefer_spare=reason == "adopt")
        if target is None:
            return  # no ready worker now; the next dispatch tries again
        self.busy.add(info.id)
        try:
            if judged is not None and not await self.recovery.charge(info, judged):
                return
            lease = await asyncio.to_thread(
                self.store.leases.acquire,
                info.id,
                f"{self.owner_prefix}/{target.identity}",
                self.config.lease.stale_after,
                force=True,
            )
            if (lease is None or not target.alive) and judged is not None:
                await self.recovery.refund(info, judged)
        finally:
            self.busy.discard(info.id)
        if lease is None or not target.alive:
            return
        target.sessions.add(info.id)
        target.spare = False
        self.assigned[info.id] = target
        self.woken[info.id] = info.last_seq
        self.recovery.died.discard(info.id)
        cause = judged.decision.cause if judged is not None else None
        self.send(target, "assign", session=info.id, token=lease.token, reason=reason, cause=cause)
        log("pool", session=info.id).info(
            "assigned to {} ({}, token {})", target.identity, reason, lease.token
        )

    def _pick(self, prefer_spare: bool) -> Worker | None:
        # A worker that missed 3 heartbeats (frozen, swapping, hung) gets no new sessions.
        fresh = self.clock() - 3 * self.config.pool.heartbeat_interval
        candidates = [
            w
            for w in self.workers.values()
            if w.ready
            and w.alive
            and not w.retiring
            and not w.stop_requested
            and w.aborted_at is None
            and not w.replacing
            and w.last_heartbeat >= fresh
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.spare != prefer_spare, len(w.sessions)))
