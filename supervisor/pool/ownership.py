"""Who owns which session: the supervisor's half of the lease protocol, carried out.

The decisions are `supervisor.core.engine.plan`'s (pure, tested on their own): which
session goes to which worker, whose owner is woken, which is moved, which interrupted
turn recovery judges, user input first and within a budget per pass. `Ownership` looks
the facts up, asks the engine, and carries the commands out: it charges a continuation
before the lease (a worker that dies at once has still used up the attempt), leases,
sends and logs.

The pool holds one `Ownership` and hands it the workers it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core import engine
from supervisor.core.engine import Assign, Budget, Judge, Move, Next, Wake
from supervisor.core.slots import Slot
from supervisor.core.vocabulary import AssignReason
from supervisor.pool.recoverer import Judged, Recoverer
from supervisor.store import SessionInfo, SessionNotFound, Store

Send = Callable[..., bool]  # (worker, type, **fields) -> sent


@dataclass(eq=False)
class WorkerHandle:
    """The supervisor's view of one worker process."""

    slot: Slot
    identity: str  # w<slot>.<generation>: its name in logs, status and lease owners
    process: Any  # multiprocess.Process
    spare: bool
    started: float
    route: bytes = field(default=b"", repr=False)  # its routing identity (plane.py)
    secret: str = field(default="", repr=False)  # what its hello must carry
    hello: bool = False  # said a valid hello: its messages are read from now on
    ready: bool = False
    last_heartbeat: float = 0.0
    sessions: set[str] = field(default_factory=set)
    turns: int = 0  # in flight, as its last heartbeat said
    turns_served: int = 0  # ended since it started, as its last heartbeat said
    retiring: bool = False  # replaced by a rolling restart; exits on request
    stop_requested: bool = False
    aborted_at: float | None = None
    child_row: int | None = None
    mcp: dict[str, str] = field(default_factory=dict)  # its MCP servers' states by name
    replacing: bool = False  # sent a malformed message: killed, its frames ignored
    exited: bool = False  # its sentinel fired: gone, whether reaped yet or not

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def alive(self) -> bool:
        return not self.exited and self.process.exitcode is None

    def view(self) -> engine.WorkerView:
        """What the ownership engine reads of it."""
        return engine.WorkerView(
            name=self.identity,
            ready=self.ready,
            alive=self.alive,
            spare=self.spare,
            sessions=len(self.sessions),
            last_heartbeat=self.last_heartbeat,
            retiring=self.retiring,
            stop_requested=self.stop_requested,
            aborted=self.aborted_at is not None,
            replacing=self.replacing,
        )


class Ownership:
    """Carries out the engine's plans for the workers it is handed."""

    def __init__(
        self,
        config: Config,
        store: Store,
        recovery: Recoverer,
        workers: dict[str, WorkerHandle],
        send: Send,
        clock: Callable[[], float],
        budget: Budget | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.recovery = recovery
        self.workers = workers  # the pool's, by name
        self.send = send
        self.clock = clock  # monotonic: heartbeats
        self.budget = budget or Budget()
        self.owner_prefix = recovery.owner_prefix  # "<host>/<boot>": this boot's owners
        self.assigned: dict[str, WorkerHandle] = {}
        self.woken: dict[str, int] = {}
        self.busy: set[str] = set()  # sessions being assigned right now
        self.stopping = False
        self.wanted = recovery.wanted  # set: dispatch now rather than at the next poll

    def wake(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one now."""
        owner = self.assigned.get(session_id)
        if owner is not None and owner.alive and self.send(owner, "wake", session=session_id):
            return
        self.wanted.set()

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on (lazy resume)."""
        if self.recovery.touch(session_id):
            self.wanted.set()

    def interrupt(self, session_id: str) -> None:
        """The operator ended the session's turn (already in the database): stop it now."""
        owner = self.assigned.pop(session_id, None)
        if owner is not None:
            owner.sessions.discard(session_id)
            self.send(owner, "interrupt", session=session_id)
        self.wanted.set()

    def orphaned(self, worker: WorkerHandle) -> None:
        """The worker exited: its sessions are free; recovery decides how each goes on."""
        orphans = list(worker.sessions)
        for session_id in orphans:
            if self.assigned.get(session_id) is worker:
                del self.assigned[session_id]
        if orphans and not self.stopping:
            self.recovery.died(orphans)
            self.wanted.set()

    def let_go(self, worker: WorkerHandle, session_id: str) -> bool:
        """The worker gave the session up (released, fenced out); True if it was its owner."""
        worker.sessions.discard(session_id)
        if self.assigned.get(session_id) is worker:
            del self.assigned[session_id]
            return True
        return False

    async def dispatch(self) -> None:
        """One pass: ask the engine what to do with every session with work, and do it."""
        now, sessions = await asyncio.to_thread(self._sessions_with_work)
        infos = {info.id: info for info in sessions}
        facts = engine.Facts(
            owner_prefix=self.owner_prefix,
            host_prefix=self.recovery.host + "/",
            heartbeat_interval=self.config.pool.heartbeat_interval,
            budget=self.budget,
            breaker_tripped=self.recovery.breaker.tripped,
            stopping=self.stopping,
        )
        commands = engine.plan(
            [engine.SessionView.of(info) for info in sessions],
            {name: w.view() for name, w in self.workers.items()},
            {sid: w.identity for sid, w in self.assigned.items()},
            self.woken,
            self.recovery.memory,
            facts,
            now=now,
            wall=self.recovery.clock(),
            monotonic=self.clock(),
            busy=frozenset(self.busy),
        )
        for command in commands:
            info = infos[command.session]
            match command:
                case Wake():
                    owner = self.workers.get(command.worker)
                    if owner is not None and self.send(owner, "wake", session=info.id):
                        self.woken[info.id] = command.seq
                case Move():
                    owner = self.assigned.get(info.id)
                    if owner is not None and owner.identity == command.worker:
                        self.let_go(owner, info.id)
                    if command.renewing:
                        log("pool", session=info.id).warning(
                            "{} stopped renewing the lease; moving the session", command.worker
                        )
                case Assign():
                    await self._assign(info, self.workers.get(command.worker), command.reason)
                case Judge():
                    await self._judge(info, command)

    def _sessions_with_work(self) -> tuple[float, list[SessionInfo]]:
        return self.store.now(), self.store.sessions.with_work()

    async def _judge(self, info: SessionInfo, command: Judge) -> None:
        judged = await self.recovery.judge(info, command.trigger)
        then, reason = engine.after_judgement(judged.decision, command.trigger)
        target = self.workers.get(command.worker)
        if then is Next.CONTINUE:
            assert reason is not None
            await self._assign(info, target, reason, judged)
        elif then is Next.DRIVE:
            self.recovery.drive(info, judged)
            await self._assign(info, target, AssignReason.NEW)
        else:
            await self.recovery.carry_out(info, judged)

    async def adopt(self, session_ids: list[str], reason: AssignReason) -> None:
        """Hand sessions over at once (a rolling restart released them at a boundary)."""
        for session_id in session_ids:
            try:
                info = await asyncio.to_thread(self.store.sessions.get, session_id)
            except SessionNotFound:
                continue
            if info.status == "open" and (info.active_turn_id or info.pending):
                spare = reason is AssignReason.ADOPT
                await self._assign(info, self._choose(prefer_spare=spare), reason)

    def _choose(self, prefer_spare: bool) -> WorkerHandle | None:
        views = [w.view() for w in self.workers.values()]
        fresh = self.clock() - engine.HEARTBEATS_MISSED * self.config.pool.heartbeat_interval
        name = engine.choose(
            [v for v in views if engine.takes_sessions(v, fresh)],
            {v.name: v.sessions for v in views},
            {v.name for v in views if v.spare},
            prefer_spare=prefer_spare,
        )
        return None if name is None else self.workers[name]

    async def _assign(
        self,
        info: SessionInfo,
        target: WorkerHandle | None,
        reason: AssignReason,
        judged: Judged | None = None,
    ) -> None:
        """Lease the session to `target` and tell it.

        A continuation (`judged`) is charged in the database before the lease: a worker
        that dies at once has still used up the attempt. A charge no worker took is
        refunded.
        """
        if target is None or info.id in self.busy or self.stopping:
            return
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
        self.recovery.assigned(info.id)
        cause = judged.decision.cause if judged is not None else None
        self.send(
            target, "assign", session=info.id, token=lease.token, reason=reason.value, cause=cause
        )
        log("pool", session=info.id).info(
            "assigned to {} ({}, token {})", target.identity, reason.value, lease.token
        )
