"""The worker pool: the worker processes, their slots, and what they say.

Who owns which session is the `Ownership` service's (ownership.py), which carries out the
plans of `supervisor.core.engine`; the socket the workers talk to is the `ControlPlane`
service's (plane.py). The pool is one service among its peers (docs/architecture.md):
it hears the workers from the plane on the bus (`Said`, `Misbehaved`), publishes what
they commit (`Committed`, `Published`) and their deaths (`WorkerExited`), tells
ownership of a dead worker's sessions and of a release, and wakes a session's owner when
any service commits input.

When a worker dies (its process sentinel fires at once, even for SIGKILL or an OOM kill)
its sessions go to the hot spare first, and a replacement is started in the dead worker's
slot, which then becomes the spare. A worker whose event loop stops sending heartbeats is
hung: it gets SIGABRT (its traceback goes to the log) and, a second later, SIGKILL.

Nothing runs on a tick (housekeeping.py). Children are reaped on SIGCHLD: the workers by
`_bury`, once their sentinels fire; orphans adopted as the subreaper by `reap_orphans`.

A reload resizes the pool (`pool.workers`, `pool.spare`): slots added or retired, no
session lost. Growing adds slots at the end and starts their workers at once. Shrinking
retires the slots that serve least first (`retire_order`): one that gave up (FATAL), then
one waiting to start its worker again, then one whose worker is starting, then an idle
spare, then an idle worker, then the least busy; the highest index first among equals. A
retired slot's worker lets go as in the rolling restart (`let_go`), and its slot goes.
Which live workers are spares follows `pool.spare`: spares beyond it become ordinary
workers, and idle workers become spares while there are too few. A reload that replaces
the workers also starts again the slots that gave up (`revive`): what kept their workers
from starting may be fixed.

The rolling restart (a reload that changed a key the workers read, `reload --workers`)
replaces every worker, slot after slot, none of their sessions lost: a new worker is
started in the slot and given `timeout` to be ready; then the old one lets go (`let_go`):
it releases its sessions at their next event boundary (`timeout` at most), is asked to
stop, and has `shutdown.kill_grace` to exit before SIGKILL. A new worker that dies before
it is ready, or is not ready in time, stops the roll: the old worker goes on in its slot,
the slots after it keep theirs, and the roll says why (a configuration the workers cannot
start with replaces no one else).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections import Counter
from collections.abc import Collection, Coroutine, Iterator, Mapping
from typing import Any

import multiprocess
import psutil

from supervisor.contract import control, fdlimit
from supervisor.contract.background import Background
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.reaper import descendants, reap_orphans, terminate, with_descendants
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.engine import HEARTBEATS_MISSED
from supervisor.core.slots import Slot, SlotState, all_fatal
from supervisor.core.vocabulary import INPUT_EVENTS, AssignReason, EventType, McpState
from supervisor.pool import drain
from supervisor.pool.counting import Counts
from supervisor.pool.deltas import DeltaIndexes, StreamedText
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.housekeeping import Tending
from supervisor.pool.ownership import Ownership
from supervisor.pool.plane import ControlPlane, Misbehaved, Said
from supervisor.pool.processes import (
    check_hangs,
    describe_exit,
    resource_tracker,
    send_signal,
    slot_status,
    start_resource_tracker,
    stop_resource_tracker,
)
from supervisor.pool.recoverer import Recoverer
from supervisor.runtime.bus import (
    Bus,
    Committed,
    Delta,
    Published,
    Stopping,
    TurnEnded,
    WorkerExited,
)
from supervisor.runtime.service import Service, Steps
from supervisor.store import Store
from supervisor.teardown import REAP_BOUND
from supervisor.tracing import TurnTraces
from workers.entry import run_worker

POLL = 0.05  # seconds between looks at a worker being replaced or retired


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


class Pool(Service):
    """The worker processes and their slots; they talk over the `plane`, and `ownership`
    decides who owns what."""

    name = "pool"
    needs = ("store", "recovery", "plane", "ownership")
    takes = ("pool", "lease", "agent", "model", "mcp", "tools", "budget")
    drains = True

    def __init__(
        self,
        config: Config,
        store: Store,
        boot_id: str,
        recovery: Recoverer,
        plane: ControlPlane,
        ownership: Ownership,
        metrics: Counts,
        *,
        bus: Bus,
        reaped_elsewhere: dict[str, int] | None = None,
        clock: Clock = SYSTEM,
        traces: TurnTraces | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.traces = traces if traces is not None else TurnTraces(None)  # the runs' roots
        # Children whose exit status another service reads (the task keeper's runners).
        self.reaped_elsewhere = reaped_elsewhere if reaped_elsewhere is not None else {}
        self.store = store
        self.boot_id = boot_id
        self.address = plane.address
        self.owner_prefix = recovery.owner_prefix  # "<host>/<boot>": this boot's lease owners
        self.timer = clock
        self.clock = clock.monotonic
        self.recovery = recovery
        self.metrics = metrics
        self.slots = [Slot(i) for i in range(config.pool.workers + config.pool.spare)]
        self.current: dict[int, WorkerHandle] = {}
        self.workers = plane.live()  # the live workers by name: the plane admits and buries
        self.held: list[Slot] = []  # at boot: slots that start once the first worker is up
        self.retired: dict[int, int] = {}  # slots a reload retired: their last generation
        self.burying: set[int] = set()  # pids of exited workers whose status `_bury` reads
        self.holding = 0  # `orphans_held` calls under way: SIGCHLD reaps no orphan
        self.plane = plane
        self.ownership = ownership
        self.stopping = False
        self.draining = False  # the drain began: workers start no turn (`drain`)
        self.restarting = False  # a restart in place: the task runners outlive the stop
        self.fatal = asyncio.Event()
        self.restarts = 0
        self.delta_indexes = DeltaIndexes()  # of the turns streaming: gaps are lost deltas
        self.streamed = StreamedText()  # their text since the last answer: an interrupt's cut
        self.log = log("pool")
        self._spawn_context = multiprocess.get_context("spawn")
        self.background = Background("pool")  # handoffs, exit statuses; awaited by stop
        self.bus.subscribe(Said, self._said)
        self.bus.subscribe(Misbehaved, self._misbehaved)
        self.bus.subscribe(Committed, self._committed)
        self.bus.subscribe(TurnEnded, self._turn_ended)
        self.bus.subscribe(Stopping, self._stopping)
        self.tending = Tending(self._tend, clock, metrics)

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start the first worker (the others once it is ready)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._on_child_exit)
        # One worker first, alone: it takes the interrupted turns without sharing the CPUs
        # with the whole pool's start. The others, the spare among them, follow once it is
        # ready (or gone).
        first, *self.held = self.slots
        start_resource_tracker()  # before the first spawn would start it with our secrets
        self._spawn(first, spare=not self.held)

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"pool-tending": self.tending.run()}

    async def drain(self, deadline: float) -> None:
        """The drain (the root caps it): no session is assigned any more, every worker is
        told to start no turn, and it ends once each said that its turns in flight ended."""
        self.draining = True
        self.hold_assignments()
        for worker in list(self.workers.values()):
            self._tell_drain(worker)
        await drain.drain(self, deadline - SYSTEM.monotonic())

    def _tell_drain(self, worker: WorkerHandle) -> None:
        if worker.ready and not worker.replacing:
            self.plane.send(worker, "drain")

    def reconfigure(self, config: Config) -> None:
        """A reload: `config` is in force. A worker started with its heartbeat interval is
        judged by its hang timeout from now on; the others keep the pair they were started
        with until they are replaced."""
        self.config = config
        for worker in self.workers.values():
            if worker.heartbeat_interval == config.pool.heartbeat_interval:
                worker.hang_timeout = config.pool.hang_timeout
        self.tending.stir()  # a hang check may be due sooner

    def _turn_ended(self, event: TurnEnded) -> None:
        self.interrupt(event.session)  # its lease was revoked with what ended it

    def is_stopping(self) -> bool:
        """Its stop began: no slot is added, retired or restarted any more."""
        return self.stopping

    def slot_indexes(self) -> list[int]:
        return [slot.index for slot in self.slots]

    def hold_assignments(self) -> None:
        """No session is assigned from now on: only the turns in flight may end."""
        self.ownership.hold()

    async def stop(self, steps: Steps) -> None:
        grace = self.config.shutdown.kill_grace
        await steps.run("descendants", grace + REAP_BOUND, lambda: self.stop_descendants(grace))

    def _stopping(self, event: Stopping) -> None:
        self.restarting = event.restart  # a SIGTERM during a restart makes it a stop

    async def stop_descendants(self, grace: float) -> None:
        """Stop every descendant: SIGTERM to all at once, SIGKILL whoever is left after `grace`.

        Every descendant means the workers, their MCP servers and whatever those started,
        including processes that left their process group (this process is a subreaper,
        so orphans come to it) and members of the groups recorded for MCP servers. For a
        restart in place the task keeper's runners and their commands are left running:
        the next boot, the same process, adopts them (`supervisor.tasks.service`).
        """
        self.stopping = True
        self.ownership.hold()
        for slot in self.slots:
            slot.stop_requested()
        # From here on `terminate` reaps every child itself.
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        for worker in self.workers.values():
            worker.stop_requested = True
        groups = await asyncio.to_thread(self._recorded_groups)
        tracker = resource_tracker()
        procs = [p for p in descendants(os.getpid(), groups) if p.pid != tracker]
        if self.restarting and self.reaped_elsewhere:
            spared = with_descendants(self.reaped_elsewhere.values())
            procs = [p for p in procs if p.pid not in spared]
            self.log.info(
                "leaving {} task runners running for the next boot to adopt",
                len(self.reaped_elsewhere),
            )
        report = await asyncio.to_thread(terminate, procs, grace)
        await asyncio.to_thread(stop_resource_tracker)
        for worker in list(self.workers.values()):
            worker.process.join(timeout=0)
        await self.background.settle()
        self.log.info(
            "{} processes stopped in {:.2f} s: {} exited on SIGTERM, {} needed SIGKILL{}",
            len(procs),
            report.seconds,
            len(report.terminated),
            len(report.killed),
            f", {len(report.survivors)} SURVIVED" if report.survivors else "",
        )

    def mcp_states(self) -> dict[str, int]:
        """MCP servers of the live workers by state, as their last heartbeats said."""
        return dict(Counter(state for w in self.workers.values() for state in w.mcp.values()))

    def model_state(self) -> dict[str, Any]:
        """The model as the live workers' last heartbeats found it: `ok`, or
        `unavailable` since the earliest outage one of them is waiting out."""
        down = [w.model_down_since for w in self.workers.values() if w.model_down_since]
        if not down:
            return {"state": "ok", "since": None}
        return {"state": "unavailable", "since": min(down)}

    @property
    def assigned(self) -> Mapping[str, WorkerHandle]:
        """Which worker owns which session."""
        return self.ownership.held()

    def breaker(self) -> dict[str, Any]:
        """The breaker as recovery judged it last, for /v1/status."""
        return self.recovery.breaker_dict()

    def _recorded_groups(self) -> list[int]:
        return [c.pgid for c in self.store.children.of_boot(self.boot_id) if c.pgid]

    def status(self) -> dict[str, Any]:
        """The slots and workers, for /v1/status and `turnkeeper status`."""
        slots = [slot_status(s, self.current.get(s.index)) for s in self.slots]
        return {"slots": slots, "restarts": self.restarts, "model": self.model_state()}

    # --- processes ------------------------------------------------------------------

    def _spawn(self, slot: Slot, spare: bool = True) -> None:
        now = self.clock()
        slot.start(now)
        spare_now = sum(1 for w in self.current.values() if w.spare and w.alive)
        route, secret = secrets.token_hex(16), secrets.token_hex(32)
        spec = WorkerSpec(
            identity=slot.identity,
            owner=f"{self.owner_prefix}/{slot.identity}",
            address=self.address,
            parent_pid=os.getpid(),
            boot_id=self.boot_id,
            host_id=self.recovery.host,
            db_url=self.store.url,
            config=self.config.model_dump(mode="json", by_alias=True),
            route=route,
            secret=secret,
            nofile_soft=fdlimit.for_children() or 0,
        )
        process = self._spawn_context.Process(
            target=run_worker, args=(spec,), name=f"turnkeeper-{slot.identity}"
        )
        process.start()
        worker = WorkerHandle(
            slot,
            slot.identity,
            process,
            spare=spare and spare_now < self.config.pool.spare,
            started=now,
            route=route.encode(),
            secret=secret,
            last_heartbeat=now,
            heartbeat_interval=self.config.pool.heartbeat_interval,
            hang_timeout=self.config.pool.hang_timeout,
        )
        self.current[slot.index] = worker
        self.plane.admit(worker)
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_exit, worker)
        self.tending.stir()  # its start timeout is a deadline of the loop
        self.log.info(
            "started worker {} (pid {}{})",
            worker.identity,
            worker.pid,
            ", spare" if worker.spare else "",
        )
        self.background.start(self._record_child(worker))

    async def _record_child(self, worker: WorkerHandle) -> None:
        try:
            created = psutil.Process(worker.pid).create_time()
            worker.child_row = await asyncio.to_thread(
                self.store.children.record,
                self.boot_id,
                worker.pid,
                created,
                "worker",
                pgid=None,
                worker=worker.identity,
                host=self.recovery.host,
            )
        except (psutil.NoSuchProcess, Exception) as exc:
            self.log.warning("could not record worker {}: {}", worker.identity, exc)

    def _on_exit(self, worker: WorkerHandle) -> None:
        # The sentinel fired: the worker is gone, for ownership at once. Its exit status
        # comes a moment later; `_bury` reads it in a thread, and no one else may reap it.
        asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        worker.exited = True
        self.burying.add(worker.pid)
        self.plane.bury(worker)
        for session_id in worker.sessions:
            self.delta_indexes.forget(session_id)
            self.streamed.forget(session_id)
        self.ownership.orphaned(worker)
        self.bus.publish(WorkerExited(worker.identity))  # a child it ran may be over
        if worker.child_row is not None:
            self.background.start(asyncio.to_thread(self.store.children.forget, [worker.child_row]))
        self.background.start(self._bury(worker))

    async def _bury(self, worker: WorkerHandle) -> None:
        await asyncio.to_thread(worker.process.join, 1.0)
        self.burying.discard(worker.pid)
        requested = worker.stop_requested or worker.retiring
        if self.current.get(worker.slot.index) is worker:
            del self.current[worker.slot.index]
            transition = worker.slot.exited(self.clock(), requested=requested)
            if not requested:
                self.restarts += 1
            self.log.log(
                "INFO" if requested else "WARNING",
                "worker {} (pid {}) exited with {}; slot {}",
                worker.identity,
                worker.pid,
                describe_exit(worker.process.exitcode, requested),
                transition.reason,
            )
            if transition.new is SlotState.FATAL:
                self.log.critical(
                    "slot {} is fatal: its worker cannot start (see above)", worker.slot.index
                )
        self.held = []  # the first worker is gone: the others start all the same
        self.tending.stir()  # the slot's restart is a deadline of the loop
        if all_fatal(self.slots):
            self.fatal.set()

    @contextlib.contextmanager
    def orphans_held(self) -> Iterator[None]:
        """No orphan is reaped meanwhile: a child of the supervisor's that its own waiter
        reaps (a reload's agent check) may exit then. Those that exited are reaped after."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding:
                self._on_child_exit()

    def _on_child_exit(self) -> None:
        # SIGCHLD. The workers' exit statuses are `_bury`'s to read: they are kept.
        if self.holding:
            return  # `orphans_held` reaps them once it ends
        runners = self.reaped_elsewhere.values()  # the task keeper's runners: its own to reap
        reaped = reap_orphans([*(w.pid for w in self.workers.values()), *self.burying, *runners])
        if reaped:
            self.log.info("reaped exited orphans: pid {}", ", ".join(map(str, reaped)))

    def _tend(self, now: float) -> float:
        """Start the workers of slots due for a restart, abort hung ones; returns when
        either needs a look again."""
        deadline = float("inf")
        if not self.stopping:
            for slot in (s for s in self.slots if s not in self.held):
                if slot.due(now):
                    self._spawn(slot)
                elif slot.restart_at is not None:
                    deadline = min(deadline, slot.restart_at)
        return min(deadline, check_hangs(self.workers.values(), now))

    # --- what workers say -----------------------------------------------------------

    def _misbehaved(self, event: Misbehaved) -> None:
        worker, cause = event.worker, event.cause
        worker.replacing = True
        self.log.error(
            "worker {} (pid {}) sent a malformed message ({}); replacing it",
            worker.identity,
            worker.pid,
            cause,
        )
        send_signal(worker.pid, signal.SIGKILL)  # its sessions are adopted as after a crash

    def _said(self, said: Said) -> None:
        worker, message = said.worker, said.message
        now = self.clock()
        if now - worker.last_heartbeat > HEARTBEATS_MISSED * worker.heartbeat_interval:
            self.ownership.want()  # silent so long it was given nothing: it takes sessions again
        worker.last_heartbeat = now
        match message:
            case control.Hello():
                worker.hello = True
            case control.Ready() if not worker.ready:
                worker.ready = True
                worker.mcp = dict(message.mcp)
                worker.slot.ready(self.clock())
                self.log.info("worker {} is ready", worker.identity)
                self.held = []  # the first is up: the rest of the pool starts
                self.tending.stir()  # ... now, and its hang limit is the ready one's
                self.ownership.want()  # sessions may have waited for a worker
                if self.draining:
                    self._tell_drain(worker)  # a replacement, ready during the drain
            case control.Heartbeat():
                worker.turns, worker.turns_served = message.turns, message.turns_served
                worker.draining = message.draining
                worker.mcp = dict(message.mcp)
                worker.model_down_since = message.model_down_since
                for kind, count in message.model_tokens.items():
                    self.metrics.model_tokens.labels(kind).inc(count)
                for failed, count in message.model_errors.items():
                    self.metrics.model_errors.labels(failed).inc(count)
                latency = message.append_latency
                self.metrics.append_latency.add(latency.counts, latency.sum)
                if message.spans_dropped:
                    self.metrics.spans_dropped.add(message.spans_dropped)
            case control.Committed():
                self.traces.said(worker.identity, message)
                if message.event_type == EventType.TURN_ENDED:
                    self.delta_indexes.forget(message.session)
                if message.event_type in (EventType.TURN_ENDED, EventType.MODEL_RESPONSE):
                    self.streamed.answered(message.session)
                self.bus.publish(Committed(message.session, message.seq, message.event_type))
            case control.Delta():
                self._delta(worker, message)
            case control.Released() | control.LeaseLost():
                self.traces.stopped(message.session, message.type)
                self.delta_indexes.forget(message.session)
                self.streamed.forget(message.session)
                owned = self.ownership.let_go(worker, message.session)
                if owned and message.type == "released" and not self.stopping:
                    handoff = self.ownership.adopt([message.session], AssignReason.HANDOFF)
                    self.background.start(handoff)
                elif owned:
                    self.ownership.want()  # fenced out: the session may need another owner

    def _delta(self, worker: WorkerHandle, message: control.Delta) -> None:
        """A turn's live output: for the attach streams (`Delta` on the bus), if the
        sender owns the session (a worker that lost it may still be finishing a model
        call); its time to first delta and any deltas lost on the way are counted."""
        if message.session not in worker.sessions:
            return  # not its session (any more): its output is no one's to see
        missed = self.delta_indexes.missed(
            worker.identity, message.session, message.turn, message.index
        )
        if missed:
            self.metrics.deltas_dropped.labels("worker").inc(missed)
        if message.text:
            self.streamed.add(message.session, message.turn, message.text, missed=missed)
        if message.index == 0:
            self.metrics.first_delta.observe(message.elapsed)
        self.bus.publish(
            Delta(message.session, message.turn, message.index, message.text, message.tool_call)
        )

    # --- what requests and the other services tell it about sessions ----------------

    def wake(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one."""
        self.ownership.wake(session_id)

    def _committed(self, event: Committed) -> None:
        """An event was committed (only a signal: readers read it from the database); its
        readers hear of it, and new input (a subagent's task, or its result) wakes its
        session's owner."""
        self.bus.publish(Published(event.session, {"seq": event.seq, "type": event.event_type}))
        if event.wake and event.event_type in INPUT_EVENTS:
            self.wake(event.session)

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on."""
        self.ownership.touch(session_id)

    def streamed_so_far(self, session_id: str) -> tuple[str, str, bool] | None:
        """What the session's turn in flight streamed since its last committed answer."""
        return self.streamed.get(session_id)

    def interrupt(self, session_id: str) -> None:
        """The session's turn was ended in the database (interrupt, close): stop it now."""
        self.ownership.interrupt(session_id)

    # --- a reload: resized, revived, rolled (see the module's docstring) ------------

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
        self.tending.stir()

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

    def mcp_not_started(self, indexes: Collection[int]) -> list[tuple[str, str, str]]:
        """The MCP servers of the ready workers in these slots that are not ready:
        (worker, server, state) each. A worker is ready once each of its servers is ready
        or failed its start once, so these are the ones that did not start."""
        found = []
        for index in sorted(indexes):
            worker = self.current.get(index)
            if worker is not None and worker.ready:
                found += [
                    (worker.identity, name, state)
                    for name, state in worker.mcp.items()
                    if state != McpState.READY
                ]
        return found

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

    async def rolling_restart(
        self, timeout: float = 60.0, only: Collection[int] | None = None
    ) -> str | None:
        """Replace every worker (of the slots `only` names): new one first, sessions
        handed over at event boundaries. None when done; else why it stopped part way."""
        slots = [s for s in self.slots if only is None or s.index in only]
        self.log.info("rolling restart of {} workers", len(slots))
        for slot in slots:
            old = self.current.get(slot.index)
            if old is None or self.stopping:
                continue
            old.retiring = True
            slot.exited(self.clock(), requested=True)
            self._spawn(slot)
            new = self.current[slot.index]
            deadline = self.clock() + timeout
            while not new.ready and new.alive and self.clock() < deadline:
                await self.timer.sleep(POLL)
            if not new.ready:
                why = "died before it was ready" if not new.alive else f"not ready in {timeout:g} s"
                if not self._put_back(slot, old, new):
                    await self.let_go(old, timeout)  # its slot started another meanwhile
                reason = (
                    f"worker {new.identity}, replacing {old.identity}, {why}: the rolling "
                    f"restart stopped there, the workers not yet replaced go on (see the log)"
                )
                self.log.error("{}", reason)
                return reason
            await self.let_go(old, timeout)
        self.log.info("rolling restart done")
        return None

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

    def _put_back(self, slot: Slot, old: WorkerHandle, new: WorkerHandle) -> bool:
        """`new` did not start: `old` goes on serving its slot, as if it had never been
        replaced (a slot record of its own, running). False if the slot has moved on (it
        started another worker meanwhile): `old` is to let go all the same."""
        if new.alive:
            new.stop_requested = True
            send_signal(new.pid, signal.SIGKILL)
        if not old.alive:
            return True  # gone too: its slot starts a worker again, as after any crash
        if self.current.get(slot.index) not in (new, None) or slot not in self.slots:
            return False
        kept = Slot(
            slot.index,
            slot.policy,
            state=SlotState.RUNNING,
            ready_at=self.clock(),
            generation=slot.generation,
        )
        self.slots[self.slots.index(slot)] = kept
        old.slot, old.retiring = kept, False
        self.current[slot.index] = old
        return True
