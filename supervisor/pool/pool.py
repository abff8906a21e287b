"""The worker pool: the worker processes, their slots, and what they say.

Who owns which session is `Ownership`'s (ownership.py), which carries out the plans of
`supervisor.core.engine`; the socket the workers talk to is the `ControlPlane`'s
(plane.py). The pool is one service among its peers (docs/architecture.md): what it
hears from the workers it publishes on the bus (`Committed`, `WorkerExited`), and it
wakes a session's owner when any service commits input.

When a worker dies (its process sentinel fires at once, even for SIGKILL or an OOM kill)
its sessions go to the hot spare first, and a replacement is started in the dead worker's
slot, which then becomes the spare. A worker whose event loop stops sending heartbeats is
hung: it gets SIGABRT (its traceback goes to the log) and, a second later, SIGKILL.

Nothing runs on a tick (housekeeping.py). Children are reaped on SIGCHLD: the workers by
`_bury`, once their sentinels fire; orphans adopted as the subreaper by `reap_orphans`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import multiprocess
import psutil

from supervisor.contract import control
from supervisor.contract.background import Background
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.reaper import descendants, reap_orphans, terminate
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.engine import HEARTBEATS_MISSED
from supervisor.core.slots import Slot, SlotState, all_fatal
from supervisor.core.vocabulary import AssignReason
from supervisor.pool import drain
from supervisor.pool.counting import Counts
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.housekeeping import Housekeeper
from supervisor.pool.ownership import HostView, Ownership
from supervisor.pool.plane import ControlPlane
from supervisor.pool.processes import (
    REAP_BOUND,
    check_hangs,
    describe_exit,
    resource_tracker,
    send_signal,
    slot_status,
    start_resource_tracker,
    stop_resource_tracker,
)
from supervisor.pool.recoverer import Recoverer
from supervisor.pool.requests import Requests
from supervisor.pool.resizing import Resizing
from supervisor.runtime.bus import Bus, Committed, HostsLost, TurnEnded, Woken, WorkerExited
from supervisor.runtime.service import Service, Steps
from supervisor.store import Store
from workers.entry import run_worker


class Pool(Requests, Resizing, Service):
    """The worker processes; who owns what (`ownership`) and how they talk (`plane`)."""

    name = "pool"
    needs = ("store", "recovery")
    takes = ("pool", "lease", "agent", "model", "mcp", "tools", "budget")
    drains = True

    def __init__(
        self,
        config: Config,
        store: Store,
        boot_id: str,
        address: str,
        recovery: Recoverer,
        metrics: Counts,
        *,
        bus: Bus | None = None,
        hosts: HostView | None = None,
        announce: Callable[[str], None] | None = None,
        reaped_elsewhere: dict[str, int] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.config = config
        self.bus = bus if bus is not None else Bus()
        # Children whose exit status another service reads (the task keeper's runners).
        self.reaped_elsewhere = reaped_elsewhere if reaped_elsewhere is not None else {}
        self.store = store
        self.boot_id = boot_id
        self.address = address
        self.owner_prefix = recovery.owner_prefix  # "<host>/<boot>": this boot's lease owners
        self.timer = clock
        self.clock = clock.monotonic
        self.recovery = recovery
        self.metrics = metrics
        self.slots = [Slot(i) for i in range(config.pool.workers + config.pool.spare)]
        self.current: dict[int, WorkerHandle] = {}
        self.workers: dict[str, WorkerHandle] = {}  # by name
        self.held: list[Slot] = []  # at boot: slots that start once the first worker is up
        self.retired: dict[int, int] = {}  # slots a reload retired: their last generation
        self.burying: set[int] = set()  # pids of exited workers whose status `_bury` reads
        self.holding = 0  # `orphans_held` calls under way: SIGCHLD reaps no orphan
        self.plane = ControlPlane(address, self.workers, self._handle, self._replace, self.clock)
        self.ownership = Ownership(
            config,
            store,
            recovery,
            self.workers,
            self.plane.send,
            self.clock,
            hosts=hosts,
            announce=announce,
        )
        self.stopping = False
        self.fatal = asyncio.Event()
        self.restarts = 0
        self.log = log("pool")
        self._spawn_context = multiprocess.get_context("spawn")
        self.background = Background("pool")  # handoffs, exit statuses; awaited by stop
        self._wanted = self.ownership.wanted
        self.bus.subscribe(Committed, self._committed)
        self.bus.subscribe(TurnEnded, self._turn_ended)
        self.bus.subscribe(Woken, self._woken)
        self.bus.subscribe(HostsLost, self._hosts_lost)
        self.housekeeper = Housekeeper(
            self._tend, self.ownership.dispatch, self.ownership.next_pass_in, self._wanted, clock
        )

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the control plane and start every worker."""
        self.plane.bind()
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._on_child_exit)
        # One worker first, alone: it takes the interrupted turns without sharing the CPUs
        # with the whole pool's start. The others, the spare among them, follow once it is
        # ready (or gone).
        first, *self.held = self.slots
        start_resource_tracker()  # before the first spawn would start it with our secrets
        self._spawn(first, spare=not self.held)

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"pool-receive": self.plane.receive(), "pool-housekeeping": self.housekeeper.run()}

    async def drain(self, deadline: float) -> None:
        """Let the turns in flight on this daemon's workers finish (the root caps it)."""
        await drain.drain(self, deadline - SYSTEM.monotonic())

    def reconfigure(self, config: Config) -> None:
        super().reconfigure(config)  # the slots' (Resizing)
        self.ownership.config = config

    def _turn_ended(self, event: TurnEnded) -> None:
        self.interrupt(event.session)  # its lease was revoked with what ended it

    def _hosts_lost(self, _: HostsLost) -> None:
        self.ownership.hosts_lost()

    def _woken(self, event: Woken) -> None:
        self.ownership.woken_elsewhere(event.session)  # another daemon's: ours if we own it

    def is_stopping(self) -> bool:
        """Its stop began: no slot is added, retired or restarted any more."""
        return self.stopping

    def slot_indexes(self) -> list[int]:
        return [slot.index for slot in self.slots]

    def hold_assignments(self) -> None:
        """No session is assigned from now on: only the turns in flight may end."""
        self.ownership.stopping = True

    async def stop(self, steps: Steps) -> None:
        grace = self.config.shutdown.kill_grace
        await steps.run("descendants", grace + REAP_BOUND, lambda: self.stop_descendants(grace))

    async def stop_descendants(self, grace: float) -> None:
        """Stop every descendant: SIGTERM to all at once, SIGKILL whoever is left after `grace`.

        Every descendant means the workers, their MCP servers and whatever those started,
        including processes that left their process group (this process is a subreaper,
        so orphans come to it) and members of the groups recorded for MCP servers.
        """
        self.stopping = self.ownership.stopping = True
        for slot in self.slots:
            slot.stop_requested()
        # From here on `terminate` reaps every child itself.
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        for worker in self.workers.values():
            worker.stop_requested = True
        groups = await asyncio.to_thread(self._recorded_groups)
        tracker = resource_tracker()
        procs = [p for p in descendants(os.getpid(), groups) if p.pid != tracker]
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
        self.plane.close()

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
    def assigned(self) -> dict[str, WorkerHandle]:
        """Which worker owns which session."""
        return self.ownership.assigned

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
        self.workers[worker.identity] = worker
        self.plane.admit(worker)
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_exit, worker)
        self.housekeeper.stir()  # its start timeout is a deadline of the loop
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
        self.workers.pop(worker.identity, None)
        self.burying.add(worker.pid)
        self.plane.bury(worker)
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
        self.housekeeper.stir()  # the slot's restart is a deadline of the loop
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

    def _replace(self, worker: WorkerHandle, cause: str) -> None:
        worker.replacing = True
        self.log.error(
            "worker {} (pid {}) sent a malformed message ({}); replacing it",
            worker.identity,
            worker.pid,
            cause,
        )
        send_signal(worker.pid, signal.SIGKILL)  # its sessions are adopted as after a crash

    def _handle(self, worker: WorkerHandle, message: control.FromWorker) -> None:
        now = self.clock()
        if now - worker.last_heartbeat > HEARTBEATS_MISSED * worker.heartbeat_interval:
            self._wanted.set()  # silent so long it was given nothing: it takes sessions again
        worker.last_heartbeat = now
        match message:
            case control.Hello():
                worker.hello = True
            case control.Ready() if not worker.ready:
                worker.ready = True
                worker.slot.ready(self.clock())
                self.log.info("worker {} is ready", worker.identity)
                self.held = []  # the first is up: the rest of the pool starts
                self._wanted.set()  # sessions may have waited for a worker
            case control.Heartbeat():
                worker.turns, worker.turns_served = message.turns, message.turns_served
                worker.mcp = dict(message.mcp)
                worker.model_down_since = message.model_down_since
                for kind, count in message.model_tokens.items():
                    self.metrics.model_tokens.labels(kind).inc(count)
                latency = message.append_latency
                self.metrics.append_latency.add(latency.counts, latency.sum)
            case control.Committed():
                self.bus.publish(Committed(message.session, message.seq, message.event_type))
            case control.Released() | control.LeaseLost():
                owned = self.ownership.let_go(worker, message.session)
                if owned and message.type == "released" and not self.stopping:
                    handoff = self.ownership.adopt([message.session], AssignReason.HANDOFF)
                    self.background.start(handoff)
                elif owned:
                    self._wanted.set()  # fenced out: the session may need another owner
