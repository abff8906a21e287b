"""The scheduler: every schedule fires on time, once, whatever restarts or other daemons do.

The rules are `supervisor.schedules.rules`'s; this module reads the facts, asks them, and
carries the fires out. One pass:

1. finish the fires committed but not injected (a crash between the two): at boot (and
   after a pass that failed) all of them, and every `OWED_EVERY` seconds those
   `rules.OWED_AGE` old on the database clock (another daemon's that died in between;
   a live one's in flight is left to it). Each is injected with the idempotency key of
   its (schedule, time) (for a new session: under its fire row's lock), so one injected
   before, or by another daemon at the same moment, appends nothing;
2. end the interrupted turns of sessions of kind `scheduled` with a notice: such a turn
   is never continued (the engine leaves them out of recovery), the next fire runs;
3. for every schedule, decide its due times (`rules.decide`), commit them as fire rows
   (`Schedules.record`: only times after its newest row, so another daemon's are never
   fired again), then inject each fire's `user_message` through the intake path (the
   event log, the schedule's session or a new `scheduled` one), tell the pool, and
   mark the fire injected.

Then it sleeps until the next schedule's time, through the pool's clock, or until a
schedule is created or deleted (`stir`). Each decision about a missed time is logged
under subsystem `schedules` and every time counted in
`turnkeeper_schedule_fires_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.cron import Cron, CronError
from supervisor.contract.logs import log
from supervisor.core.vocabulary import (
    ADMIN_PRINCIPAL,
    EventType,
    FireOutcome,
    Permission,
    ScheduleStatus,
    SessionStatus,
    Writer,
)
from supervisor.metrics import Metrics
from supervisor.runtime.loops import Wake, reconcile
from supervisor.runtime.service import Service
from supervisor.schedules import rules
from supervisor.store import FireInfo, ScheduleInfo, SessionClosed, SessionNotFound, Store

MAX_REST = 60.0  # seconds it sleeps at most (schedules another daemon made, clock jumps)
RETRY = 1.0  # seconds before a failed pass is tried again
RECHECK = 15.0  # seconds between looks for interrupted scheduled turns, while any run
OWED_EVERY = 5.0  # seconds between looks for old owed fires (a daemon died mid-fire)
OWED_BATCH = 500  # owed fires finished in one pass; the next pass takes the rest
TITLE_CHARS = 80  # characters of a fire's text in the title of the session it makes


@dataclass(frozen=True)
class Plan:
    """What one pass does with one schedule."""

    schedule: ScheduleInfo
    fires: list[rules.Fire]
    next_at: float | None  # its next time after now


class Scheduler(Service):
    """Fires this database's schedules (see the module's docstring)."""

    name = "schedules"
    needs = ("store", "pool")
    takes = ("schedules",)

    def __init__(
        self,
        config: Config,
        store: Store,
        owner: str,
        committed: Callable[[str, int, str], None],
        stop: Callable[[str], None],
        metrics: Metrics,
        *,
        clock: Clock = SYSTEM,
    ) -> None:
        self.config = config  # read on every pass: a reload may replace it
        self.store = store
        self.owner = owner  # "<host>/<boot8>": what fire rows say fired them
        self.host_prefix = owner.split("/", 1)[0] + "/"
        self.committed = committed  # the bus's: signals an event and wakes its session
        self.end_turn = stop  # the pool's: a session's turn was ended in the database
        self.metrics = metrics
        self.clock = clock
        self.wake = Wake()
        self.started = clock.time()  # set again when `run` starts
        self.passes = 0  # passes done (tests wait on it)
        self.owed = True  # fires committed and not injected may wait: at boot, after a failure
        self.owed_at = float("-inf")  # monotonic: the next look for old owed fires
        self.recheck_at = float("-inf")  # monotonic: the next look for interrupted turns
        self._crons: dict[tuple[str, str], Cron | CronError] = {}
        self.log = log("schedules")

    def stir(self) -> None:
        """Look again now: a schedule was created or deleted."""
        self.wake.wake()

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """A pass at once, then at every schedule's time and on every stir."""
        return {"schedules": self._loop()}

    async def _loop(self) -> None:
        self.wake.bind()
        self.store.schedules.on_change.append(self.wake.wake_threadsafe)  # a writer's thread
        self.started = self.clock.time()
        try:
            await reconcile(
                "schedules",
                self._pass,
                interval=lambda: MAX_REST,
                wake=self.wake,
                clock=self.clock,
                retry=RETRY,
                observer=self.metrics,
            )
        finally:
            self.store.schedules.on_change.remove(self.wake.wake_threadsafe)

    async def _pass(self) -> float:
        try:
            return min(MAX_REST, await self.step())
        except Exception:
            self.owed = True  # fires committed and not injected may wait
            raise
        finally:
            self.passes += 1

    async def step(self) -> float:
        """One pass (see the module's docstring); seconds until the next one is due."""
        if self.owed:  # all of them: none can be this boot's in flight
            self.owed = await self.finish_owed(0.0)
            self.owed_at = self.clock.monotonic() + (0.0 if self.owed else OWED_EVERY)
        elif self.clock.monotonic() >= self.owed_at:  # another daemon's, left a while ago
            more = await self.finish_owed(rules.OWED_AGE)
            self.owed_at = self.clock.monotonic() + (0.0 if more else OWED_EVERY)
        rest = self.owed_at - self.clock.monotonic()
        if self.clock.monotonic() >= self.recheck_at:
            running = await self.end_interrupted()
            self.recheck_at = self.clock.monotonic() + (RECHECK if running else MAX_REST)
        rest = min(rest, self.recheck_at - self.clock.monotonic())
        if self.config.schedules.max_schedules <= 0:
            return rest  # schedules are off: none fires
        schedules = await asyncio.to_thread(self.store.schedules.active)
        newest = await asyncio.to_thread(self.store.schedules.newest, [s.id for s in schedules])
        now = self.clock.time()
        up: tuple[tuple[float, float], ...] = ()
        if now - rules.LATE < self.started:  # later, every due time this one was up for
            hosts = await asyncio.to_thread(self.store.hosts.all)
            mine = self.host_prefix[:-1]  # this daemon's own row: it was not up before now
            up = tuple(
                rules.up_span(h.started_at, h.last_seen, h.live) for h in hosts if h.host_id != mine
            )
        plans = await asyncio.to_thread(self._plan, schedules, newest, now, up)
        for plan in plans:
            if plan.fires:
                await self.carry_out(plan)
        now = self.clock.time()
        for plan in plans:
            if plan.next_at is not None:
                rest = min(rest, plan.next_at - now)
        return rest

    def _plan(
        self,
        schedules: list[ScheduleInfo],
        newest: dict[str, FireInfo],
        now: float,
        up: tuple[tuple[float, float], ...],
    ) -> list[Plan]:
        """Each schedule's fires and next time (in a thread: stepping cron takes a while)."""
        plans = []
        grace = self.config.schedules.misfire_grace
        crons: dict[tuple[str, str], Cron | CronError] = {}
        for schedule in schedules:
            cron = self._cron(schedule, crons)
            if cron is None:
                continue
            last = newest.get(schedule.id)
            since = max(schedule.armed_from, last.scheduled_for if last else float("-inf"))
            how = rules.misfire(schedule.misfire)
            facts = rules.Facts(since, self.started, now, how, grace, up)
            times, more = rules.due(cron, facts)
            fires = rules.decide(times, more, facts)
            plans.append(Plan(schedule, fires, rules.next_due(cron, since, now)))
        self._crons = crons  # the current schedules' only: a deleted one's goes
        return plans

    def _cron(
        self, schedule: ScheduleInfo, crons: dict[tuple[str, str], Cron | CronError]
    ) -> Cron | None:
        """The schedule's checked expression, kept in `crons` (from the last pass's when
        it was there); None (logged once) if it no longer checks."""
        key = (schedule.cron, schedule.timezone)
        if key not in crons:
            if key in self._crons:
                crons[key] = self._crons[key]
            else:
                try:
                    crons[key] = Cron(*key)
                except CronError as exc:  # a time zone this machine does not have, say
                    crons[key] = exc
                    self.log.error("schedule {} cannot fire: {}", schedule.id, exc)
        found = crons[key]
        return found if isinstance(found, Cron) else None

    async def carry_out(self, plan: Plan) -> None:
        """Commit the plan's fires, then inject those that run."""
        schedule = plan.schedule
        wanted = [(f.scheduled_for, f.outcome.value, f.reason) for f in plan.fires]
        written = await asyncio.to_thread(
            self.store.schedules.record, schedule.id, wanted, self.owner
        )
        decided = {f.scheduled_for: f for f in plan.fires}
        for row in written:
            fire = decided[row.scheduled_for]
            self.metrics.schedule_fires.labels(fire.outcome).inc()
            if fire.passed_over:
                self.metrics.schedule_fires.labels(FireOutcome.SKIPPED).inc(fire.passed_over)
            if fire.outcome is not FireOutcome.FIRED:
                level = "INFO" if fire.outcome is FireOutcome.CAUGHT_UP else "WARNING"
                self.log.log(level, "schedule {} {}: {}", schedule.id, fire.outcome, fire.reason)
            if fire.injected:
                await self.inject(schedule, row)

    async def inject(self, schedule: ScheduleInfo, fire: FireInfo) -> None:
        """Put the fire's message in its session (a new one for a schedule without), as
        intake does, once: again, its idempotency key appends nothing."""
        if schedule.status != ScheduleStatus.ACTIVE:  # paused or ended since the fire
            stopped = f"the schedule is {schedule.status}"
            await asyncio.to_thread(self.store.schedules.dropped, fire.id, stopped)
            self.log.info("schedule {} did not run for {}: {}", schedule.id, _when(fire), stopped)
            return
        outcome = FireOutcome(fire.outcome)
        owner = schedule.owner or ADMIN_PRINCIPAL
        payload = rules.message(schedule.id, schedule.text, owner, fire.scheduled_for, outcome)
        key = rules.idempotency_key(schedule.id, fire.scheduled_for)
        if schedule.session is None:
            title = " ".join(schedule.text.split())[:TITLE_CHARS]
            made = await asyncio.to_thread(
                self.store.schedules.inject_new,
                fire.id,
                schedule.owner,
                title,
                payload,
                key,
                self.config.auth.max_open_sessions_per_principal,
            )
            if made is None:
                return
            session_id, seq = made
        else:
            session_id = schedule.session
            why = await asyncio.to_thread(self._refusal, schedule)
            seq = 0
            if why is None:
                try:
                    seq = await self.store.events.append_async(
                        session_id,
                        EventType.USER_MESSAGE,
                        payload,
                        writer=Writer.INTAKE,
                        idempotency_key=key,
                    )
                except (SessionClosed, SessionNotFound) as exc:
                    why = str(exc)
            if why is not None:
                await asyncio.to_thread(self.store.schedules.dropped, fire.id, why)
                self.log.bind(session=session_id).warning(
                    "schedule {} did not run for {}: {}", schedule.id, _when(fire), why
                )
                return
            await asyncio.to_thread(self.store.schedules.injected, fire.id, session_id, seq)
        self.committed(session_id, int(seq), EventType.USER_MESSAGE)
        self.log.bind(session=session_id).debug(
            "schedule {} ran for {} ({}): message seq {}", schedule.id, _when(fire), outcome, seq
        )

    def _refusal(self, schedule: ScheduleInfo) -> str | None:
        """Why the schedule's session takes no fire now (as intake would refuse), or None."""
        assert schedule.session is not None
        try:
            info = self.store.sessions.get(schedule.session)
        except SessionNotFound as exc:
            return str(exc)
        if info.status != SessionStatus.OPEN:
            return f"its session is {info.status}"
        owner = schedule.owner or ADMIN_PRINCIPAL
        if owner != ADMIN_PRINCIPAL:
            held = self.store.acl.permission(schedule.session, owner)
            if held is None or not Permission(held).includes(Permission.WRITE):
                return f"its owner {owner} no longer has write access to its session"
        return None

    async def finish_owed(self, age: float) -> bool:
        """Inject the fires committed but not injected (a crash came in between) at least
        `age` seconds ago (database clock); whether more are left for the next pass."""
        owed = await asyncio.to_thread(self.store.schedules.owed, OWED_BATCH, age)
        for fire in owed:
            schedule = await asyncio.to_thread(self.store.schedules.get, fire.schedule)
            if schedule is None:
                await asyncio.to_thread(self.store.schedules.dropped, fire.id, "schedule deleted")
                continue
            self.log.info(
                "schedule {}: finishing its fire for {}, committed by {} before a stop",
                schedule.id,
                _when(fire),
                fire.fired_by,
            )
            await self.inject(schedule, fire)
        return len(owed) == OWED_BATCH

    async def end_interrupted(self) -> bool:
        """End the interrupted turns of scheduled sessions with a notice; whether any
        scheduled turn is in flight at all."""
        ids = await asyncio.to_thread(self.store.schedules.running_sessions)
        if not ids:
            return False
        sessions = await asyncio.to_thread(self.store.sessions.many, ids)
        now = await asyncio.to_thread(self.store.now)
        for info in sessions.values():
            cause = rules.interruption(
                info.owner,
                info.lease_expires_at,
                info.updated_at,
                now,
                host_prefix=self.host_prefix,
                boot_prefix=self.owner,
            )
            if cause is None or info.active_turn_id is None:
                continue
            done = await asyncio.to_thread(
                self.store.sessions.finalize,
                info.id,
                info.active_turn_id,
                rules.interrupted_notice(cause),
                rules.NOT_CONTINUED,
                token=info.lease_token,
            )
            if done:
                self.end_turn(info.id)  # a signal: its lease was revoked with the notice
                self.log.bind(session=info.id).warning(
                    "scheduled turn {} interrupted ({}): ended with a notice, not continued",
                    info.active_turn_id,
                    cause.text,
                )
        return True


def _when(fire: FireInfo) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(fire.scheduled_for))
