"""Who owns which session, decided over plain data: the supervisor's ownership engine.

Pure code, in the manner of h11's `Connection`: the pool hands `plan` what it knows (the
sessions with work, its workers, who it assigned what, what recovery remembers of each
session, the time) and gets back commands; it carries them out (lease, charge, send,
log) and never decides itself. Recovery's decision about one interrupted turn
(`supervisor.core.recovery.decide`) needs the turn's tail, which is an I/O lookup, so
`plan` asks for it with `Judge`, and `after_judgement` turns the decision into what the
pool does next.

Rules
-----
- A session with a live lease held by a live worker of ours stays with it; new input
  (`last_seq` moved on while pending) gets that worker a `Wake`.
- A session whose owner is gone or stopped renewing its lease is taken from it (`Move`)
  and planned like a free one: the old owner is fenced out by the next lease's token.
- A lease this daemon granted whose token has since grown was taken by another daemon
  (this host was paused or cut off, and the others adopted its sessions): the session is
  taken from its worker (`Move`, `taken`), which is told to stop it; the token already
  fences out anything it would still write.
- A live lease of another host is that host's to keep. When it runs out (the host died,
  or stopped renewing), the session is adopted, spread over the live hosts by rendezvous
  hashing (`supervisor.core.adoption`): the host the hash picks takes it at once, any
  other after `ADOPT_GRACE` (in case the one picked is gone too). The grant is a
  compare-and-set on the token the pass read: of several daemons after one session, one wins.
  Nothing is planned while the pool stops, or for a session being assigned right now
  (`busy`).
- Fairness: user input goes first. Pending sessions (new input, or a queued user message
  that drives an interrupted turn) are planned before the continuation of interrupted
  turns, whatever their age. Each pass has a budget (`Budget`): at most `assign`
  assignments and `judge` judgements, so a backlog of interrupted sessions is worked off
  over many passes and never holds up a user's new session.
- A worker takes new sessions while it is ready, alive, not retiring, not being stopped
  or replaced, and has sent a heartbeat within the last 3 intervals. The least-loaded
  such worker is chosen; the spare first for a session whose worker died (or whose
  other-host owner's lease ran out): it takes every such session of the pass, so a dead
  worker's k sessions go over in one transaction and one message; the spare last
  otherwise. Load counts what this pass planned already.
- A turn in flight with no live owner is judged when something asks for it (`trigger`):
  a queued user message, its worker's death, a first touch, or the boot scan or retry
  timer having picked it; not while its next attempt is not due, nor when it was judged
  SKIP and nothing it was judged on changed since (`Memory.settled`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any

from supervisor.core.adoption import adopts
from supervisor.core.recovery import Action, Decision, Trigger
from supervisor.core.vocabulary import AssignReason, SessionKind

HEARTBEATS_MISSED = 3  # a worker silent for this many intervals gets no new sessions

# The assignment reason a worker is given, by what made recovery continue the turn.
RECOVERY_REASON = {Trigger.WORKER_DEATH: AssignReason.ADOPT}


@dataclass(frozen=True)
class SessionView:
    """What the engine reads of a session row (`supervisor.store.SessionInfo` has it)."""

    id: str
    owner: str | None = None  # lease owner: "<host>/<boot>/<worker>"
    lease_expires_at: float | None = None  # database time
    pending: bool = False  # committed input no turn has read yet
    last_seq: int = 0
    active_turn_id: str | None = None  # a turn in flight
    lease_token: int = 0
    status: str = "open"
    kind: str = "attached"

    @classmethod
    def of(cls, row: Any) -> SessionView:
        """The view of a session row (any object with these attributes: `SessionInfo`)."""
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class WorkerView:
    """What the engine reads of one worker process."""

    name: str
    ready: bool = True
    alive: bool = True
    spare: bool = False
    sessions: int = 0  # how many it owns
    last_heartbeat: float = 0.0  # monotonic time
    retiring: bool = False
    stop_requested: bool = False
    aborted: bool = False
    replacing: bool = False


@dataclass(frozen=True)
class Memory:
    """Everything recovery remembers of one session during a boot, in one record (kept
    by `Recollection`, which alone makes a new one)."""

    touched: bool = False  # a request touched it (first touch)
    died: bool = False  # its worker died during this boot
    picked: Trigger | None = None  # chosen by the boot scan or the retry timer
    due: float | None = None  # when its next attempt may start
    quiet: tuple[Any, ...] | None = None  # the SKIP (or hold) already logged
    settled: tuple[Any, ...] | None = None  # a SKIP not worth judging again, by its facts
    last_attempt: tuple[str, float] | None = None  # (turn, when) of the latest attempt


def settled_key(session: SessionView, trigger: Trigger, breaker_tripped: bool) -> tuple[Any, ...]:
    """The facts a SKIP was judged on: while they stay the same, it stays a SKIP."""
    return (
        session.last_seq,
        session.pending,
        session.owner,
        session.lease_token,
        session.status,
        trigger,
        breaker_tripped,
    )


@dataclass(frozen=True)
class Budget:
    """How much one pass may start: assignments (one transaction for all of them) and
    judgements (their tails read in one trip to a thread)."""

    assign: int = 200  # one transaction and one message per worker, whatever the count
    judge: int = 100  # each reads a turn's tail (in one trip to a thread for the pass)


@dataclass(frozen=True)
class Wake:
    """Tell `worker`, the owner, that the session has new input up to `seq`."""

    session: str
    worker: str
    seq: int


@dataclass(frozen=True)
class Move:
    """Take the session from `worker`: it is gone or stopped renewing the lease."""

    session: str
    worker: str
    renewing: bool  # the worker is alive: log that it stopped renewing
    taken: bool = False  # another daemon holds a newer lease: tell the worker to stop it


@dataclass(frozen=True)
class Assign:
    """Lease the session to `worker` and send it an `assign`."""

    session: str
    worker: str
    reason: AssignReason


@dataclass(frozen=True)
class Judge:
    """Look the turn's tail up and let recovery decide; `worker` is held for it."""

    session: str
    trigger: Trigger
    worker: str


Command = Wake | Move | Assign | Judge


@dataclass(frozen=True)
class Facts:
    """Who this daemon is, and the settings the engine reads."""

    owner_prefix: str  # "<host>/<boot>": lease owners of this boot's workers
    host_prefix: str  # "<host>/"
    heartbeat_interval: float
    budget: Budget = field(default_factory=Budget)
    breaker_tripped: bool = False
    stopping: bool = False
    live_hosts: tuple[str, ...] = ()  # the daemons on the database that are alive
    adopting: bool = True  # False while this daemon stops: no other host's session

    @property
    def host(self) -> str:
        return self.host_prefix.rstrip("/")


def plan(
    sessions: Iterable[SessionView],
    workers: Mapping[str, WorkerView],
    assigned: Mapping[str, str],
    woken: Mapping[str, int],
    memory: Mapping[str, Memory],
    facts: Facts,
    *,
    now: float,
    wall: float,
    monotonic: float,
    busy: frozenset[str] = frozenset(),
    tokens: Mapping[str, int] | None = None,
) -> list[Command]:
    """One dispatch pass: what to do with each session with work, user input first.

    `now` is the database's time (leases), `wall` recovery's (attempts are due by it),
    `monotonic` the pool's (heartbeats);
    `assigned` maps a session to the worker the pool gave it, `tokens` to the lease token
    it granted, `woken` to the `last_seq` its owner was last told of.
    """
    commands: list[Command] = []
    later: list[tuple[SessionView, Trigger | None]] = []  # free sessions, by priority
    tokens = tokens or {}
    for s in sessions:
        owner_name = assigned.get(s.id)
        owner = workers.get(owner_name) if owner_name is not None else None
        lease_live = s.lease_expires_at is not None and s.lease_expires_at >= now
        granted = tokens.get(s.id)
        taken = granted is not None and s.lease_token > granted
        if owner is not None and owner.alive and lease_live and not taken:
            if s.pending and woken.get(s.id) != s.last_seq:
                commands.append(Wake(s.id, owner.name, s.last_seq))
            continue
        if owner_name is not None:
            commands.append(Move(s.id, owner_name, owner is not None and owner.alive, taken))
        ours = s.owner is None or s.owner.startswith(facts.host_prefix)
        if s.id in busy or facts.stopping:
            continue
        if not ours and (
            lease_live or not facts.adopting or not adopts(s, facts.host, facts.live_hosts, now)
        ):
            continue
        if s.active_turn_id is None:
            later.append((s, None))
            continue
        m = memory.get(s.id, Memory())
        trigger = trigger_for(s, m, facts)
        if trigger is None or (m.due is not None and wall < m.due):
            continue  # left for the boot scan, the retry timer or a first touch
        if m.settled == settled_key(s, trigger, facts.breaker_tripped):
            continue
        later.append((s, trigger))
    # User input first (pending), then the continuation of interrupted turns; each kind
    # in the order the store gave (oldest first).
    later.sort(key=lambda item: not item[0].pending)
    loads = {w.name: w.sessions for w in workers.values()}
    spares = {w.name for w in workers.values() if w.spare}
    fresh = monotonic - HEARTBEATS_MISSED * facts.heartbeat_interval
    eligible = [w for w in workers.values() if takes_sessions(w, fresh)]
    assigns = judges = 0
    for s, trigger in later:
        if trigger is None:
            if assigns >= facts.budget.assign:
                continue
            target = choose(eligible, loads, spares, prefer_spare=False)
            if target is None:
                break  # no ready worker now; the next pass tries again
            assigns += 1
            commands.append(Assign(s.id, target, AssignReason.NEW))
        else:
            if judges >= facts.budget.judge:
                continue
            # The spare takes a dead worker's sessions: it is there for them.
            spare = trigger is Trigger.WORKER_DEATH
            target = choose(eligible, loads, spares, prefer_spare=spare)
            if target is None:
                break  # no ready worker (yet): judge it when one is
            judges += 1
            commands.append(Judge(s.id, trigger, target))
        loads[target] += 1
        if trigger is not Trigger.WORKER_DEATH:
            spares.discard(target)  # the spare takes ALL a dead worker's sessions: one message
    return commands


def trigger_for(session: SessionView, memory: Memory, facts: Facts) -> Trigger | None:
    """Why an ownerless session with a turn in flight should be looked at, if at all."""
    if session.pending:
        return Trigger.USER_MESSAGE
    if session.kind == SessionKind.SCHEDULED:
        return None  # never continued: the scheduler ends the turn with a notice
    if memory.died or (session.owner or "").startswith(facts.owner_prefix + "/"):
        return Trigger.WORKER_DEATH
    if session.owner and not session.owner.startswith(facts.host_prefix):
        return Trigger.WORKER_DEATH  # another host's lease ran out: it stopped
    if memory.touched:
        return Trigger.FIRST_TOUCH
    return memory.picked


def scan_targets(
    sessions: Iterable[SessionView], memory: Mapping[str, Memory], facts: Facts, trigger: Trigger
) -> list[tuple[SessionView, Trigger]]:
    """The interrupted sessions a boot scan or retry timer judges, each with its trigger.

    Left out: no turn in flight; already picked by an earlier pass; another host's (its
    lease decides, and the pool takes it over when that runs out); held by a worker of
    this boot, alive or dead (the pool's call). An autonomous run resumes as such.
    Subagents have a pass of their own (`Trigger.SUBAGENT_RESUME`, with its own cap): a
    main scan leaves them out, and theirs takes nothing else.
    """
    targets: list[tuple[SessionView, Trigger]] = []
    for s in sessions:
        m = memory.get(s.id)
        if s.active_turn_id is None or (m is not None and m.picked is not None):
            continue
        if (s.kind == SessionKind.SUBAGENT) != (trigger is Trigger.SUBAGENT_RESUME):
            continue
        if s.kind == SessionKind.SCHEDULED:
            continue  # never continued: the scheduler ends the turn with a notice
        if s.owner and not s.owner.startswith(facts.host_prefix):
            continue
        if s.owner and s.owner.startswith(facts.owner_prefix + "/"):
            continue
        autonomous = s.kind == "autonomous"
        targets.append((s, Trigger.AUTONOMOUS_RESUME if autonomous else trigger))
    return targets


def takes_sessions(worker: WorkerView, fresh: float) -> bool:
    """True when the worker may be given a session (heard from since `fresh`)."""
    return (
        worker.ready
        and worker.alive
        and not worker.retiring
        and not worker.stop_requested
        and not worker.aborted
        and not worker.replacing
        and worker.last_heartbeat >= fresh
    )


def choose(
    eligible: Iterable[WorkerView],
    loads: Mapping[str, int],
    spares: set[str] | frozenset[str],
    *,
    prefer_spare: bool,
) -> str | None:
    """The least-loaded eligible worker, the spare first or last as asked."""
    best = min(
        eligible,
        key=lambda w: ((w.name in spares) != prefer_spare, loads.get(w.name, 0), w.name),
        default=None,
    )
    return None if best is None else best.name


class Next(Enum):
    """What the pool does with a judged session."""

    CONTINUE = "continue"  # charge the attempt, then assign (reason by trigger)
    DRIVE = "drive"  # a queued user message drives the next turn: assign it as new
    CARRY_OUT = "carry_out"  # recovery carries the decision out (note, schedule, skip)


def after_judgement(decision: Decision, trigger: Trigger) -> tuple[Next, AssignReason | None]:
    """What a judged session comes to, and the reason of its assignment if any."""
    if decision.action is Action.CONTINUE:
        return Next.CONTINUE, RECOVERY_REASON.get(trigger, AssignReason.RESTART)
    if decision.action is Action.DRIVE_WITH_QUEUED_MESSAGE:
        return Next.DRIVE, AssignReason.NEW
    return Next.CARRY_OUT, None


def charged(memory: Memory, turn_id: str, at: float) -> Memory:
    """The record after an attempt at `turn_id` was charged at `at`."""
    return replace(
        memory, last_attempt=(turn_id, at), due=None, picked=None, quiet=None, settled=None
    )


class Granted(Enum):
    """What a session picked for a worker comes to once the lease grant has answered."""

    SKIPPED = "skipped"  # a continuation the turn outran, or another daemon took: no charge
    DROPPED = "dropped"  # no lease, or its worker is gone: nothing was charged
    REFUND = "refund"  # charged with the lease, but its worker is gone: give it back
    ASSIGN = "assign"  # leased (and charged, if a continuation): tell the worker


@dataclass(frozen=True)
class AfterGrant:
    """The decision after a grant: whether the attempt is charged, and what comes next."""

    charged: bool
    then: Granted


def after_grant(
    *, continuation: bool, leased: bool, moved_on: bool, raced: bool, alive: bool
) -> AfterGrant:
    """What a grant's answer means for one pick. A continuation is charged with its lease,
    in the grant's transaction, unless the turn moved on or another daemon took the
    session first; a lease whose worker died meanwhile is not handed out, and a charge
    that went with it is refunded."""
    if continuation and (moved_on or raced):
        return AfterGrant(False, Granted.SKIPPED)
    charged_now = continuation and leased
    if not leased:
        return AfterGrant(False, Granted.DROPPED)
    if not alive:
        return AfterGrant(charged_now, Granted.REFUND if charged_now else Granted.DROPPED)
    return AfterGrant(charged_now, Granted.ASSIGN)


class Recollection:
    """What recovery remembers during one boot, owned here and changed only through the
    event methods below (h11's manner: the caller says what happened, the record moves).

    - `memory`: one `Memory` a session, read by `plan` and `scan_targets`;
    - `attention`: the sessions a pass must read by id (touched, a dead worker's, picked
      by a scan, an attempt coming due), so no pass scans every session for them.
    """

    def __init__(self) -> None:
        self._memory: dict[str, Memory] = {}
        self._attention: set[str] = set()

    # --- reads ----------------------------------------------------------------------

    @property
    def memory(self) -> Mapping[str, Memory]:
        """Every session's record (read-only)."""
        return MappingProxyType(self._memory)

    def of(self, session_id: str) -> Memory:
        """The session's record (an empty one if nothing is remembered)."""
        return self._memory.get(session_id, EMPTY)

    def attention(self) -> set[str]:
        """The sessions a pass must read by id, as of now (a copy)."""
        return set(self._attention)

    def next_due_in(self, now: float) -> float:
        """Seconds from `now` until the earliest scheduled attempt is due (inf if none)."""
        dues = [m.due for m in self._memory.values() if m.due is not None and m.due > now]
        return min(dues) - now if dues else float("inf")

    # --- events ---------------------------------------------------------------------

    def touched(self, session_id: str) -> bool:
        """A request touched the session; True the first time (a first touch)."""
        memory = self.of(session_id)
        if memory.touched:
            return False
        self._set(session_id, replace(memory, touched=True))
        self._attention.add(session_id)
        return True

    def died(self, session_ids: Iterable[str]) -> None:
        """The worker of these sessions died during this boot."""
        for session_id in session_ids:
            self._set(session_id, replace(self.of(session_id), died=True))
            self._attention.add(session_id)

    def picked(self, session_ids: Iterable[str], trigger: Trigger) -> None:
        """The boot scan or the retry timer chose these sessions."""
        for session_id in session_ids:
            self._set(session_id, replace(self.of(session_id), picked=trigger))
            self._attention.add(session_id)

    def assigned(self, session_id: str) -> None:
        """The session has a new owner: its old owner's death is history."""
        if session_id in self._memory:
            self._set(session_id, replace(self._memory[session_id], died=False))

    def charged(self, session_id: str, turn_id: str, at: float) -> None:
        """An attempt at `turn_id` was charged at `at`."""
        self._set(session_id, charged(self.of(session_id), turn_id, at))

    def refunded(self, session_id: str, turn_id: str) -> None:
        """The attempt at `turn_id` was given back: it is not the latest any more."""
        memory = self.of(session_id)
        if memory.last_attempt and memory.last_attempt[0] == turn_id:
            self._set(session_id, replace(memory, last_attempt=None))

    def quieted(self, session_id: str, key: tuple[Any, ...]) -> bool:
        """A SKIP (or hold) of `key` is to be logged; True if it was not logged already."""
        memory = self.of(session_id)
        if memory.quiet == key:
            return False
        self._set(session_id, replace(memory, quiet=key))
        return True

    def skipped(self, session_id: str, settled: tuple[Any, ...], quiet: tuple[Any, ...]) -> bool:
        """Judged SKIP on `settled` facts; True if this SKIP is new (to be logged)."""
        self._set(session_id, replace(self.of(session_id), settled=settled))
        return self.quieted(session_id, quiet)

    def scheduled(self, session_id: str, at: float, trigger: Trigger | None = None) -> bool:
        """The next attempt is due at `at`; True if that changed. Kept in view: the pass
        at `at` reads it by id. Scheduled by a boot scan or a retry timer (an attempt an
        earlier boot charged, due after a restart), it stays that pass's pick, so the pass
        at `at` judges it again (`trigger_for`) rather than leaving it to the next sweep."""
        self._attention.add(session_id)
        memory = self.of(session_id)
        if trigger is not None and trigger.unattended and memory.picked is None:
            memory = replace(memory, picked=trigger)
        if memory.due == at and memory == self.of(session_id):
            return False
        self._set(session_id, replace(memory, due=at))
        return True

    def ended(self, session_id: str) -> None:
        """The interruption was settled (a notice, a give-up) or a queued message drives
        the next turn: nothing is due or picked any more."""
        self._set(session_id, replace(self.of(session_id), due=None, picked=None))

    def forget_quiet(self) -> None:
        """The breaker changed: every SKIP is worth logging again."""
        for session_id, memory in list(self._memory.items()):
            if memory.quiet is not None:
                self._memory[session_id] = replace(memory, quiet=None)

    def served(self, served: set[str], left: set[str], found: set[str]) -> None:
        """A pass took `served` in hand and did not act on `left` (`found`: those of them
        that still have work). Kept in view of `left`: those still owed a judgement (a dead
        worker's, picked by a scan, or with an attempt to come due); a touch judged SKIP
        is the full pass's to find again."""
        self._attention -= served
        for session_id in left:
            m = self._memory.get(session_id)
            if (
                session_id not in found
                or m is None
                or not (m.died or m.picked is not None or m.due is not None)
            ):
                self._attention.discard(session_id)

    def _set(self, session_id: str, memory: Memory) -> None:
        self._memory[session_id] = memory


EMPTY = Memory()


class Step(Enum):
    """What a worker's session runner does after reading its session row."""

    LEASE_LOST = "lease_lost"  # a newer token holds the session: give up
    IDLE = "idle"  # nothing to run: wait for a wake
    SUPERSEDE = "supersede"  # a queued user message ends the turn in flight and drives one
    CONTINUE = "continue"  # go on with the interrupted turn (a continuation)
    START = "start"  # start a turn for the pending input


def runner_step(
    session: SessionView, token: int, reason: AssignReason | str = AssignReason.NEW
) -> Step:
    """The runner's choice, from the session row, its lease token and its assign reason.

    A handed-over session (`handoff`) continues its turn even with a message queued: the
    turn was cut at an event boundary, not lost, and the message drives the next one.
    """
    if session.lease_token != token:
        return Step.LEASE_LOST
    if session.status != "open" or not (session.active_turn_id or session.pending):
        return Step.IDLE
    if session.active_turn_id and session.pending and reason != AssignReason.HANDOFF:
        return Step.SUPERSEDE
    if session.active_turn_id:
        return Step.CONTINUE
    return Step.START
