"""The worker process: owns the sessions the supervisor assigns to it and runs their turns.

Started by the supervisor with the `spawn` context of `multiprocess`. It dies with the
supervisor (PR_SET_PDEATHSIG), makes its own logger, zmq context and database
connections, says `hello` (with its spawn's secret) as soon as it is connected and `ready`
when it can take sessions, and sends a heartbeat from its event loop
(a hung loop therefore goes silent, and the supervisor replaces the process).
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio
from loguru import logger

from supervisor.contract import control, fdlimit
from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, sleep_unless
from supervisor.contract.config import Config
from supervisor.contract.logs import setup_logging
from supervisor.contract.reaper import exit_if_orphaned, set_pdeathsig
from supervisor.contract.spawn import WorkerSpec
from supervisor.contract.telemetry import WORKER_FLUSH, Tracing, start_tracing
from supervisor.store import Store
from workers.agent import Agent, AgentLoadError, load_agent_class
from workers.cache import HistoryCache
from workers.context import Settings, Window
from workers.mcp_launch import launch_all
from workers.models import make_model
from workers.outage import Health
from workers.prefetch import Prefetch
from workers.restarting import TOOL as RESTART_TOOL
from workers.restarting import RestartScope
from workers.runner import SessionRunner
from workers.spawning import TOOL as SPAWN_TOOL
from workers.spawning import Limits
from workers.streaming import Piece
from workers.tasking import TOOL as TASK_TOOL
from workers.tasking import Kinds
from workers.tools import BuiltinTools, Toolbox, Toolboxes
from workers.tracing import RunTrace

DB_THREADS = 4  # the worker's threads for blocking work (each with its own connection)


class _FailingAgent:
    """Stands in for an agent that cannot be built: every turn fails, saying why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def run_turn(self, turn: Any) -> str:
        raise AgentLoadError(self.reason)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Read a future's outcome, so that a failed send nobody awaited is not reported."""
    if not future.cancelled():
        future.exception()


SHUTDOWN_MARGIN = 0.3  # seconds before the supervisor's SIGKILL deadline
STOP_WAIT = 2.0  # seconds for the cancelled tasks to unwind before the MCP teardown


def main(spec: WorkerSpec) -> None:
    """The worker process: set up, run the loop, exit."""
    set_pdeathsig(signal.SIGKILL)
    exit_if_orphaned(spec.parent_pid)
    os.environ.pop("NOTIFY_SOCKET", None)
    fdlimit.remember(spec.nofile_soft or None)  # for its MCP servers (`mcp_launch`)
    faulthandler.enable(all_threads=True)  # SIGABRT (a hang) prints every thread's stack
    config = Config.model_validate(spec.config)
    for target in config.delivery.targets:  # the supervisor signs; agents never see a key
        os.environ.pop(target.secret_env, None)
    setup_logging(config.log.level, config.log.format, process=spec.identity)
    try:
        tracing = start_tracing(config, spec.identity)
    except ValueError as exc:  # the supervisor checked it at its start: the environment changed
        logger.bind(subsystem="telemetry").error("tracing off: {}", exc)
        tracing = None
    code = asyncio.run(Worker(spec, config, tracing).run())
    # Everything is committed and closed by now; skipping the interpreter's teardown (a
    # few hundred ms of CPU per process) keeps a stop of many workers quick.
    sys.stderr.flush()
    os._exit(code)


class Worker:
    """One worker's event loop: control messages in, turns run, heartbeats out."""

    def __init__(self, spec: WorkerSpec, config: Config, tracing: Tracing | None = None) -> None:
        self.spec = spec
        self.config = config
        self.tracing = tracing  # None: tracing is off
        self.runners: dict[str, SessionRunner] = {}
        self._batch: Prefetch | None = None  # the first reads of the runners being made
        self._mcp_rows: dict[int, int] = {}
        self._stop = asyncio.Event()
        self.latency = control.Histogram(control.APPEND_BUCKETS)
        self.history = HistoryCache(config.pool.history_cache_mb * 2**20)  # session logs kept
        self.turns_served = 0  # turns this worker's runners ended since it started
        self.draining = False  # told to drain: no turn starts, the heartbeat says so
        self._beat = asyncio.Event()  # a heartbeat now, not at the next interval
        self.log = logger.bind(subsystem="worker")

    async def run(self) -> int:
        """Serve until `stop` (or the supervisor's SIGTERM); returns the exit code."""
        loop = asyncio.get_running_loop()
        # Each thread that touches the database keeps a connection open: a few threads,
        # not one per core, so several daemons fit a server's max_connections.
        loop.set_default_executor(ThreadPoolExecutor(DB_THREADS, "turnkeeper-db"))
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor decides
        # The MCP servers' processes first: their starts overlap the rest of this one.
        launched = await launch_all(self.config.mcp.servers)
        self.store = await asyncio.to_thread(
            Store,
            self.spec.db_url,
            self.config.store.synchronous,
            migrate=False,
            max_event_bytes=self.config.store.max_event_bytes,
        )
        self.agent_class = load_agent_class(self.config.agent.class_)
        self.model = make_model(self.config.model)
        self.window = Window(self.config.model.context_window)  # learned, for every session
        self.health = Health()  # the model as the turns found it, for the heartbeats
        builtin = BuiltinTools()
        self.mcp: Any = None
        boxes: list[Toolbox] = [builtin]
        if self.config.mcp.servers:
            from workers.mcp import McpTools  # the SDK costs a second to import: only if used

            self.mcp = McpTools(
                self.config.mcp.servers,
                on_start=self._mcp_started,
                on_exit=self._mcp_exited,
                reserved=[
                    *(spec.name for spec in builtin.specs()),
                    SPAWN_TOOL,
                    TASK_TOOL,
                    RESTART_TOOL,
                ],
                launched=launched,
            )
            boxes.append(self.mcp)
        self.toolbox = Toolboxes(*boxes, max_result_bytes=self.config.tools.max_result_bytes)
        agents = self.config.agent
        self._limits = Limits(
            self.config.subagents.max_depth,
            self.config.subagents.max_children,
            tuple(agents.allowed_classes()),
            self.config.subagents.max_total_per_root,
        )
        self._tasks = Kinds.of(self.config.tasks)
        self._daemon = RestartScope.of(self.spec, self.config)
        self.zmq = zmq.asyncio.Context()
        self.socket = self.zmq.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.spec.route.encode())
        self.socket.setsockopt(zmq.MAXMSGSIZE, control.MAX_FRAME)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.spec.address)
        # First on the connection: the supervisor reads nothing else from it before.
        await self.send("hello", pid=os.getpid(), secret=self.spec.secret)
        tasks = [
            spawn(self._receive(), name="receive"),
            spawn(self._heartbeat(), name="heartbeat"),
            spawn(self._renew_leases(), name="leases"),
        ]
        if self.mcp is not None:
            # Ready means its servers are up (or failed their start once): the pool gives
            # sessions only to ready workers, so a spare is warm before it takes any.
            await self.mcp.start()  # bounded by each server's start_timeout; never raises
        await self.send("ready", mcp=self._mcp_states())
        self.log.info("ready as {} (pid {})", self.spec.identity, os.getpid())
        try:
            await self._stop.wait()
        finally:
            # Every task this loop started is cancelled and awaited: the session runners
            # too, so none is left half-way through a write when the store closes.
            tasks += [runner.task for runner in self.runners.values() if runner.task]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=STOP_WAIT)
            if self.mcp is not None:
                # The supervisor gave every descendant one deadline, kill_grace from now; the
                # worker finishes with its MCP children just before it, so it exits on its own.
                await self.mcp.aclose(max(0.0, self.config.shutdown.kill_grace - SHUTDOWN_MARGIN))
            await self.model.aclose()
            self.socket.close()
            self.zmq.term()
            await asyncio.to_thread(self.store.close)
            if self.tracing is not None:
                try:  # what is queued goes now, briefly: the supervisor's deadline runs
                    await self.tracing.flush(WORKER_FLUSH)
                except TimeoutError:
                    self.log.warning("telemetry: spans still queued after {} s", WORKER_FLUSH)
        return 0

    async def send(self, type: str, **fields: Any) -> None:
        """Tell the supervisor something; never blocks the loop for long."""
        try:
            await self.socket.send(control.encode(type, worker=self.spec.identity, **fields))
        except zmq.ZMQError as exc:
            self.log.warning("control plane: cannot send {}: {}", type, exc)
        except control.ProtocolError as exc:  # a bug here; the supervisor would refuse it
            self.log.error("control plane: not sending a {} that does not fit: {}", type, exc)

    def send_delta(self, session: str, turn: str, piece: Piece) -> bool:
        """Send a turn's live output now, never waiting: False (dropped) when the queue
        to the supervisor is full. A delta is safe to lose; a turn must never wait on a
        slow reader of its output."""
        # A tool's name is the model's to make up: shown escaped and cut, as names are.
        name = piece.tool_call
        tool_call = None if name is None else control.printable(name, control.MAX_NAME)
        try:
            frame = control.encode(
                "delta",
                worker=self.spec.identity,
                session=session,
                turn=turn,
                index=piece.index,
                text=piece.text,
                tool_call=tool_call,
                elapsed=piece.elapsed,
            )
        except control.ProtocolError as exc:  # a bug here; the supervisor would refuse it
            self.log.error("control plane: not sending a delta that does not fit: {}", exc)
            return False
        try:
            sent = self.socket.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if not isinstance(sent, asyncio.Future) or not sent.done():
            # Queued behind sends that wait (the queue was full a moment ago): it goes in
            # order after them, or fails; either way nobody waits for it.
            if isinstance(sent, asyncio.Future):
                sent.add_done_callback(_retrieve)
            return True
        return sent.exception() is None

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            try:
                message = control.decode(frames, control.SUPERVISOR_MESSAGES)
            except control.ProtocolError as exc:
                self.log.error("control plane: dropped a message that does not fit: {}", exc)
                continue
            self._handle(message)

    def _handle(self, message: control.FromSupervisor) -> None:
        if isinstance(message, control.Stop):
            self._stop.set()
            return
        if isinstance(message, control.Drain):
            self._drain()
            return
        if isinstance(message, control.Assign):
            for assignment in message.sessions:
                self._assign(assignment)
            return
        runner = self.runners.get(message.session)
        if runner is None:
            return
        elif isinstance(message, control.Wake):
            runner.wake()
        elif isinstance(message, control.Release):
            runner.release()
        elif isinstance(message, control.Interrupt):
            runner.interrupt()

    def _drain(self) -> None:
        """The daemon drains: the turns in flight end, no runner starts another; the
        heartbeat says so at once, and again as each turn ends."""
        if not self.draining:
            self.log.info("draining: {} turns in flight end, no new turn starts", self._turns())
        self.draining = True
        for runner in self.runners.values():
            runner.drain()
        self._beat.set()

    def _turns(self) -> int:
        return sum(1 for r in self.runners.values() if r.in_turn)

    def _assign(self, a: control.Assignment) -> None:
        """Own the session with this token: a runner for it, or its runner re-tokened."""
        model = self.config.model
        runner = self.runners.get(a.session)
        if runner is None or runner.task is None or runner.task.done():
            runner = SessionRunner(
                a.session,
                a.token,
                a.reason,
                cause=a.cause,
                observe=self.latency.observe,
                served=self._served,
                store=self.store,
                make_agent=self._make_agent,
                model=self.model,
                toolbox=self.toolbox,
                notify=self.send,
                history=self.history,
                attempt_delays=self._attempt_delays(),
                subagents=self._limits,
                tasks=self._tasks,
                restarts=self._daemon,
                window=self.window,
                outage_budget=model.outage_budget,
                health=self.health,
                budgets=(self.config.budget.turn_tokens, self.config.budget.session_tokens),
                compaction=Settings(
                    model.max_tokens, model.context_margin, model.compaction_prompt
                ),
                prefetch=self._prefetch(a),
                send_delta=self.send_delta,
                trace=self._trace(a.session),
            )
            self.runners[a.session] = runner
            runner.trace.assignment(a.traceparent)
            if self.draining:
                runner.drain()
            runner.start()
        else:
            runner.trace.assignment(a.traceparent)
            runner.reassign(a.token, a.reason, a.cause)

    def _trace(self, session_id: str) -> RunTrace:
        """The spans of the session's runs (none while tracing is off)."""
        if self.tracing is None:
            return RunTrace(None, session_id)
        model = self.config.model
        return RunTrace(
            self.tracing,
            session_id,
            provider=model.provider,
            model=model.model if model.provider != "echo" else "echo",
            agent=self.config.agent.class_,
            server_of=self.toolbox.server_of,
        )

    def _prefetch(self, a: control.Assignment) -> Prefetch:
        """The batch that reads this session's row and log with those of every session
        assigned with it: an `assign`'s sessions are assigned one after another with no
        wait between, and the batch is read once they all are (`workers.prefetch`)."""
        if self._batch is None:
            self._batch = Prefetch(self.store)
            asyncio.get_running_loop().call_soon(self._read_batch)
        self._batch.add(a.session, a.token)
        return self._batch

    def _read_batch(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.start()

    def _attempt_delays(self) -> tuple[float, ...]:
        """The schedule a runner continues its own turns on; with `recovery.auto_continue`
        off, none: no turn is continued by itself."""
        recovery = self.config.recovery
        return tuple(recovery.attempt_delays) if recovery.auto_continue else ()

    async def _mcp_started(self, name: str, pid: int, create_time: float, pgid: int) -> None:
        row = await asyncio.to_thread(
            self.store.children.record,
            self.spec.boot_id,
            pid,
            create_time,
            "mcp",
            pgid=pgid,
            worker=self.spec.identity,
            name=name,
            host=self.spec.host_id,
        )
        self._mcp_rows[pid] = row

    async def _mcp_exited(self, name: str, pid: int) -> None:
        row = self._mcp_rows.pop(pid, None)
        if row is not None:
            await asyncio.to_thread(self.store.children.forget, [row])

    def _make_agent(self, name: str) -> Agent:
        """The session's own agent class if it names one, else the configured one.

        Only a class the operator allows (`agent.allowed`) is ever imported; a session
        naming another (written before it was taken off the list, say), or a class that
        cannot be imported or built, whatever it raises, fails its turns with the reason
        instead of taking the worker down.
        """
        spec = name or self.config.agent.class_
        if spec not in self.config.agent.allowed_classes():
            self.log.error("agent {!r} is not in agent.allowed; its turns fail", spec)
            return _FailingAgent(f"agent {spec!r} is not in agent.allowed")
        try:
            cls = self.agent_class if spec == self.config.agent.class_ else load_agent_class(spec)
            return cls()
        except AgentLoadError as exc:
            self.log.error("{}", exc)
            return _FailingAgent(f"{exc} (in the worker)")
        except BaseException as exc:  # an agent's constructor is its author's code
            self.log.opt(exception=exc).error("agent {!r} could not be built", spec)
            return _FailingAgent(f"agent {spec!r} could not be built: {type(exc).__name__}: {exc}")

    async def _heartbeat(self) -> None:
        """Alive: the turns in flight and served, each MCP server's state by name."""
        while True:
            self._beat.clear()  # before the counts: a turn that ends from here on beats again
            self._forget_finished()
            await self.send(
                "heartbeat",
                sessions=len(self.runners),
                turns=self._turns(),
                turns_served=self.turns_served,
                mcp=self._mcp_states(),
                append_latency=self.latency.take(),
                model_down_since=self.health.down_since,
                model_tokens=self.health.take(),
                model_errors=self.health.take_errors(),
                draining=self.draining,
                spans_dropped=self.tracing.take_dropped() if self.tracing is not None else 0,
            )
            await sleep_unless(SYSTEM, self.config.pool.heartbeat_interval, self._beat)

    def _mcp_states(self) -> dict[str, str]:
        """Each MCP server's state by name, as the supervisor is told it."""
        clients = self.mcp.clients if self.mcp is not None else ()
        return {client.name: client.state.reported.value for client in clients}

    def _served(self) -> None:
        """A runner ended a turn (any outcome): one more for the heartbeat's count."""
        self.turns_served += 1
        if self.draining:
            self._beat.set()  # the drain hears of every turn that ends

    def _forget_finished(self) -> None:
        for session_id, runner in list(self.runners.items()):
            if runner.task is not None and runner.task.done():
                del self.runners[session_id]

    async def _renew_leases(self) -> None:
        ttl = self.config.lease.stale_after
        while True:
            await SYSTEM.sleep(ttl / 3)
            try:
                await asyncio.to_thread(
                    self.store.leases.renew_owner,
                    self.spec.owner,
                    ttl,
                    (self.spec.host_id, self.spec.boot_id),
                )
            except Exception as exc:  # a busy database: the next round tries again
                self.log.warning("lease renewal failed: {}", exc)
