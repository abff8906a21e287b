"""The worker pool: processes and the control plane (who owns which session: ownership.py).

When a worker dies (its process sentinel fires at once, even for SIGKILL or an OOM kill)
its sessions go to the hot spare first, and a replacement is started in the dead worker's
slot, which then becomes the spare. A worker whose event loop stops sending heartbeats is
hung: it gets SIGABRT (its traceback goes to the log) and, a second later, SIGKILL.

The control plane trusts only what it handed out (see control.py): a frame from a routing
identity no worker was spawned with is dropped, and logged once per peer; a worker is read
only after a hello with its spawn's secret; a message that does not fit its schema gets
the worker that sent it replaced. Nothing a peer sends can end the receive loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import multiprocess
import multiprocess.resource_tracker
import psutil
import zmq
import zmq.asyncio

from supervisor.contract import control
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.reaper import descendants, reap_orphans, terminate
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.slots import Slot, SlotState, all_fatal
from supervisor.http.metrics import Metrics
from supervisor.pool.ownership import Ownership, Worker
from supervisor.pool.recoverer import Recoverer
from supervisor.store import Store
from workers.entry import run_worker

TICK = 0.1  # seconds between housekeeping rounds
POLL = 0.25  # seconds between database polls for sessions with work
START_TIMEOUT = 30.0  # a worker that has not said hello by then is hung
ABORT_GRACE = 1.0  # between SIGABRT (traceback) and SIGKILL for a hung worker


class Pool(Ownership):
    """The worker processes and the ROUTER they talk to; who owns what (`Ownership`)."""

    def __init__(
        self,
        config: Config,
        store: Store,
        boot_id: str,
        address: str,
        recovery: Recoverer,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.boot_id = boot_id
        self.address = address
        self.owner_prefix = recovery.owner_prefix  # "<host>/<boot>": this boot's lease owners
        self.host_prefix = recovery.host + "/"
        self.clock = clock
        self.recovery = recovery
        self.metrics = metrics
        recovery.poke = self.poke
        self.slots = [Slot(i) for i in range(config.pool.workers + config.pool.spare)]
        self.current: dict[int, Worker] = {}
        self.workers: dict[str, Worker] = {}  # by name
        self.routes: dict[bytes, Worker] = {}  # by routing identity
        self._buried: deque[bytes] = deque(maxlen=64)  # routes of workers that exited
        self.refusals = control.Refusals(clock=clock)
        self.assigned: dict[str, Worker] = {}
        self.woken: dict[str, int] = {}
        self.busy: set[str] = set()  # sessions being assigned right now
        self.stopping = False
        self.fatal = asyncio.Event()
        self.restarts = 0
        self.on_event: list[Callable[[str, dict[str, Any]], None]] = []
        self.log = log("pool")
        self._spawn_context = multiprocess.get_context("spawn")
        self.tasks: list[asyncio.Task[None]] = []  # run until stop; the daemon watches them
        self._pending: set[asyncio.Task[Any]] = set()
        self._poked = asyncio.Event()

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the control plane and start every worker."""
        self.zmq = zmq.asyncio.Context()
        self.router = self.zmq.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a connected identity stays its own
        self.router.setsockopt(zmq.MAXMSGSIZE, control.MAX_FRAME)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address.removeprefix("ipc://"), 0o600)  # in a 0700 directory
        for slot in self.slots:
            self._spawn(slot)
        self.tasks = [
            asyncio.create_task(self._receive(), name="pool-receive"),
            asyncio.create_task(self._housekeeping(), name="pool-housekeeping"),
        ]

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
            await asyncio.sleep(0.05)
        return False

    async def stop(self, grace: float) -> None:
        """Stop every descendant: SIGTERM to all at once, SIGKILL whoever is left after `grace`.

        Every descendant means the workers, their MCP servers and whatever those started,
        including processes that left their process group (this process is a subreaper,
        so orphans come to it) and members of the groups recorded for MCP servers.
        """
        self.stopping = True
        for slot in self.slots:
            slot.stop_requested()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for worker in self.workers.values():
            worker.stop_requested = True
        groups = await asyncio.to_thread(self._recorded_groups)
        tracker = _resource_tracker()
        procs = [p for p in descendants(os.getpid(), groups) if p.pid != tracker]
        report = await asyncio.to_thread(terminate, procs, grace)
        await asyncio.to_thread(_stop_resource_tracker)
        for worker in list(self.workers.values()):
            worker.process.join(timeout=0)
        self.log.info(
            "{} processes stopped in {:.2f} s: {} exited on SIGTERM, {} needed SIGKILL{}",
            len(procs),
            report.seconds,
            len(report.terminated),
            len(report.killed),
            f", {len(report.survivors)} SURVIVED" if report.survivors else "",
        )
        self.router.close()
        self.zmq.term()

    def mcp_states(self) -> dict[str, int]:
        """MCP servers of the live workers by state, as their last heartbeats said."""
        states: dict[str, int] = {}
        for worker in self.workers.values():
            for state, count in worker.mcp.items():
                states[state] = states.get(state, 0) + count
        return states

    def poke(self) -> None:
        """Dispatch now rather than at the next poll."""
        self._poked.set()

    def breaker(self) -> dict[str, Any]:
        """The breaker as recovery judged it last, for /v1/status."""
        return self.recovery.breaker_dict()

    def _recorded_groups(self) -> list[int]:
        return [c.pgid for c in self.store.children.of_boot(self.boot_id) if c.pgid]

    def status(self) -> dict[str, Any]:
        """The slots and workers, for /v1/status and `turnkeeper status`."""
        return {
            "slots": [
                {
                    "slot": s.index,
                    "state": s.state.value,
                    "worker": (w := self.current.get(s.index)) and w.identity,
                    "pid": w.pid if w else None,
                    "ready": bool(w and w.ready),
                    "spare": bool(w and w.spare),
                    "sessions": len(w.sessions) if w else 0,
                    "turns": w.turns if w else 0,
                }
                for s in self.slots
            ],
            "restarts": self.restarts,
        }

    # --- processes ------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
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
            db_url=self.store.url,
            config=self.config.model_dump(mode="json", by_alias=True),
            route=route,
            secret=secret,
        )
        process = self._spawn_context.Process(
            target=run_worker, args=(spec,), name=f"turnkeeper-{slot.identity}"
        )
        process.start()
        worker = Worker(
            slot,
            slot.identity,
            process,
            spare=spare_now < self.config.pool.spare,
            started=now,
            route=route.encode(),
            secret=secret,
            last_heartbeat=now,
        )
        self.current[slot.index] = worker
        self.workers[worker.identity] = worker
        self.routes[worker.route] = worker
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_exit, worker)
        self.log.info(
            "started worker {} (pid {}{})",
            worker.identity,
            worker.pid,
            ", spare" if worker.spare else "",
        )
        self._background(self._record_child(worker))

    async def _record_child(self, worker: Worker) -> None:
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
            )
        except (psutil.NoSuchProcess, Exception) as exc:
            self.log.warning("could not record worker {}: {}", worker.identity, exc)

    def _on_exit(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(worker.process.sentinel)
        # The sentinel fires when the child closes its pipe, a moment before it can be reaped.
        worker.process.join(timeout=1.0)
        code = worker.process.exitcode
        requested = worker.stop_requested or worker.retiring
        self.workers.pop(worker.identity, None)
        if self.routes.pop(worker.route, None) is not None:
            self._buried.append(worker.route)  # its last frames are dropped without a word
        if worker.child_row is not None:
            self._background(asyncio.to_thread(self.store.children.forget, [worker.child_row]))
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
                _describe_exit(code),
                transition.reason,
            )
            if transition.new is SlotState.FATAL:
                self.log.critical(
                    "slot {} is fatal: its worker cannot start (see above)", worker.slot.index
                )
        orphans = list(worker.sessions)
        for session_id in orphans:
            if self.assigned.get(session_id) is worker:
                del self.assigned[session_id]
        if orphans and not self.stopping:
            # Recovery decides how each goes on; the spare takes the first ones at once.
            self.recovery.died.update(orphans)
            self._poked.set()
        if all_fatal(self.slots):
            self.fatal.set()

    async def _housekeeping(self) -> None:
        next_poll = 0.0
        while True:
            now = self.clock()
            if not self.stopping:
                for slot in self.slots:
                    if slot.due(now):
                        self._spawn(slot)
            self._check_hangs(now)
            reap_orphans(w.pid for w in self.workers.values())
            if now >= next_poll or self._poked.is_set():
                self._poked.clear()
                next_poll = now + POLL
                try:
                    await self.dispatch()
                except Exception:
                    self.log.exception("dispatch failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poked.wait(), TICK)

    def _check_hangs(self, now: float) -> None:
        limit = self.config.pool.hang_timeout
        for worker in list(self.workers.values()):
            if not worker.alive or worker.stop_requested:
                continue
            silent = now - worker.last_heartbeat
            if worker.aborted_at is not None:
                if now - worker.aborted_at >= ABORT_GRACE:
                    self._signal(worker, signal.SIGKILL)
            elif silent > (limit if worker.ready else max(limit, START_TIMEOUT)):
                self.log.error(
                    "worker {} sent no heartbeat for {:.1f} s: hung; aborting it",
                    worker.identity,
                    silent,
                )
                worker.aborted_at = now
                self._signal(worker, signal.SIGABRT)

    def _signal(self, worker: Worker, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signum)

    def _background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.warning("background work failed: {!r}", exc)

    # --- control plane --------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            route, *frames = await self.router.recv_multipart()
            try:
                self._on_frames(route, frames)
            except Exception:
                self.log.exception("control plane: a message could not be handled; going on")

    def _on_frames(self, route: bytes, frames: list[bytes]) -> None:
        worker = self.routes.get(route)
        if worker is None:
            if route not in self._buried and not self.refusals.seen(route):
                reason = control.stranger(route, frames, self._secret_of)
                self._refuse(f"peer {control.printable(route)}", route, reason)
            return
        if worker.replacing:
            return
        try:
            message = control.decode(frames, control.WORKER_MESSAGES)
            control.check_sender(message, worker.identity, worker.secret, worker.pid)
        except control.ProtocolError as exc:
            if worker.hello:
                self._replace(worker, str(exc))
            else:
                self._refuse(f"worker {worker.identity}", route, f"{exc} (before its hello)")
            return
        if not worker.hello and not isinstance(message, control.Hello):
            self._refuse(f"worker {worker.identity}", route, f"a {message.type} before its hello")
            return
        self._handle(worker, message)

    def _secret_of(self, name: str) -> str | None:
        worker = self.workers.get(name)
        return worker.secret if worker is not None else None

    def _refuse(self, who: str, route: bytes, reason: str) -> None:
        unlogged = self.refusals.first(route)
        if unlogged is not None:
            self.log.warning(
                "control plane: refused {}: {}; dropping what it sends{}",
                who,
                reason,
                f" ({unlogged} more refused peers not logged)" if unlogged else "",
            )

    def _replace(self, worker: Worker, cause: str) -> None:
        worker.replacing = True
        self.log.error(
            "worker {} (pid {}) sent a malformed message ({}); replacing it",
            worker.identity,
            worker.pid,
            cause,
        )
        self._signal(worker, signal.SIGKILL)  # its sessions are adopted as after a crash

    def _handle(self, worker: Worker, message: control.FromWorker) -> None:
        worker.last_heartbeat = self.clock()
        match message:
            case control.Hello():
                worker.hello = True
            case control.Ready() if not worker.ready:
                worker.ready = True
                worker.slot.ready(self.clock())
                self.log.info("worker {} is ready", worker.identity)
            case control.Heartbeat():
                worker.turns = message.turns
                worker.mcp = dict(message.mcp)
                latency = message.append_latency
                self.metrics.append_latency.add(latency.counts, latency.sum)
            case control.Committed():
                # Only a signal: what reaches readers is read from the database.
                for callback in self.on_event:
                    callback(message.session, {"seq": message.seq, "type": message.event_type})
            case control.Released() | control.LeaseLost():
                session_id = message.session
                worker.sessions.discard(session_id)
                if self.assigned.get(session_id) is worker:
                    del self.assigned[session_id]
                    if message.type == "released" and not self.stopping:
                        self._background(self._adopt([session_id], reason="handoff"))

    def send(self, worker: Worker, type: str, **fields: Any) -> bool:
        """Send a control message; False if the worker is not connected (any more)."""
        try:
            self.router.send_multipart(
                [worker.route, control.encode(type, **fields)], flags=zmq.NOBLOCK
            )
            return True
        except zmq.ZMQError as exc:
            self.log.warning("control plane: cannot send {} to {}: {}", type, worker.identity, exc)
            return False

    # --- rolling restart ------------------------------------------------------------

    async def rolling_restart(self, timeout: float = 60.0) -> None:
        """Replace every worker: new one first, sessions handed over at event boundaries."""
        self.log.info("rolling restart of {} workers", len(self.current))
        for slot in self.slots:
            old = self.current.get(slot.index)
            if old is None or self.stopping:
                continue
            old.retiring = True
            slot.exited(self.clock(), requested=True)
            self._spawn(slot)
            new = self.current[slot.index]
            deadline = self.clock() + timeout
            while not new.ready and new.alive and self.clock() < deadline:
                await asyncio.sleep(0.05)
            for session_id in list(old.sessions):
                self.send(old, "release", session=session_id)
            while old.sessions and old.alive and self.clock() < deadline:
                await asyncio.sleep(0.05)
            old.stop_requested = True
            self.send(old, "stop")
            while old.alive and self.clock() < deadline:
                await asyncio.sleep(0.05)
            if old.alive:
                self._signal(old, signal.SIGKILL)
        self.log.info("rolling restart done")


def _resource_tracker() -> int | None:
    """The pid of multiprocess's resource tracker, a helper process that spawn starts."""
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


def _stop_resource_tracker() -> None:
    # It ignores SIGTERM by design and exits when every holder of its pipe (we and the
    # workers) has closed it; with the workers gone, closing ours ends it, and _stop reaps it.
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    with contextlib.suppress(Exception):
        tracker._stop()  # type: ignore[union-attr]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
