"""The courier: sends the outbox's deliveries to their targets, once each, in seq order per
session, whatever restarts, down targets or other daemons do.

The rules are `supervisor.deliveries.rules`'s; this module claims rows, POSTs them and
writes down what their targets answered. One pass, for each configured target with room
(`delivery.concurrency` attempts in flight):

1. claim the due deliveries of the target (`Deliveries.claim`: each the oldest pending one
   of its session, so the next of a session is claimable only once this one is finished;
   a claim of this host's earlier boot, one that was in flight when the daemon died, is
   free at once);
2. POST each, signed, with `Idempotency-Key: <delivery_id>` (a delivery sent again after
   a crash carries the same key: the receiver dedupes);
3. record its verdict (delivered, dead, or pending again after the backoff) under the
   claim, count the attempt, observe the lag of a delivered one, and look again at once:
   the session's next delivery may go.

A target that does not answer holds back only its own deliveries: each attempt is a task
of its own, bounded by the target's `timeout`, and each target has its own room. Between
passes the courier sleeps until an event it may carry is committed (`nudge`, the pool's
event signal), an operator retries one (`stir`), the soonest next try in the outbox comes
due (`Deliveries.next_due`, by the database clock: after a restart too, a retry is made at
its time), or at the latest `delivery.poll_interval` passes (what another daemon or process
committed). Logged under subsystem `deliveries`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.contract.logs import log
from supervisor.core import timers
from supervisor.core.vocabulary import AttemptOutcome, DeliveryKind, DeliveryStatus
from supervisor.deliveries import rules
from supervisor.metrics import Metrics
from supervisor.runtime.bus import Bus, Published
from supervisor.runtime.loops import Wake, reconcile

if TYPE_CHECKING:  # httpx is imported with the first delivery, not at every start
    import httpx

    from supervisor.deliveries.poster import Poster
from supervisor.runtime.service import Service
from supervisor.store import Outgoing, Store

CLAIM_MARGIN = 15.0  # seconds a claim outlives its target's timeout (recording the verdict)
RETRY = 1.0  # seconds before a pass that failed (a busy database) is tried again
SETTLE_CAP = 1.0  # seconds a stop waits for claims and verdicts being written, and the release
PRUNE_EVERY = 600.0  # seconds between forgetting delivered rows older than delivery.keep
# Events that may carry a delivery (`DeliveryKind`s, by the event type the pool signals).
CARRIERS = frozenset({"model_response", *DeliveryKind})

Finished = Callable[[str, AttemptOutcome], None]


class Courier(Service):
    """Sends this database's deliveries (see the module's docstring)."""

    name = "courier"
    needs = ("store",)
    after = ("pool",)
    takes = ("delivery",)

    def __init__(
        self,
        config: Config,
        store: Store,
        owner: str,
        metrics: Metrics,
        *,
        clock: Clock = SYSTEM,
        jitter: Callable[[], float] = random.random,
        transport: httpx.AsyncBaseTransport | None = None,
        bus: Bus | None = None,
    ) -> None:
        self.config = config  # read on every pass: a reload may replace it
        self.store = store
        self.owner = owner  # "<host>/<boot>": what claims say
        self.mine = owner.split("/", 1)[0] + "/"  # this host's earlier boots' claims are dead
        self.metrics = metrics
        self.clock = clock
        self.jitter = jitter
        self.in_flight: dict[str, set[asyncio.Task[None]]] = {}  # attempts, by target
        self.sending: set[str] = set()  # the deliveries those attempts carry
        self._finishing: set[asyncio.Future[bool]] = set()  # verdicts being written
        self._transport = transport
        self._poster: Poster | None = None  # made at the first delivery (`poster`)
        self._claiming: asyncio.Future[list[Outgoing]] | None = None  # a claim's transaction
        self.on_finished: list[Finished] = []  # tests and benchmarks watch attempts
        self._wake = Wake()
        self._targets_seen = 0  # counts the reloads that changed the targets' events
        self._synced = -1  # ... as of the last sync of the bound sessions' kinds
        self._pruned_at = -PRUNE_EVERY
        self.log = log("deliveries")
        if bus is not None:
            bus.subscribe(Published, self._published)

    # --- signals --------------------------------------------------------------------

    def nudge(self, session_id: str, event: dict[str, Any]) -> None:
        """The pool's event signal: an event that may carry a delivery was committed."""
        if event.get("type") in CARRIERS:
            self._wake.wake()

    def _published(self, event: Published) -> None:
        self.nudge(event.session, event.event)

    def stir(self) -> None:
        """Look again now (an operator retried a delivery)."""
        self._wake.wake()

    @property
    def poster(self) -> Poster:
        """The HTTP side, made when the first delivery goes out: a daemon with no target
        never imports an HTTP client."""
        if self._poster is None:
            from supervisor.deliveries.poster import Poster

            self._poster = Poster(self._transport)
        return self._poster

    def reconfigure(self, config: Config) -> None:
        """A reload: passes read `config` from now on. If the targets' events changed, the
        next pass syncs them to their bound sessions (as at boot); the clients of targets
        removed or changed (of all, for a new `delivery.concurrency`) are closed once idle."""
        old, new = self.config.delivery, config.delivery
        self.config = config
        before, after = {t.name: t for t in old.targets}, {t.name: t for t in new.targets}
        if _kinds(before) != _kinds(after):
            self._targets_seen += 1
        same = old.concurrency == new.concurrency
        if self._poster is not None:
            self._poster.retire([n for n, t in before.items() if not same or after.get(n) != t])
        self._wake.wake()

    # --- the loop -------------------------------------------------------------------

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"courier": self._loop()}

    async def _loop(self) -> None:
        """Pass after pass until cancelled (its stop); then give the claims back. A pass
        that fails (a busy database) is tried again after RETRY."""
        self.metrics.state.deliveries = self.store.deliveries.counts
        try:
            await reconcile(
                "courier",
                self._pass,
                interval=lambda: self.config.delivery.poll_interval,
                wake=self._wake,
                clock=self.clock,
                retry=RETRY,
                observer=self.metrics,
            )
        finally:
            await self._settle()

    async def _settle(self) -> None:
        """Stop the attempts in flight and give their claims back: whoever claims them next
        (this host's next boot, another daemon) sends them again, with the same key."""
        running = [task for tasks in self.in_flight.values() for task in tasks]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        try:  # bounded: the descendants' teardown comes after this, within its budget
            async with asyncio.timeout(SETTLE_CAP):
                if self._poster is not None:
                    await self._poster.aclose()
                if self._claiming is not None:  # a claim in flight commits anyway: its rows
                    await asyncio.gather(self._claiming, return_exceptions=True)
                # A verdict being written commits anyway: a 2xx is kept, not sent again.
                await asyncio.gather(*self._finishing, return_exceptions=True)
                release = self.store.deliveries.release
                await asyncio.shield(asyncio.to_thread(release, self.owner, SETTLE_CAP))
        except Exception as exc:  # TimeoutError too: a database that went away
            self.log.warning(
                "could not give back this boot's claims (they run out, or this host's next "
                "boot takes them at once): {}",
                exc or type(exc).__name__,
            )

    async def _pass(self) -> float:
        """Claim and send what is due; the seconds until the next pass is due."""
        settings = self.config.delivery
        targets = {t.name: t for t in settings.targets}
        seen = self._targets_seen
        if self._synced != seen:
            await self._first_pass(targets)
            self._synced = seen
        # What the claims below judge by comes later: a delivery due by then is theirs.
        judged = await asyncio.to_thread(self.store.deliveries.now) if targets else 0.0
        for name, target in targets.items():
            running = self.in_flight.setdefault(name, set())
            room = settings.concurrency - len(running)
            if room <= 0:
                continue
            lease = {name: target.timeout + CLAIM_MARGIN}
            # Shielded: a stop cannot end the claim's thread, so `_settle` waits for it.
            self._claiming = spawn(
                asyncio.to_thread(self.store.deliveries.claim, self.owner, lease, room, self.mine)
            )
            claimed = await asyncio.shield(self._claiming)
            for outgoing in claimed:
                if outgoing.delivery.id in self.sending:
                    continue  # its attempt is still running (it ends within the claim)
                task = spawn(
                    self._attempt(target, outgoing), name=f"delivery {outgoing.delivery.id}"
                )
                running.add(task)
                task.add_done_callback(running.discard)
        if self.clock.monotonic() - self._pruned_at >= PRUNE_EVERY:
            self._pruned_at = self.clock.monotonic()
            before = await asyncio.to_thread(self.store.deliveries.now) - settings.keep
            forgotten = await asyncio.to_thread(self.store.deliveries.prune, before)
            if forgotten:
                self.log.info("forgot {} delivered rows older than delivery.keep", forgotten)
        return await self._rest(list(targets), judged)

    async def _rest(self, targets: list[str], judged: float) -> float:
        """Seconds until the soonest next try from `judged` on (the clock the pass's claims
        came after), at most `delivery.poll_interval` (`supervisor.core.timers`)."""
        longest = self.config.delivery.poll_interval
        if not targets:
            return longest
        due = await asyncio.to_thread(self.store.deliveries.next_due, targets, judged)
        now = await asyncio.to_thread(self.store.deliveries.now) if due is not None else judged
        return timers.rest([due], judged=judged, now=now, longest=longest)

    async def _first_pass(self, targets: dict[str, DeliveryTarget]) -> None:
        """At boot, and after a reload changed the targets' events: the bound sessions get
        what their target's `events` say now, and deliveries to targets this daemon does
        not know are named (another daemon on the database may send them; otherwise they
        wait until the target is configured)."""
        deliveries = self.store.deliveries
        if targets:
            kinds = {name: [str(k) for k in t.events] for name, t in targets.items()}
            changed = await asyncio.to_thread(deliveries.sync_kinds, kinds)
            if changed:
                self.log.info("{} bound sessions now get what their target's events say", changed)
        waiting = await asyncio.to_thread(deliveries.pending_by_target)
        for name, count in sorted(waiting.items()):
            if name not in targets:
                self.log.warning(
                    "{} pending deliveries are for target {!r}, which this daemon's "
                    "configuration does not name: they wait for a daemon that has it "
                    "([[delivery.targets]])",
                    count,
                    name,
                )

    # --- one attempt ----------------------------------------------------------------

    async def _attempt(self, target: DeliveryTarget, outgoing: Outgoing) -> None:
        delivery = outgoing.delivery
        self.sending.add(delivery.id)
        try:
            await self._attempt_once(target, outgoing)
        finally:
            self.sending.discard(delivery.id)

    async def _attempt_once(self, target: DeliveryTarget, outgoing: Outgoing) -> None:
        delivery = outgoing.delivery
        content = rules.body(
            delivery.id,
            delivery.session,
            delivery.seq,
            delivery.kind,
            rules.text_of(delivery.kind, outgoing.payload),
            delivery.created_at,
        )
        settings = self.config.delivery
        code, error = await self.poster.post(target, settings.concurrency, delivery.id, content)
        policy = rules.Policy(
            max_attempts=settings.max_attempts,
            base=settings.backoff,
            cap=settings.backoff_cap,
            max_age=settings.max_age,
        )
        attempts = delivery.attempts + 1
        age = self.clock.time() - delivery.created_at  # the event's stamp: a wall clock's
        verdict, given_up = policy.after(attempts, rules.verdict(code), age)
        if given_up:
            error = f"{error}; {given_up}"
        status, outcome, next_in = {
            rules.Verdict.DELIVERED: (DeliveryStatus.DELIVERED, AttemptOutcome.DELIVERED, 0.0),
            rules.Verdict.DEAD: (DeliveryStatus.DEAD, AttemptOutcome.DEAD, 0.0),
            rules.Verdict.RETRY: (DeliveryStatus.PENDING, AttemptOutcome.FAILED, None),
        }[verdict]
        if next_in is None:
            next_in = policy.next_in(attempts, min(1.0, max(0.0, self.jitter())), age)
        finish = self.store.deliveries.finish
        writing = spawn(
            asyncio.to_thread(
                finish, delivery.id, self.owner, status, next_in=next_in, code=code, error=error
            )
        )
        self._finishing.add(writing)
        writing.add_done_callback(self._finishing.discard)
        try:  # shielded: a stop waits for the verdict (`_settle`) instead of losing it
            kept = await asyncio.shield(writing)
        except Exception as exc:  # the claim runs out; the delivery is sent again, same key
            self.log.warning("could not record delivery {}: {}", delivery.id, exc)
            return
        if kept:
            self.metrics.delivery_attempts.labels(outcome).inc()
        if kept and status is DeliveryStatus.DELIVERED:
            self.metrics.delivery_lag.observe(max(0.0, self.clock.time() - delivery.created_at))
        self._say(delivery.id, target.name, attempts, status, next_in, error, kept)
        for watcher in self.on_finished:
            watcher(delivery.id, outcome)
        self._wake.wake()  # the session's next delivery may go now

    def _say(
        self,
        delivery_id: str,
        target: str,
        attempts: int,
        status: DeliveryStatus,
        next_in: float,
        error: str,
        kept: bool,
    ) -> None:
        if not kept:
            self.log.warning(
                "delivery {} to {}: its claim ran out before the verdict was written; "
                "whoever holds it now sends it again (same Idempotency-Key)",
                delivery_id,
                target,
            )
        elif status is DeliveryStatus.DELIVERED:
            self.log.debug(
                "delivery {} to {}: delivered (attempt {})", delivery_id, target, attempts
            )
        elif status is DeliveryStatus.DEAD:
            self.log.warning(
                "delivery {} to {}: dead after {} attempt(s): {} (retry it with "
                "`turnkeeper deliveries retry {}`)",
                delivery_id,
                target,
                attempts,
                error,
                delivery_id,
            )
        else:
            self.log.info(
                "delivery {} to {}: attempt {} failed ({}), again in {:.1f} s",
                delivery_id,
                target,
                attempts,
                error,
                next_in,
            )


def _kinds(targets: dict[str, DeliveryTarget]) -> dict[str, list[str]]:
    """What each target sends, as `Deliveries.sync_kinds` takes it."""
    return {name: sorted(str(k) for k in t.events) for name, t in targets.items()}
