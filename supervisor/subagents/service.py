"""The subagents' reconciler: every running child this daemon claims moves on by a rule.

The rules are `supervisor.subagents.rules`'s. A pass runs at boot, after a worker died
(a child it ran may have ended without reporting), and every `subagents.reconcile_interval`:

1. claim the running registry rows no live daemon holds (`FOR UPDATE SKIP LOCKED` on the
   server databases; this host's earlier boots' claims are taken at once, they are dead);
2. report the children whose run is over (their worker ended the turn and died before it
   reported; closed; quarantined) to their parents, once;
3. hand the interrupted ones to recovery's subagent pass (`Trigger.SUBAGENT_RESUME`):
   continued with their original task and a truthful note on recovery's attempts, or,
   through `give_up`, finalized (older than `subagents.freshness`), wedged (attempts
   spent) or failed (an unsafe tail), the parent told in the same transaction.

Each decision is logged under subsystem `subagents` and counted in
`turnkeeper_subagent_recovery_total{action}`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.notices import subagent_notice
from supervisor.core.recovery import Action, Trigger
from supervisor.core.vocabulary import EventType, SubagentStatus
from supervisor.metrics import Metrics
from supervisor.pool import drain
from supervisor.pool.pool import Pool
from supervisor.pool.recoverer import Judged, Recoverer
from supervisor.runtime.bus import Bus, TurnEnded, WorkerExited
from supervisor.runtime.loops import Wake, reconcile
from supervisor.runtime.service import Service, Steps
from supervisor.store import Reported, SessionInfo, Store
from supervisor.subagents import rules
from supervisor.teardown import SUBAGENT_MARGIN

CLAIM_BATCH = 500  # rows claimed in one pass; the next pass takes the rest


class ChildEnding:
    """Ends a child's run that recovery will not continue, and tells its parent: given to
    recovery (`Recoverer(give_up=...)`) and used by the reconciler's reports."""

    def __init__(self, store: Store, bus: Bus, metrics: Metrics) -> None:
        self.store = store
        self.bus = bus
        self.metrics = metrics
        self.log = log("subagents")

    async def give_up(self, info: SessionInfo, j: Judged) -> None:
        """Recovery will not continue this child's turn: end it and tell the parent."""
        d, f = j.decision, j.facts
        told = subagent_notice(d, f)
        status = rules.final_status(d.quarantine, d.action is Action.FINALIZE_STALE)
        assert info.active_turn_id is not None
        reported = await asyncio.to_thread(
            self.store.subagents.finalize,
            info.id,
            info.active_turn_id,
            status,
            told.reason,
            told.text,
            token=info.lease_token,
        )
        if reported is None:
            self.log.bind(session=info.id).info("{} (turn moved on)", d.reason)
            return
        why = {
            "stale": "interrupted longer ago than subagents.freshness",
            "wedged": f"each of its {f.attempts} continuation attempts failed",
            "auto_continue_off": "recovery.auto_continue is off",
        }.get(told.reason, "not safe to continue by itself")
        self.told(reported, told.outcome, why)

    def told(self, reported: Reported, action: str, why: str) -> None:
        """A child's result was committed to its parent: wake the parent, log, count."""
        # A result wakes the parent; a cancellation is only told to its readers.
        self.bus.committed(reported.parent, reported.seq, EventType.SUBAGENT_RESULT, reported.woke)
        for session_id in (reported.child, *reported.cancelled):
            self.bus.publish(TurnEnded(session_id))  # their leases were revoked with the result
        self.metrics.subagent_recovery.labels(action).inc()
        level = "INFO" if reported.status == SubagentStatus.COMPLETED else "WARNING"
        self.log.bind(session=reported.child).log(
            level,
            "subagent {} {} ({}): reported to {}",
            reported.child,
            reported.status.value,
            why,
            reported.parent,
        )


class Reconciler(Service):
    """Claims, reports and resumes this daemon's share of the running subagents."""

    name = "subagents"
    needs = ("store", "recovery", "pool")
    takes = ("subagents", "lease")
    drains = True  # its passes go on through the drain: a child's result reaches its parent

    def __init__(
        self,
        config: Config,
        store: Store,
        recovery: Recoverer,
        pool: Pool,
        ending: ChildEnding,
        metrics: Metrics,
        *,
        bus: Bus | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.config = config
        self.store = store
        self.recovery = recovery
        self.pool = pool  # holds its assignments and says what runs, for the subagent drain
        self.ending = ending
        self.metrics = metrics
        self.clock = clock
        self.owner = recovery.owner_prefix  # "<host>/<boot8>"
        self.wake = Wake()
        self.log = log("subagents")
        if bus is not None:
            bus.subscribe(WorkerExited, self._worker_exited)

    @property
    def ttl(self) -> float:
        """How long a claim lasts: a few passes; a daemon that stops renewing it loses it."""
        return max(3 * self.config.subagents.reconcile_interval, self.config.lease.stale_after)

    def stir(self) -> None:
        """Look again soon: a worker died, a child it ran may be over."""
        self.wake.wake()

    def _worker_exited(self, _: WorkerExited) -> None:
        self.stir()  # a child it ran may be over

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """A pass at once, then on every stir and every `reconcile_interval`."""
        return {
            "subagents": reconcile(
                "subagents",
                self.reconcile,
                interval=lambda: self.config.subagents.reconcile_interval,
                wake=self.wake,
                clock=self.clock,
                observer=self.metrics,
            )
        }

    async def stop(self, steps: Steps) -> None:
        """The subagent drain (after the HTTP listener closed: a subagent's turn in flight
        may end, capped), then the claims given up."""
        cap = self.config.shutdown.subagent_drain
        if cap > 0:
            running = await drain.subagents_in_flight(self.pool)
            if running:
                await steps.run(
                    "subagent drain",
                    cap + SUBAGENT_MARGIN,
                    lambda: drain.subagent_drain(self.pool, running, cap),
                )
        await self.release()

    async def release(self) -> None:
        """A clean stop: give the claims up, so another daemon reconciles them at once."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.store.subagents.release_claims, self.owner)

    async def reconcile(self) -> None:
        """One pass over the claimed rows (see the module docstring)."""
        host = self.owner.split("/", 1)[0] + "/"
        rows = await asyncio.to_thread(
            self.store.subagents.claim, self.owner, self.ttl, CLAIM_BATCH, host
        )
        if not rows:
            return
        sessions = await asyncio.to_thread(self.store.sessions.many, [r.id for r in rows])
        interrupted: list[str] = []
        for row in rows:
            info = sessions.get(row.id)
            facts = rules.Child.of(info)
            step = rules.reconcile(facts)  # the store judges a report again, under its locks
            if step is rules.Step.REPORT:
                try:
                    reported = await asyncio.to_thread(self.store.subagents.report, row.id)
                except Exception as exc:  # one bad row must not hold up the others
                    self.log.bind(session=row.id).error("cannot report subagent: {}", exc)
                    continue
                if reported is not None:
                    self._told(reported, "report", "its run was over, not yet reported")
            elif step is rules.Step.RECOVER:
                interrupted.append(row.id)
        if interrupted:
            await self.recovery.scan(Trigger.SUBAGENT_RESUME, interrupted)

    def _told(self, reported: Reported, action: str, why: str) -> None:
        self.ending.told(reported, action, why)
