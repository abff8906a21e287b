"""Who owns which session: the supervisor's half of the lease protocol, carried out.

The decisions are `supervisor.core.engine.plan`'s (pure, tested on their own): which
session goes to which worker, whose owner is woken, which is moved, which interrupted
turn recovery judges, user input first and within a budget per pass. `Ownership` looks
the facts up, asks the engine, and carries the commands out: it charges a continuation
before the lease (a worker that dies at once has still used up the attempt), leases,
sends and logs.

A service of its own (docs/architecture.md), between the control plane and the pool:
it reads the live workers as the plane knows them and sends them their sessions over it;
the pool tells it of a worker's death, a release and what requests ask. Its loop runs the
dispatch passes (`housekeeping.Dispatching`: when wanted, or when time asks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core import adoption, engine
from supervisor.core.engine import Assign, Budget, Granted, Judge, Move, Next, Wake
from supervisor.core.vocabulary import AssignReason
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.housekeeping import Dispatching
from supervisor.pool.recoverer import Judged, Recoverer
from supervisor.runtime.bus import Bus, HostsLost, Woken
from supervisor.runtime.loops import QUIET, PassObserver
from supervisor.runtime.service import Service
from supervisor.store import Grant, SessionInfo, Store
from supervisor.store import Granted as GrantedLease
from supervisor.tracing import TurnTraces

Send = Callable[..., bool]  # (worker, type, **fields) -> sent
FULL_PASS = 5.0  # seconds between passes that read every session with work
# Seconds between passes when nothing asks: input written straight into the database
# (the CLI, another host's API) is found by its index of pending sessions, at no cost
# when there is none.
PROBE = 0.25
ADOPT_SLACK = 0.05  # seconds past another host's lease expiry before the pass that adopts


@dataclass(frozen=True)
class Pick:
    """A session to lease to `target`, why, and for a continuation its judgement."""

    info: SessionInfo
    target: WorkerHandle | None
    reason: AssignReason
    judged: Judged | None = None


class HostView(Protocol):
    """The daemons on the database as this one sees them (`Membership` is one)."""

    live: tuple[str, ...]  # the live hosts' ids, this one included
    adopting: bool  # False once this daemon stops: it takes no other host's session


class _Alone:
    live: tuple[str, ...] = ()
    adopting = True


class Ownership(Service):
    """Carries out the engine's plans for the live workers it is shown."""

    name = "ownership"
    needs = ("store", "recovery", "plane")
    takes = ("pool", "lease")

    def __init__(
        self,
        config: Config,
        store: Store,
        recovery: Recoverer,
        workers: Mapping[str, WorkerHandle],
        send: Send,
        clock: Clock = SYSTEM,
        budget: Budget | None = None,
        *,
        hosts: HostView | None = None,
        announce: Callable[[str], None] | None = None,
        bus: Bus | None = None,
        observer: PassObserver = QUIET,
        traces: TurnTraces | None = None,
    ) -> None:
        self.config = config
        self.traces = traces if traces is not None else TurnTraces(None)  # assignment spans
        self.store = store
        self.recovery = recovery
        self.workers = workers  # the live workers, by name (the control plane's)
        self.send = send
        self.timer = clock
        self.clock = clock.monotonic  # heartbeats, pass deadlines
        self.budget = budget or Budget()
        self.owner_prefix = recovery.owner_prefix  # "<host>/<boot>": this boot's owners
        self.host = recovery.host
        self.assigned: dict[str, WorkerHandle] = {}
        self.tokens: dict[str, int] = {}  # the lease token granted with each assignment
        # The daemons on the database that are alive (`Membership` keeps it), and how to
        # wake a session's owner on another of them (`Signals`).
        self.hosts: HostView = hosts if hosts is not None else _Alone()
        self.announce = announce
        self.woken: dict[str, int] = {}
        self.busy: set[str] = set()  # sessions being assigned right now
        self.stopping = False
        self.wanted = recovery.wanted  # set: dispatch now rather than at the next poll
        self.full_due = 0.0  # monotonic time of the next full pass
        self.probe_due = 0.0  # ... and of the next pass of any kind
        self.dispatching = Dispatching(
            self.dispatch, self.next_pass_in, self.wanted, clock, observer
        )
        if bus is not None:
            bus.subscribe(HostsLost, self._hosts_lost)
            bus.subscribe(Woken, self._woken)

    # --- as a service ---------------------------------------------------------------

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"ownership-dispatch": self.dispatching.run()}

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def held(self) -> Mapping[str, WorkerHandle]:
        """Which live worker of this daemon owns which session (a read-only view)."""
        return MappingProxyType(self.assigned)

    def want(self) -> None:
        """Run a pass now rather than when time asks (a worker became ready, or was heard
        from again after a silence)."""
        self.wanted.set()

    def hold(self) -> None:
        """No session is assigned from now on (a stop: only the turns in flight may end)."""
        self.stopping = True

    # --- what the pool and the requests tell it -------------------------------------

    def wake(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one now."""
        if self.woken_elsewhere(session_id):
            return
        self.wanted.set()
        # Its owner may be another daemon's worker (none to tell while this one is alone).
        if self.announce is not None and len(self.hosts.live) > 1:
            announce = self.announce
            task = spawn(asyncio.to_thread(announce, session_id), name="announce")
            task.add_done_callback(_announced)

    def hosts_lost(self) -> None:
        """Daemons stopped renewing: a full pass now, their expired leases are adoptable."""
        self.full_due = 0.0
        self.wanted.set()

    def _hosts_lost(self, _: HostsLost) -> None:
        self.hosts_lost()

    def _woken(self, event: Woken) -> None:
        self.woken_elsewhere(event.session)  # another daemon's: ours if we own it

    def woken_elsewhere(self, session_id: str) -> bool:
        """Input was committed for the session (by another daemon, or this one): wake its
        worker if it is ours; True if one was told."""
        owner = self.assigned.get(session_id)
        return owner is not None and owner.alive and self.send(owner, "wake", session=session_id)

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on (lazy resume)."""
        if self.recovery.touch(session_id):
            self.wanted.set()

    def interrupt(self, session_id: str) -> None:
        """The operator ended the session's turn (already in the database): stop it now."""
        owner = self.assigned.pop(session_id, None)
        self.tokens.pop(session_id, None)
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
                self.tokens.pop(session_id, None)
        if orphans and not self.stopping:
            self.recovery.died(orphans)
            self.wanted.set()

    def let_go(self, worker: WorkerHandle, session_id: str) -> bool:
        """The worker gave the session up (released, fenced out); True if it was its owner."""
        worker.sessions.discard(session_id)
        if self.assigned.get(session_id) is worker:
            del self.assigned[session_id]
            self.tokens.pop(session_id, None)
            return True
        return False

    async def dispatch(self) -> bool:
        """One pass: ask the engine what to do with every session with work, and do it;
        True when the pass's budget ran out (more is waiting: the pool passes again).

        A pass reads the sessions with pending input and those recovery has business with
        (`attention`: a worker died, a request touched it, a scan picked it), which costs
        what it returns. A full pass (`FULL_PASS` apart) reads every
        session with work: what only time reveals (a lease that ran out, an attempt come
        due) is found by it.
        """
        started = self.clock()
        full = started >= self.full_due
        if full:
            self.full_due = started + FULL_PASS
        self.probe_due = started + PROBE
        attention = self.recovery.attention_now()
        now, sessions = await asyncio.to_thread(self._sessions_with_work, full, attention)
        infos = {info.id: info for info in sessions}
        facts = engine.Facts(
            owner_prefix=self.owner_prefix,
            host_prefix=self.host + "/",
            heartbeat_interval=self.config.pool.heartbeat_interval,
            budget=self.budget,
            breaker_tripped=self.recovery.tripped(),
            stopping=self.stopping,
            live_hosts=self.hosts.live,
            adopting=self.hosts.adopting,
        )
        commands = engine.plan(
            [engine.SessionView.of(info) for info in sessions],
            {name: w.view(facts.heartbeat_interval) for name, w in self.workers.items()},
            {sid: w.identity for sid, w in self.assigned.items()},
            self.woken,
            self.recovery.remembered(),
            facts,
            now=now,
            wall=self.recovery.wall(),
            monotonic=self.clock(),
            busy=frozenset(self.busy),
            tokens=self.tokens,
        )
        if full:
            self._watch_adoptions(sessions, facts, now)
        assigns: list[Pick] = []
        judges: list[tuple[SessionInfo, Judge]] = []
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
                        if command.taken:  # it stops the turn; its writes are fenced
                            self.send(owner, "interrupt", session=info.id)
                    if command.taken and not (info.owner or "").startswith(facts.host_prefix):
                        log("pool", session=info.id).warning(
                            "another daemon took the session from {} (lease token {}): "
                            "this host was away past lease.stale_after",
                            command.worker,
                            info.lease_token,
                        )
                    elif command.renewing:
                        log("pool", session=info.id).warning(
                            "{} stopped renewing the lease; moving the session", command.worker
                        )
                case Assign():
                    assigns.append(Pick(info, self.workers.get(command.worker), command.reason))
                case Judge():
                    judges.append((info, command))
        # Whatever this pass did not get to stays in view for the next one.
        served = {c.session for c in commands if isinstance(c, Assign | Judge)}
        self.recovery.served(served, attention - served, set(infos))
        await self._assign_all(assigns)  # user input first: its own commit
        if judges:
            await self._judge_all(judges)
        spent = len(assigns) >= self.budget.assign or len(judges) >= self.budget.judge
        if spent and full:
            self.full_due = started  # what only a full pass found: the next one is full too
        return spent

    def _watch_adoptions(
        self, sessions: list[SessionInfo], facts: engine.Facts, now: float
    ) -> None:
        """Have a full pass run when the next lease of another host runs out, so a lost
        host's sessions are adopted then, not at the next `FULL_PASS`."""
        due = adoption.next_adoption(sessions, facts.host, facts.live_hosts, now)
        if due is not None:
            at = self.clock() + max(0.0, due - now) + ADOPT_SLACK
            self.full_due = min(self.full_due, at)

    def _sessions_with_work(
        self, full: bool, attention: set[str]
    ) -> tuple[float, list[SessionInfo]]:
        if full:
            return self.store.now(), self.store.sessions.with_work()
        sessions = self.store.sessions.needing_turns()
        seen = {info.id for info in sessions}
        wanted = attention - seen
        sessions += self.store.sessions.some(wanted) if wanted else []
        return self.store.now(), sessions

    def next_pass_in(self) -> float:
        """Seconds until a pass is due although nothing asked for one: the next probe for
        input written straight into the database, full pass, or attempt come due."""
        now = self.clock()
        due = min(self.probe_due, self.full_due) - now
        return max(0.0, min(due, self.recovery.next_due_in()))

    async def _judge_all(self, judges: list[tuple[SessionInfo, Judge]]) -> None:
        """Judge the sessions (their tails read in one go), then assign what continues."""
        judged = await self.recovery.judge_all([(info, c.trigger) for info, c in judges])
        picks: list[Pick] = []
        for (info, command), j in zip(judges, judged, strict=True):
            then, reason = engine.after_judgement(j.decision, command.trigger)
            target = self.workers.get(command.worker)
            if then is Next.CONTINUE:
                assert reason is not None
                picks.append(Pick(info, target, reason, j))
            elif then is Next.DRIVE:
                self.recovery.drive(info, j)
                picks.append(Pick(info, target, AssignReason.NEW))
            else:
                await self.recovery.carry_out(info, j)
        await self._assign_all(picks)

    async def adopt(self, session_ids: list[str], reason: AssignReason) -> None:
        """Hand sessions over at once (a rolling restart released them at a boundary)."""
        infos = await asyncio.to_thread(self.store.sessions.some, session_ids)
        spare = reason is AssignReason.ADOPT
        await self._assign_all(
            [Pick(info, self._choose(prefer_spare=spare), reason) for info in infos]
        )

    def _choose(self, prefer_spare: bool) -> WorkerHandle | None:
        interval = self.config.pool.heartbeat_interval  # each judged by its own (`view`)
        views = [w.view(interval) for w in self.workers.values()]
        fresh = self.clock() - engine.HEARTBEATS_MISSED * interval
        name = engine.choose(
            [v for v in views if engine.takes_sessions(v, fresh)],
            {v.name: v.sessions for v in views},
            {v.name for v in views if v.spare},
            prefer_spare=prefer_spare,
        )
        return None if name is None else self.workers[name]

    async def _assign_all(self, picks: list[Pick]) -> None:
        """Lease every picked session to its worker in ONE transaction, then tell each
        worker its sessions in one message, then log them.

        A continuation (`judged`) is charged in the same transaction, before its lease: a
        worker that dies at once has still used up the attempt. A charge no worker took is
        refunded.
        """
        picks = [
            p
            for p in picks
            if p.target is not None and p.info.id not in self.busy and not self.stopping
        ]
        if not picks:
            return
        self.busy.update(p.info.id for p in picks)
        try:
            grants = [
                Grant(
                    p.info.id,
                    f"{self.owner_prefix}/{p.target.identity}",  # type: ignore[union-attr]
                    p.info.active_turn_id if p.judged is not None else None,
                    expect=p.info.lease_token,  # a claim: no other daemon took it since
                )
                for p in picks
            ]
            results = await asyncio.to_thread(
                self.store.leases.grant,
                grants,
                self.config.lease.stale_after,
                self.host + "/",
            )
            answers: list[tuple[Pick, GrantedLease, engine.AfterGrant]] = []
            by_worker: dict[WorkerHandle, list[dict[str, Any]]] = {}
            for p, granted in zip(picks, results, strict=True):
                target = p.target
                assert target is not None
                after = engine.after_grant(
                    continuation=p.judged is not None,
                    leased=granted.lease is not None,
                    moved_on=granted.moved_on,
                    raced=granted.raced,
                    alive=target.alive,
                )
                answers.append((p, granted, after))
                if after.then is not Granted.ASSIGN:
                    continue
                assert granted.lease is not None
                target.sessions.add(p.info.id)
                target.spare = False
                self.assigned[p.info.id] = target
                self.tokens[p.info.id] = granted.lease.token
                self.woken[p.info.id] = p.info.last_seq
                cause = p.judged.decision.cause if p.judged is not None else None
                assignment = {
                    "session": p.info.id,
                    "token": granted.lease.token,
                    "reason": p.reason.value,
                    "cause": cause,
                }
                if self.traces.on:
                    assignment["traceparent"] = self.traces.assigning(
                        p.info.id, target.identity, p.reason.value, cause
                    )
                by_worker.setdefault(target, []).append(assignment)
            for worker, assigned in by_worker.items():
                self.send(worker, "assign", sessions=assigned)
            # Recovery's books and the log lines after the messages: a dead worker's k
            # sessions wait for none of the 2k lines.
            refunds: list[Pick] = []
            for p, granted, after in answers:
                if granted.raced:
                    log("pool", session=p.info.id).debug("another daemon took it first")
                if p.judged is not None:
                    if after.then is Granted.SKIPPED:
                        self.recovery.charge_skipped(p.judged)
                    elif after.charged:
                        self.recovery.charged(p.info, p.judged)
                if after.then is Granted.REFUND:
                    refunds.append(p)
                if after.then is not Granted.ASSIGN:
                    continue
                assert granted.lease is not None and p.target is not None
                self.recovery.assigned(p.info.id)
                log("pool", session=p.info.id).info(
                    "assigned to {} ({}, token {})",
                    p.target.identity,
                    p.reason.value,
                    granted.lease.token,
                )
            for p in refunds:
                assert p.judged is not None
                await self.recovery.refund(p.info, p.judged)
        finally:
            self.busy.difference_update(p.info.id for p in picks)


def _announced(task: asyncio.Future[None]) -> None:
    """A wake that could not be sent to the other daemons: their probe finds the input."""
    if not task.cancelled() and task.exception() is not None:
        log("pool").warning("could not wake the other daemons: {}", task.exception())
