"""Recovery at work: the breaker, the boot scan and the passes after it, and each
decision carried out.

The rules live in `supervisor.core` (pure code, tested on their own): `breaker`,
`recovery` (the decision table), `pacing` (how many a pass continues, and when the next
comes), `tail` (how a turn stands) and `engine` (when the pool asks for a judgement).
This module looks the facts up, asks those rules, does what they say and logs every
decision under subsystem `recovery` with the session id and reason.
What it remembers of a session during a boot is one `engine.Memory` record, kept by
`engine.Recollection` and changed only through its event methods.

Who triggers what:
- the pool, when the engine plans a `Judge` (a worker of this boot died, a user message
  is queued, a request touched the session, or the boot scan or retry timer picked it);
- the boot scan, once the HTTP listener is up: sessions interrupted before this boot that
  nobody touches, oldest first, at most `max_per_pass`, written to the boot row first;
- the paced passes: while a pass left some, the next comes `pass_interval` after it, so
  a backlog is worked off at `max_per_pass` a pass; else the retry timer's, every
  `retry_interval`: the same guarded pass;
- the breaker loop, every few seconds: re-reads the boot log, so the breaker clears when
  the window drains or after `turnkeeper breaker reset`, and then has the pass that it
  held back run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core import breaker, engine, pacing, recovery
from supervisor.core import breaker as breakers
from supervisor.core.engine import Memory, SessionView
from supervisor.core.notices import notice
from supervisor.core.recovery import Action, Decision, Interruption, Trigger
from supervisor.core.vocabulary import SessionKind
from supervisor.pool.counting import Counts
from supervisor.pool.runs import Resumer
from supervisor.runtime.loops import Wake, reconcile
from supervisor.runtime.service import Service
from supervisor.store import EventRecord, SessionInfo, Store
from supervisor.subagents import rules as subagents

NOT_EVALUATED = "not evaluated yet"
BREAKER_CHECK = 2.0  # seconds between readings of the boot log
TAIL_EVENTS = 200  # events read to classify a turn's tail


@dataclass(frozen=True)
class Judged:
    """A decision with the facts it was made from."""

    decision: Decision
    facts: Interruption
    trigger: Trigger


GiveUp = Callable[[SessionInfo, Judged], Awaitable[None]]


class Recoverer(Service):
    """Carries out recovery decisions for one boot of the daemon. As a service it starts
    before the pool (the breaker read, the boot log pruned); its passes are
    `RecoveryPasses`', which start once the HTTP listener is up."""

    name = "recovery"
    needs = ("store", "host")
    takes = ("recovery", "subagents")

    def __init__(
        self,
        config: Config,
        store: Store,
        boot_id: str,
        host: str,
        metrics: Counts,
        *,
        give_up: GiveUp | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.configure(config)
        # Gives up on a child's turn (`supervisor.subagents.service.ChildEnding`).
        self.give_up = give_up
        self.store = store
        self.boot_id = boot_id
        self._host = host
        self.metrics = metrics
        # Decisions compare with events' times, which workers stamp from the wall clock;
        # the breaker reads boot rows, stamped by the database clock, in a thread.
        self.timer = clock  # the breaker loop's and the retry timer's waits
        self.clock = clock.time
        self.breaker = breaker.BreakerState(False, 0, NOT_EVALUATED)
        # What this boot remembers of each session, and which a pass must read by id.
        self.recollection = engine.Recollection()
        self.attempted: list[str] = []  # this boot's `attempted` list, as written
        # When the next boot scan or retry pass is due (monotonic time), and what wakes
        # the loop that runs them (`_paced_loop`) when that changes.
        self.pacer = pacing.Pacer(self.pace, clock.monotonic())
        self.paced = Wake()
        # Set when recovery has work for the pool (picked sessions, a resumed run): the
        # pool's dispatch waits on it.
        self.wanted = asyncio.Event()
        self.runs = Resumer(store, metrics, self.clock, self.recollection.quieted, self.wanted)
        self.log = log("recovery")
        self._booted = False  # the boot scan has run (the breaker loop's first pass)

    def configure(self, config: Config) -> None:
        """Take `config`'s settings: at the start, and on a reload."""
        self.config = config
        self.settings = s = config.recovery
        self.pace = pacing.Pace(s.max_per_pass, s.pass_interval, s.retry_interval)
        if hasattr(self, "pacer"):  # a reload
            self.pacer.reconfigure(self.pace)
        sub = config.subagents  # children are judged on their own freshness and attempts
        self.child_settings = subagents.Settings(
            config.recovery.auto_continue,
            config.recovery.attempt_delays,
            sub.freshness,
            sub.max_recoveries,
        )

    # --- background work ------------------------------------------------------------

    @property
    def host(self) -> str:
        """This daemon's host id."""
        return self._host

    @property
    def owner_prefix(self) -> str:
        """ "<host>/<boot8>": what this boot's workers' lease owners begin with."""
        return f"{self._host}/{self.boot_id[:8]}"

    # --- the breaker (the rules are `supervisor.core.breaker`'s) ---------------------

    def evaluate_breaker(self) -> breakers.BreakerState:
        """Read this host's boot log and judge the breaker (blocking; run in a thread)."""
        s = self.settings
        now = SYSTEM.time()
        try:
            now = self.store.now()
            rows = self.store.boots.of_host(self.host, breakers.prune_before(now))
        except Exception as exc:
            self.log.error("cannot read the boot log: {}", exc)
            rows = None
        state = breakers.judge_rows(
            rows,
            now,
            s.breaker_threshold,
            s.breaker_window,
            is_current=lambda row: row.boot_id == self.boot_id,
        )
        previous, self.breaker = self.breaker, state
        first = previous.reason == NOT_EVALUATED
        if first or state.tripped != previous.tripped or state.fails_open != previous.fails_open:
            level = "WARNING" if state.tripped or state.fails_open else "INFO"
            self.log.log(
                level, "breaker {}: {}", "TRIPPED" if state.tripped else "clear", state.reason
            )
            self.recollection.forget_quiet()
            with contextlib.suppress(Exception):
                self.store.boots.set_breaker(self.boot_id, self.breaker_dict())
        self.metrics.breaker_tripped.set(1 if state.tripped else 0)
        return state

    def breaker_dict(self) -> dict[str, Any]:
        """The breaker for `/v1/status` and the boot row."""
        b = self.breaker
        return {
            "tripped": b.tripped,
            "unclean_boots": b.unclean_in_window,
            "threshold": self.settings.breaker_threshold,
            "window": self.settings.breaker_window,
            "clears_at": b.clears_at,
            "fails_open": b.fails_open,
            "reason": b.reason,
        }

    def prune(self) -> None:
        """Delete boot rows older than the retention (24 h)."""
        with contextlib.suppress(Exception):
            pruned = self.store.boots.prune(breakers.prune_before(self.store.now()))
            if pruned:
                self.log.info("pruned {} boot rows older than 24 h", pruned)

    # --- what ownership's passes read and tell (methods: no one reaches in) ---------

    def attention_now(self) -> set[str]:
        """The sessions recovery has business with, as of now (a copy)."""
        return self.recollection.attention()

    def served(self, served: set[str], left: set[str], found: set[str]) -> None:
        """A pass took `served` in hand; `left` of those it read stay in view."""
        self.recollection.served(served, left, found)

    def tripped(self) -> bool:
        """Whether the crash-loop breaker holds interrupted turns back."""
        return self.breaker.tripped

    def remembered(self) -> Mapping[str, Memory]:
        """What this boot remembers of each session, for the engine to read."""
        return self.recollection.memory

    def wall(self) -> float:
        """The wall clock decisions compare events' times with."""
        return self.clock()

    async def start(self) -> None:
        """Before the pool: the breaker as the boot log says, the boot log pruned."""
        await asyncio.to_thread(self.evaluate_breaker)
        await asyncio.to_thread(self.prune)

    def reconfigure(self, config: Config) -> None:
        self.configure(config)

    def passes(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The boot scan (at once), the breaker loop and the paced passes."""
        return {"recovery-breaker": self._breaker_loop(), "recovery-retry": self._paced_loop()}

    def _breaker_loop(self) -> Coroutine[Any, Any, None]:
        """The boot scan at once; then the breaker read every BREAKER_CHECK, and the pass
        it held back run at once when it lets go."""
        return reconcile(
            "recovery-breaker",
            self._breaker_pass,
            interval=lambda: BREAKER_CHECK,
            wake=Wake(),
            clock=self.timer,
            observer=self.metrics,
        )

    async def _breaker_pass(self) -> float:
        if not self._booted:
            self._booted = True
            await self.scan(Trigger.BOOT_SCAN)
            return BREAKER_CHECK
        was = self.breaker.tripped
        await asyncio.to_thread(self.evaluate_breaker)
        if was and not self.breaker.tripped:
            self.pacer.cleared(self.timer.monotonic())
            self.paced.wake()
        return BREAKER_CHECK

    def _paced_loop(self) -> Coroutine[Any, Any, None]:
        """The passes after the boot scan, when `supervisor.core.pacing` says: the next of
        a backlog `recovery.pass_interval` after the last, else the retry timer's every
        `recovery.retry_interval` (the first one interval after boot)."""
        return reconcile(
            "recovery-retry",
            self._paced_pass,
            interval=lambda: self.settings.retry_interval,
            wake=self.paced,
            clock=self.timer,
            observer=self.metrics,
        )

    async def _paced_pass(self) -> float:
        if self.pacer.is_due(self.timer.monotonic()):
            await self.scan(self.pacer.trigger)
        return self.pacer.due_in(self.timer.monotonic())

    # --- the guarded pass -----------------------------------------------------------

    async def scan(self, trigger: Trigger, only: Collection[str] | None = None) -> None:
        """Judge every interrupted session nobody is running (or of `only`); continue the
        oldest few. Subagents' turns are `Trigger.SUBAGENT_RESUME`'s alone. A boot scan or
        retry pass tells the pace what it left and what the breaker held back."""
        started = self.timer.monotonic()
        try:
            left, held = await self._scan(trigger, only)
        except Exception:
            self.log.exception("{} failed; the retry timer tries again", trigger.value)
            left, held = 0, 0
        if trigger in (Trigger.BOOT_SCAN, Trigger.RETRY_TIMER):
            self.pacer.ran(trigger, started, left=left, held=held)
            self.paced.wake()

    async def _scan(self, trigger: Trigger, only: Collection[str] | None) -> tuple[int, int]:
        """One pass; (sessions left past the cap, sessions and runs the breaker held)."""
        read = self.store.sessions.with_work if only is None else self.store.sessions.some
        sessions = await asyncio.to_thread(read, *(() if only is None else (only,)))
        children = trigger is Trigger.SUBAGENT_RESUME
        rows = {info.id: info for info in sessions}
        facts = engine.Facts(
            self.owner_prefix, self.host + "/", self.config.pool.heartbeat_interval
        )
        views = [SessionView.of(info) for info in sessions]
        targets = [
            (rows[view.id], own)
            for view, own in engine.scan_targets(views, self.recollection.memory, facts, trigger)
        ]
        judged = list(zip([i for i, _ in targets], await self.judge_all(targets), strict=True))
        held = 0 if children else await self.runs.resume(trigger, self.breaker.tripped)
        continuing = [(i.id, j.facts.interrupted_at) for i, j in judged if j.decision.charged]
        cap = self.config.subagents.max_per_boot if children else self.pace.max_per_pass
        plan = recovery.boot_scan_plan(continuing, cap)
        suppressed = sum(1 for _, j in judged if j.decision.suppressed)
        if plan:
            try:
                await asyncio.to_thread(
                    self.store.boots.set_attempted, self.boot_id, [*self.attempted, *plan]
                )
            except Exception as exc:
                self.log.error(
                    "{}: cannot write the attempted list to the boot row ({}); not continuing "
                    "{} sessions",
                    trigger.value,
                    exc,
                    len(plan),
                )
                return 0, 0
            self.attempted += plan
        self.recollection.picked(plan, trigger)
        for info, j in judged:
            if j.decision.action is Action.DRIVE_WITH_QUEUED_MESSAGE:
                self.wanted.set()  # the pool hands it to a worker, as for any queued message
            elif not j.decision.charged:
                await self.carry_out(info, j)
        left = len(continuing) - len(plan)
        later = (
            "the next pass (subagents.max_per_boot)"
            if children
            else f"the next pass in {self.pace.pass_interval:g} s (recovery.max_per_pass)"
        )
        # The boot scan always says what it found; a timer that finds nothing is quiet.
        idle = trigger is not Trigger.BOOT_SCAN and not judged and not held
        (log("subagents") if children else self.log).log(
            "DEBUG" if idle else "INFO",
            "{}: {} interrupted sessions, {} to continue{}{}",
            trigger.value,
            len(judged),
            len(plan),
            f", {left} left for {later}" if left else "",
            f", {suppressed} suppressed by the breaker" if suppressed else "",
        )
        if plan:
            self.wanted.set()
        return left, suppressed + held

    def touch(self, session_id: str) -> bool:
        """A request touched the session (first touch); True the first time."""
        return self.recollection.touched(session_id)

    def died(self, session_ids: list[str]) -> None:
        """The worker of these sessions died during this boot."""
        self.recollection.died(session_ids)

    def next_due_in(self) -> float:
        """Seconds until the earliest scheduled attempt is due (inf if none). One come due
        is judged by the pass at that time (it is kept in view)."""
        return self.recollection.next_due_in(self.clock())

    def assigned(self, session_id: str) -> None:
        """The pool gave the session a new owner: its old owner's death is history."""
        self.recollection.assigned(session_id)

    # --- judging --------------------------------------------------------------------

    async def judge_all(self, items: list[tuple[SessionInfo, Trigger]]) -> list[Judged]:
        """Judge many sessions; their tails are read in one trip to a thread."""
        tails = await asyncio.to_thread(
            lambda: [self.store.events.tail(info.id, TAIL_EVENTS) for info, _ in items]
        )
        now = self.clock()
        judged = []
        for (info, trigger), events in zip(items, tails, strict=True):
            facts = self.facts(info, events, trigger, now)
            if info.kind == SessionKind.SUBAGENT:
                decision = subagents.decide(
                    facts, trigger, now, self.breaker.tripped, self.child_settings
                )
            else:
                decision = recovery.decide(facts, trigger, now, self.breaker.tripped, self.settings)
            judged.append(Judged(decision, facts, trigger))
        return judged

    def facts(
        self, info: SessionInfo, events: list[EventRecord], trigger: Trigger, now: float
    ) -> Interruption:
        memory = self.recollection.of(info.id)
        attempt = memory.last_attempt
        return recovery.interruption(
            info,
            events,
            trigger,
            now,
            host_prefix=self.host + "/",
            last_attempt_at=attempt[1] if attempt and attempt[0] == info.active_turn_id else None,
            died=memory.died,
        )

    # --- carrying out ---------------------------------------------------------------

    def charge_skipped(self, j: Judged) -> None:
        """The attempt was not charged: the turn moved on before the lease was taken."""
        self._count(j, "skipped")

    def charged(self, info: SessionInfo, j: Judged) -> None:
        """The attempt was charged in the database (with the lease, before it starts)."""
        assert info.active_turn_id is not None
        self.recollection.charged(info.id, info.active_turn_id, self.clock())
        self.metrics.recovery_age.observe(max(0.0, self.clock() - j.facts.interrupted_at))
        self._count(j, "started")
        if info.kind == SessionKind.SUBAGENT:
            self.metrics.subagent_recovery.labels("resume").inc()
        self._log(info, j).info("{}", j.decision.reason)

    async def refund(self, info: SessionInfo, j: Judged) -> None:
        """An attempt that was charged but never handed to a worker is given back."""
        assert info.active_turn_id is not None
        await asyncio.to_thread(self.store.sessions.refund_attempt, info.id, info.active_turn_id)
        self.recollection.refunded(info.id, info.active_turn_id)
        self.metrics.recovery_refunds.inc()
        self._log(info, j).info("attempt refunded: no worker took the session")

    async def carry_out(self, info: SessionInfo, j: Judged) -> None:
        """Every decision but CONTINUE and DRIVE (the pool assigns those)."""
        d, f = j.decision, j.facts
        if d.action in (Action.CONTINUE, Action.DRIVE_WITH_QUEUED_MESSAGE):
            raise ValueError(f"{d.action.value} is the pool's to carry out")
        if d.action is Action.SKIP:
            settled = engine.settled_key(SessionView.of(info), j.trigger, self.breaker.tripped)
            if self.recollection.skipped(info.id, settled, (d.reason, j.trigger)):
                self._count(j, "suppressed" if d.suppressed else "skipped")
                self._log(info, j).log("WARNING" if d.suppressed else "INFO", "{}", d.reason)
            return
        if d.action is Action.CONTINUE_AT:
            assert d.at is not None
            if self.recollection.scheduled(info.id, d.at, j.trigger):  # in view till then
                self._count(j, "scheduled")
                self._log(info, j).info("{}", d.reason)
            return
        if info.kind == SessionKind.SUBAGENT and self.give_up is not None:
            await self.give_up(info, j)  # the child ends, and its parent is told
            self.recollection.ended(info.id)
            return
        told = notice(d, f, info.id)
        assert info.active_turn_id is not None
        done = await asyncio.to_thread(
            self.store.sessions.finalize,
            info.id,
            info.active_turn_id,
            told.text,
            told.reason,
            quarantine=d.quarantine,
            token=info.lease_token,
        )
        self._count(j, told.outcome if done else "skipped")
        level = "ERROR" if d.quarantine else "WARNING"
        self._log(info, j).log(level, "{}{}", d.reason, "" if done else " (turn moved on)")
        self.recollection.ended(info.id)

    def drive(self, info: SessionInfo, j: Judged) -> None:
        """A queued user message drives the next turn (the pool assigns it)."""
        self.recollection.ended(info.id)
        self._count(j, "started")
        self._log(info, j).info("{}", j.decision.reason)

    def _count(self, j: Judged, outcome: str) -> None:
        self.metrics.recovery.labels(j.decision.action.value, j.facts.cause, outcome).inc()

    def _log(self, info: SessionInfo, j: Judged) -> Any:
        return log(
            "subagents" if info.kind == SessionKind.SUBAGENT else "recovery",
            session=info.id,
            action=j.decision.action.value,
            trigger=j.trigger.value,
        )


class RecoveryPasses(Service):
    """Recovery's passes: the boot scan, the breaker loop and the paced passes (a backlog's
    and the retry timer's). Started after the HTTP listener (an interrupted turn goes on as
    soon as one worker is ready), stopped first."""

    name = "recovery-passes"
    needs = ("recovery",)
    after = ("http",)

    def __init__(self, recovery: Recoverer) -> None:
        self.recovery = recovery

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return self.recovery.passes()
