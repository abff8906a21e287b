"""Worker-slot states: when a slot's worker is started again, and when the slot gives up.

Pure code: no processes, no clock, no logging. The caller passes the time in (seconds from
any monotonic origin) and logs the `Transition` that every event returns.

Rules
-----
- A slot begins in BACKOFF with restart time 0, so it is due at once (or in a state given
  explicitly). `start(now)` is allowed only when due: BACKOFF -> STARTING, and the
  generation goes up by one; the worker is named `w<slot>.<generation>` (`identity`).
- `ready(now)`: STARTING -> RUNNING, and the slot remembers when. A ready in any other
  state is a late message from a worker already gone: ignored, and the transition says so.
- `exited(now, requested)`: the worker is gone (from STARTING or RUNNING only).
  - While the pool is stopping (`stop_requested()` was called), any exit -> STOPPED.
  - A requested exit (rolling restart, shutdown) is not a crash: BACKOFF, due at once,
    counters unchanged. A hang kill is not requested: it is a crash.
  - Every crash counts, also after ready (supervisord's gap). `crashes` counts consecutive
    crashes of either kind, `failed_starts` those before ready (a ready resets it). At
    `max_failed_starts` in a row -> FATAL: a broken install or plug-in, never restarted.
  - Otherwise BACKOFF with restart_at = now + the shared backoff's delay for `crashes`
    (`supervisor.core.backoff`): 0.5, 1, 2, 4, 8, 16, 30, 30, ... seconds.
  - Running for `healthy_after` seconds forgives the past: a crash after that counts as the
    first one, and a requested exit after that clears the count.
- `due(now)`: BACKOFF and now >= restart_at.
- `stop_requested()`: the pool is stopping; BACKOFF -> STOPPED at once, a live slot on exit.
- FATAL and STOPPED are final. An event the table below does not allow raises `SlotError`,
  except a late ready, which is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from supervisor.core.backoff import Backoff
from supervisor.core.vocabulary import SlotState

__all__ = [
    "DEFAULT_POLICY",
    "BackoffPolicy",
    "Slot",
    "SlotError",
    "SlotState",
    "Transition",
    "all_fatal",
]

Event = Literal["start", "ready", "exit", "stop"]

# Where each event is allowed, and the states it may lead to; `exited` picks among several.
_AFTER_EXIT = (SlotState.BACKOFF, SlotState.FATAL, SlotState.STOPPED)
_TRANSITIONS: dict[tuple[SlotState, Event], tuple[SlotState, ...]] = {
    (SlotState.BACKOFF, "start"): (SlotState.STARTING,),
    (SlotState.STARTING, "ready"): (SlotState.RUNNING,),
    (SlotState.STARTING, "exit"): _AFTER_EXIT,
    (SlotState.RUNNING, "exit"): _AFTER_EXIT,
    (SlotState.BACKOFF, "stop"): (SlotState.STOPPED,),
    (SlotState.STARTING, "stop"): (SlotState.STARTING,),  # STOPPED when its worker exits
    (SlotState.RUNNING, "stop"): (SlotState.RUNNING,),
    (SlotState.FATAL, "stop"): (SlotState.FATAL,),
    (SlotState.STOPPED, "stop"): (SlotState.STOPPED,),
}
# Ignored rather than refused where the table has no entry: a ready can arrive after its
# worker has exited or been replaced.
_IGNORED: frozenset[Event] = frozenset({"ready"})


class SlotError(Exception):
    """An event that the slot's current state does not allow: a bug in the caller."""


@dataclass(frozen=True)
class BackoffPolicy(Backoff):
    """The shared backoff, and when a slot gives up: `max_failed_starts` deaths before ready."""

    max_failed_starts: int = 5  # deaths before ready in a row that make the slot FATAL

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_failed_starts < 1:
            raise ValueError(f"need 0 < initial <= cap, max_failed_starts >= 1: {self}")


DEFAULT_POLICY = BackoffPolicy()


@dataclass(frozen=True)
class Transition:
    """What one event did to a slot, for the caller to log."""

    identity: str  # the worker the event was about, e.g. "w0.3"
    old: SlotState
    new: SlotState
    reason: str
    restart_at: float | None = None  # set when `new` is BACKOFF

    @property
    def changed(self) -> bool:
        """False when the state stayed the same (a late ready, a stop of a live slot)."""
        return self.old is not self.new


class Slot:
    """One place in the worker pool, filled by one worker generation after another."""

    def __init__(
        self,
        index: int,
        policy: BackoffPolicy = DEFAULT_POLICY,
        *,
        state: SlotState = SlotState.BACKOFF,
        restart_at: float = 0.0,
        ready_at: float = 0.0,
        generation: int = 0,
    ) -> None:
        """A slot in `state`; `restart_at` counts in BACKOFF only, `ready_at` in RUNNING."""
        if state in (SlotState.STARTING, SlotState.RUNNING) and generation < 1:
            raise SlotError(f"w{index}: a {state.value} slot needs a generation >= 1")
        self.index = index
        self.policy = policy
        self.state = state
        self.restart_at: float | None = restart_at if state is SlotState.BACKOFF else None
        self.ready_at: float | None = ready_at if state is SlotState.RUNNING else None
        self.generation = generation
        self.failed_starts = 0
        self.crashes = 0
        self.stopping = False

    @property
    def identity(self) -> str:
        """The current worker's name, `w<slot>.<generation>`; generation 0: never started."""
        return f"w{self.index}.{self.generation}"

    def due(self, now: float) -> bool:
        """Whether a worker should be started in this slot now."""
        return self.restart_at is not None and now >= self.restart_at

    def start(self, now: float) -> Transition:
        """Record that a new worker was started: BACKOFF -> STARTING, next generation."""
        self._check("start")
        if not self.due(now):
            raise SlotError(f"{self.identity}: not due until {self.restart_at:g}, now is {now:g}")
        self.generation += 1
        return self._move("start", SlotState.STARTING, "started")

    def ready(self, now: float) -> Transition:
        """Record that the worker reported ready; a late ready is ignored, not refused."""
        if not self._check("ready"):
            return Transition(self.identity, self.state, self.state, "late ready ignored")
        self.ready_at = now
        self.failed_starts = 0  # it did start
        return self._move("ready", SlotState.RUNNING, "ready")

    def exited(self, now: float, requested: bool) -> Transition:
        """Record that the worker is gone; `requested` if the supervisor asked it to stop."""
        self._check("exit")
        ran = now - self.ready_at if self.ready_at is not None else 0.0
        if self.state is SlotState.RUNNING and self.policy.forgives(ran):
            self.crashes = 0
        if self.stopping:
            return self._move("exit", SlotState.STOPPED, "exited while the pool is stopping")
        if requested:
            return self._move("exit", SlotState.BACKOFF, "exited on request", restart_at=now)
        return self._crash(now)

    def stop_requested(self) -> Transition:
        """Mark the pool as stopping: no more restarts; BACKOFF -> STOPPED at once."""
        self._check("stop")
        self.stopping = True
        if self.state is SlotState.BACKOFF:
            return self._move("stop", SlotState.STOPPED, "stop requested")
        return self._move("stop", self.state, "stop requested; stops when its worker exits")

    def _crash(self, now: float) -> Transition:
        before_ready = self.state is SlotState.STARTING
        self.crashes += 1
        if before_ready:
            self.failed_starts += 1
            if self.failed_starts >= self.policy.max_failed_starts:
                reason = f"died before ready {self.failed_starts} times in a row; giving up"
                return self._move("exit", SlotState.FATAL, reason)
        delay = self.policy.delay(self.crashes)
        what = "died before ready" if before_ready else "crashed after ready"
        reason = f"{what} (crash {self.crashes} in a row); restart in {delay:g}s"
        return self._move("exit", SlotState.BACKOFF, reason, restart_at=now + delay)

    def _check(self, event: Event) -> bool:
        """True if `event` is allowed now, False if it is to be ignored; raises if refused."""
        if (self.state, event) in _TRANSITIONS:
            return True
        if event in _IGNORED:
            return False
        raise SlotError(f"{self.identity}: cannot {event} a slot that is {self.state.value}")

    def _move(
        self, event: Event, new: SlotState, reason: str, restart_at: float | None = None
    ) -> Transition:
        assert new in _TRANSITIONS[self.state, event], (self.state, event, new)
        transition = Transition(self.identity, self.state, new, reason, restart_at)
        self.state, self.restart_at = new, restart_at
        if new is not SlotState.RUNNING:
            self.ready_at = None
        return transition


def all_fatal(slots: Iterable[Slot]) -> bool:
    """Whether every slot of a non-empty pool is FATAL (the daemon then exits non-zero)."""
    states = [slot.state for slot in slots]
    return bool(states) and all(state is SlotState.FATAL for state in states)
