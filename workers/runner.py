"""One session inside a worker: run its turns while the worker owns it.

The runner re-reads the session row whenever it is woken (assign, wake, the end of a
turn) and does what the row says (`supervisor.core.engine.runner_step` decides): continue
an interrupted turn, start a turn for pending input, or wait. It writes with the lease
token of its latest assignment; a token that is no longer current makes every write fail
with LeaseLost, and the runner gives up.

The session's agent is built inside the turn, after `turn_started` (or, for a
continuation, before its note): importing an agent is running code, and a worker that
dies doing so has been charged the turn's attempt, so the attempt rules bound it.
A database that takes no writes (a full disk, a server gone) stops the turn where it is;
the runner tries again with a growing delay and continues the turn when writes work.
A turn the model cut at its token limit, or failed with an error that may pass, is not
ended but continued on the attempt schedule (`workers.continuation`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import peewee
from loguru import logger

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock, sleep_unless
from supervisor.contract.sections import COMPACTION_PROMPT
from supervisor.core import autonomy, engine
from supervisor.core.backoff import Backoff
from supervisor.core.continuation import attempts_charged
from supervisor.core.engine import SessionView, Step
from supervisor.core.recovery import ATTEMPT_DELAYS
from supervisor.core.vocabulary import AssignReason, EventType, SessionKind, Writer
from supervisor.store import Lease, LeaseLost, SessionInfo, StorageUnavailable, Store
from workers import history, turns
from workers.agent import Agent
from workers.budget import Budget, spent_by
from workers.cache import HistoryCache, SessionLog
from workers.context import Compactor, Settings, Summary, Window
from workers.continuation import Continuer
from workers.desk import Notify
from workers.models import Message, Model
from workers.outage import Health, Outage, outage_since
from workers.prefetch import Prefetch
from workers.restarting import Requester, RestartScope
from workers.spawning import Limits, Spawner
from workers.streaming import LiveOutput, Piece
from workers.tasking import Kinds, Starter
from workers.tools import Toolbox
from workers.tracing import RunTrace

# The waits before trying a failed write again: 1 s, doubling, at most 30 s.
STORAGE_RETRY = Backoff(initial=1.0, factor=2.0, cap=30.0)
# What a database that takes no writes raises: our own error, or the driver's.
STORAGE_ERRORS = (StorageUnavailable, peewee.OperationalError, peewee.InterfaceError)
READ_LIMIT = 1_000_000  # events in one read: a session's whole log


class Reported(Exception):
    """The session was a subagent whose outcome went to its parent: it runs no more."""


class SessionRunner:
    """Runs the turns of one session, one at a time."""

    def __init__(
        self,
        session_id: str,
        token: int,
        reason: str,
        *,
        cause: str | None = None,
        store: Store,
        make_agent: Callable[[str], Agent],
        model: Model,
        toolbox: Toolbox,
        notify: Notify,
        history: HistoryCache | None = None,
        observe: Callable[[float], None] = lambda seconds: None,
        served: Callable[[], None] = lambda: None,
        attempt_delays: tuple[float, ...] = ATTEMPT_DELAYS,
        subagents: Limits | None = None,
        tasks: Kinds | None = None,
        restarts: RestartScope | None = None,
        window: Window | None = None,
        compaction: Settings | None = None,
        outage_budget: float = 0.0,
        health: Health | None = None,
        budgets: tuple[int, int] = (0, 0),
        clock: Clock = SYSTEM,
        prefetch: Prefetch | None = None,
        send_delta: Callable[[str, str, Piece], bool] | None = None,
        trace: RunTrace | None = None,
    ) -> None:
        self.session_id = session_id
        self.token = token
        self.reason = reason
        self.cause = cause  # what recovery found stopped the turn, for the note
        self._turn_token = token
        self._store = store
        self._make_agent = make_agent
        self._agent: Agent | None = None
        self._agent_name = ""
        self._model = model
        self._toolbox = toolbox
        self._notify = notify
        self._observe = observe  # append latency, for the metrics
        self._served = served  # a turn ended, for the worker's count of turns served
        self._woken = asyncio.Event()
        self.released = asyncio.Event()
        # The operator interrupted the turn in flight: a model call is cut, what it
        # streamed is committed, the turn ends, and the runner stops (see `interrupt`).
        self.interrupted = asyncio.Event()
        self._send_delta = send_delta  # a turn's live output, to the supervisor
        self.trace = trace if trace is not None else RunTrace(None, session_id)  # its spans
        self._context: turns.TurnContext | None = None  # the turn in flight
        self.draining = False  # the daemon drains: no turn starts (`drain`)
        # The session logs the worker keeps; a new runner reads its session's log anew.
        self._history = history if history is not None else HistoryCache()
        self._history.drop(session_id)
        self.in_turn = False
        self.task: asyncio.Task[None] | None = None
        self.log = logger.bind(subsystem="worker", session=session_id)
        self._clock = clock
        self._spawner = Spawner(
            session_id, store, lambda: self._turn_token, notify, subagents or Limits()
        )
        self._starter = Starter(
            session_id, store, lambda: self._turn_token, notify, tasks or Kinds()
        )
        self._requester = Requester(
            session_id, store, lambda: self._turn_token, notify, restarts or RestartScope()
        )
        self._ended = False  # a turn ended since the runner last found the session idle
        self._window = window if window is not None else Window(0)
        self._compaction = compaction or Settings(1024, 128, COMPACTION_PROMPT)
        self._log = SessionLog()  # the log as last read
        # The first row and log, read with the rest of its `assign` (`workers.prefetch`);
        # `_fresh` is that log, until the read after that row takes it.
        self._prefetch = prefetch
        self._fresh: SessionLog | None = None
        self._outage_budget = outage_budget
        self._budgets = budgets  # budget.turn_tokens, budget.session_tokens
        self._health = health
        self._continuer = Continuer(
            session_id,
            store=store,
            read=self._read,
            commit=self._commit,
            token=lambda: self._turn_token,
            released=self.released,
            woken=self._woken,
            delays=attempt_delays,
            clock=clock,
            log=self.log,
        )

    @property
    def in_turn(self) -> bool:
        """A turn is running: the session's cached log is not evicted meanwhile."""
        return self._in_turn

    @in_turn.setter
    def in_turn(self, value: bool) -> None:
        self._in_turn = value
        self._history.hold(self.session_id, value)

    def start(self) -> None:
        """Start the runner's task and look for work at once."""
        self.task = spawn(self._loop(), name=f"session-{self.session_id}")
        # A runner that stops (released, fenced out, failed) leaves no cached log behind.
        self.task.add_done_callback(lambda _: self._history.drop(self.session_id))
        self.wake()

    def reassign(self, token: int, reason: str, cause: str | None = None) -> None:
        """A newer assignment: write with its token from now on, and read the log anew."""
        self.token, self.reason, self.cause = token, reason, cause
        self._history.drop(self.session_id)
        self.wake()

    def wake(self) -> None:
        """Re-read the session: there may be work."""
        self._woken.set()

    def drain(self) -> None:
        """The daemon drains: the turn in flight ends, no other starts in this boot (the
        session's work waits in the database for the next)."""
        self.draining = True

    def interrupt(self) -> None:
        """The operator interrupted the turn: stop it now.

        A model call in flight is cut (its HTTP request closed), what it streamed so far
        is committed as a cut `model_response` and the turn ends `interrupted_by_operator`,
        while the lease still allows (the operator's own `turn_ended`, written first,
        fences these writes out). Any other step is cancelled where it is. Either way the
        runner stops, as the pool forgot the session.
        """
        self.interrupted.set()
        context = self._context
        if context is not None and context.asking:
            return
        if self.task is not None:
            self.task.cancel()

    def release(self) -> None:
        """Stop at the next event boundary and give the session back."""
        self.released.set()
        self._woken.set()

    async def _loop(self) -> None:
        failures = 0  # writes the database refused in a row
        try:
            while not self.released.is_set():
                await self._woken.wait()
                self._woken.clear()
                if self.released.is_set():
                    break
                try:
                    await self._run_available()
                except STORAGE_ERRORS as exc:
                    failures += 1
                    delay = STORAGE_RETRY.delay(failures)
                    self.log.error(
                        "the database takes no writes ({}); trying again in {:.0f} s",
                        " ".join(str(exc).split())[:300],
                        delay,
                    )
                    self.cause = "storage_unavailable"  # for the continuation's note
                    await self._pause(delay)
                    self._woken.set()
                    continue
                failures = 0
                if self.interrupted.is_set():
                    return  # the cut turn ended: the pool forgot the session
        except turns.TurnReleased:
            pass
        except Reported:
            await self._notify("lease_lost", session=self.session_id)  # it runs no more
            return
        except LeaseLost as exc:
            if self.interrupted.is_set():
                # The operator's `turn_ended` came first: the pool forgot the session.
                self.log.info("interrupted: the turn was ended before its cut was committed")
                return
            self.log.warning("fenced out: {}", exc)
            await self._notify("lease_lost", session=self.session_id)
            return
        except Exception:
            self.log.exception("session runner failed")
            return
        if self.released.is_set():
            await asyncio.to_thread(self._release_lease)
            await self._notify("released", session=self.session_id)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if the session is released meanwhile."""
        await sleep_unless(self._clock, seconds, self.released)

    def _release_lease(self) -> None:
        self._store.leases.release(Lease(self.session_id, "", self.token, 0.0))

    async def _run_available(self) -> None:
        # An interrupted runner starts nothing more, not even a turn for a message that
        # came meanwhile: the pool forgot the session, and its next owner runs that.
        while not (self.released.is_set() or self.interrupted.is_set()):
            token = self.token
            info = await self._row()
            if self.token != token:
                continue  # a newer assignment came during the read: the row may predate it
            step = engine.runner_step(SessionView.of(info), self.token, self.reason)
            if step is Step.LEASE_LOST:
                raise LeaseLost(self.session_id, self.token, info.lease_token)
            if step is Step.IDLE:
                if info.kind == SessionKind.SUBAGENT and self._ended:
                    await self._report()
                return
            if self.draining:
                return  # the next boot starts it, at once
            self._agent_name = info.agent
            # The turn writes with the token it started under: a newer assignment arriving
            # mid-turn fences this run out (LeaseLost) instead of lending it the new token.
            self._turn_token = self.token
            self.in_turn = True
            try:
                if step is Step.SUPERSEDE:
                    # A queued user message drives the next turn itself, with no note.
                    assert info.active_turn_id is not None
                    self.log.bind(turn=info.active_turn_id).info(
                        "a queued message supersedes turn {}", info.active_turn_id
                    )
                    await turns.supersede_turn(
                        info.active_turn_id, await self._read(), self._commit
                    )
                    turn_id, outcome = await turns.start_turn(self._commit, self._read, self._run)
                elif step is Step.CONTINUE:
                    assert info.active_turn_id is not None
                    cause = self.cause or AssignReason(self.reason).cause
                    turn_id = info.active_turn_id
                    self.log.bind(turn=turn_id).info("continuing turn {} ({})", turn_id, cause)
                    self._load_agent()  # before the note: see the module's docstring
                    outcome = await turns.resume_turn(
                        turn_id,
                        await self._read(),
                        cause,
                        self._commit,
                        self._run,
                        attempt=attempts_charged(info, turn_id) or None,
                    )
                else:
                    turn_id, outcome = await turns.start_turn(self._commit, self._read, self._run)
            except asyncio.CancelledError:
                self.log.info("turn cancelled")  # an idle runner cancelled at stop is not news
                raise
            finally:
                self.in_turn = False
                self.trace.cut("stopped")  # a run still open did not come to its end
            self._served()
            self._ended = True
            # Whatever comes next is a fresh turn or another continuation of ours.
            self.reason, self.cause = "new", None
            self.log.bind(turn=turn_id).debug("turn {} ended {}", turn_id, outcome)
            if info.kind == "autonomous":
                await self._checkpoint()

    async def _row(self) -> SessionInfo:
        """The session row: the first time, as its `assign`'s batch read it (the log read
        with it is then the next `_read`'s); else read now."""
        prefetch, self._prefetch, self._fresh = self._prefetch, None, None
        found = None if prefetch is None else await prefetch.first(self.session_id, self.token)
        if found is None:
            return await asyncio.to_thread(self._store.sessions.get, self.session_id)
        info, self._fresh = found
        return info

    async def _report(self) -> None:
        """A subagent's run is over: its outcome goes to its parent (the store decides,
        under its locks, whether it is over; the reconciler reports it if this worker dies
        first). Reported: the child session is closed and this runner ends."""
        reported = await asyncio.to_thread(
            self._store.subagents.report, self.session_id, Writer.WORKER
        )
        self._ended = False  # not before: a write that failed is tried again
        if reported is None:
            return
        self.log.info(
            "subagent {}: reported {} to {}", reported.child, reported.status, reported.parent
        )
        await self._notify(
            "committed",
            session=reported.parent,
            seq=reported.seq,
            event_type=EventType.SUBAGENT_RESULT,
        )
        raise Reported

    async def _checkpoint(self) -> None:
        """An autonomous run: record its counters; while no budget is spent, go on."""
        events = await self._read()
        progress = autonomy.progress(events, self._clock.time())
        found = autonomy.run_of(events)
        if progress is None or found is None:
            return
        at = await self._commit(EventType.CHECKPOINT, progress, None)
        if progress["stop_reason"] is not None:
            reason, done = progress["stop_reason"], progress["turns"]
            self.log.info("autonomous run stopped ({}) after {} turns", reason, done)
            return
        # Under the key recovery's resume uses (`supervisor.pool.runs`): of this prompt and
        # a resume after the same checkpoint (another daemon's scan), one is appended.
        prompt = {"text": found[0].prompt, "autonomous": True}
        await self._commit(EventType.USER_MESSAGE, prompt, None, key=f"autonomous-resume:{at}")

    async def _read(self) -> SessionLog:
        """The session's events: the log its `assign`'s batch read with the row just read,
        the cached log with the events committed after it, or the whole log read anew (the
        first read under this token, after an eviction, or when the seqs read do not follow
        on from the log's)."""
        token = self.token
        fresh, self._fresh = self._fresh, None
        if fresh is not None and fresh.token == token:
            self._history.put(self.session_id, fresh)  # read with the row just now
        log = self._history.get(self.session_id, token)
        if log is not None and log is not fresh:
            read = self._store.events.read
            new = await asyncio.to_thread(read, self.session_id, log.last_seq, READ_LIMIT)
            if not log.add(new):
                self.log.warning("a gap in the seqs after {}: reading the log anew", log.last_seq)
                log = None
        if log is None:
            log = await asyncio.to_thread(self._read_whole, token)
        self._history.put(self.session_id, log)
        self._history.trim(keep=self.session_id)
        self._log = log
        return log

    def _read_whole(self, token: int) -> SessionLog:
        """The log from the newest compaction on: what it summarized is never read."""
        newest = self._store.events.last_of(self.session_id, EventType.COMPACTION)
        found = None if newest is None else Summary.of(newest)
        after = 0 if found is None else found.to_seq
        return SessionLog(self._store.events.read(self.session_id, after, READ_LIMIT), token)

    def _load_agent(self) -> Agent:
        if self._agent is None:
            self._agent = self._make_agent(self._agent_name)
        return self._agent

    async def _run(self, turn_id: str, messages: list[Message]) -> str:
        """Run the agent on the turn; end the turn, or continue it (`workers.continuation`)."""
        agent = self._load_agent()
        # What `messages` were built of. No copy: the log grows (or is rebased) only by
        # `_read`, which no step of this run calls; the next run is handed the log anew.
        log = self._log
        base, ratio = int(log.summary is not None), log.ratio
        # A continuation's earlier events (a new turn has none in the log as read).
        this_turn = history.turn_events(log, turn_id) if log.last_started == turn_id else []
        budget = Budget(
            *self._budgets,
            max_tokens=self._compaction.max_tokens,
            earlier=spent_by(this_turn),
            session=log.session_tokens,
        )

        live = self._live_output(turn_id)

        def compactor(turn: turns.TurnContext) -> Compactor:
            return Compactor(
                events=log,
                base=base,
                window=self._window,
                settings=self._compaction,
                ask=turn.ask,
                commit=self._commit_keyed,
                turn_id=turn_id,
                ratio=ratio,
                session_tokens=log.session_tokens,
            )

        context = turns.TurnContext(
            self.session_id,
            turn_id,
            messages,
            self._model,
            self._toolbox,
            self._commit,
            self.released,
            self._spawner,
            self._starter,
            self._requester,
            compactor,
            Outage(self._outage_budget, outage_since(this_turn)),
            self._health,
            budget,
            clock=self._clock,
            live=live,
            interrupted=self.interrupted,
            trace=self.trace,
        )
        started = self._clock.time()
        self._context = context
        try:
            with self.trace.current():
                ending = await turns.agent_ending(agent, context)
        except BaseException as exc:  # released, fenced out, cancelled: the run stops here
            self.trace.cut(type(exc).__name__)
            raise
        finally:
            self._context = None
            self._streamed(turn_id, live)
        self.trace.ran(ending.outcome)
        return await self._continuer.after(turn_id, ending, started, self._run)

    def _live_output(self, turn_id: str) -> LiveOutput | None:
        """Where the turn's answers stream to as they come: the supervisor, as deltas."""
        send = self._send_delta
        if send is None:
            return None
        session_id = self.session_id
        return LiveOutput(lambda piece: send(session_id, turn_id, piece), self._clock)

    def _streamed(self, turn_id: str, live: LiveOutput | None) -> None:
        """Say what a turn's live output lost to a full queue (readers see the gaps)."""
        if live is not None and live.dropped:
            self.log.bind(turn=turn_id).info(
                "live output: {} deltas sent, {} dropped (the queue to the supervisor was full)",
                live.sent,
                live.dropped,
            )

    async def _commit_keyed(
        self, type: str, payload: dict[str, Any], turn_id: str | None, key: str | None
    ) -> int:
        return await self._commit(type, payload, turn_id, key)

    async def _commit(
        self, type: str, payload: dict[str, Any], turn_id: str | None, key: str | None = None
    ) -> int:
        now = self._clock.time()
        started = self._clock.perf_counter()
        seq = await self._store.events.append_async(
            self.session_id,
            type,
            payload,
            token=self._turn_token,
            turn_id=turn_id,
            created_at=now,
            idempotency_key=key,
        )
        self._observe(self._clock.perf_counter() - started)
        run = self.trace.committed(type, payload, turn_id, seq, self._log)
        # A signal only: whoever reads the event reads it from the database.
        await self._notify("committed", session=self.session_id, seq=seq, event_type=type, **run)
        return seq
