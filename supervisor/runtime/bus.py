"""The in-process event bus: what one service tells the others, typed.

A service publishes a fact (`Committed`, `Published`, `WorkerExited`, `TurnEnded`,
`HostsLost`, `Woken`, `Stopping`); the services that care subscribe to its type when
they are built. A reload's configuration is not an event: the root hands it to each
service (`Root.reconfigure`), which may refuse it.
Nobody calls into another service to say "look again": the publisher does not know who
listens. Handlers run at once, in the publisher's call, in the order they subscribed; they
must not block (a handler wakes its own loop, it does not do the loop's work). A handler
that raises is logged and the others still run: one service's bug does not stop the
message from reaching the rest.

Facts cross processes by other ways (the control plane, the database); the bus is this
process's only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from supervisor.contract.logs import log


@dataclass(frozen=True)
class Committed:
    """An event was committed to a session's log by the supervisor (a result, an
    outcome, a scheduled message); `wake`: the session has input to take."""

    session: str
    seq: int
    event_type: str
    wake: bool = True


@dataclass(frozen=True)
class Published:
    """An event of a session for its readers (attach streams, deliveries, tasks,
    restarts): what a worker or the supervisor committed, as readers see it."""

    session: str
    event: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Delta:
    """Live output of a turn in flight, from its worker (`supervisor.contract.control.
    Delta`): for attach streams only. Never stored, never replayed, never delivered."""

    session: str
    turn: str
    index: int
    text: str = ""
    tool_call: str | None = None


@dataclass(frozen=True)
class WorkerExited:
    """A worker process is gone (its sentinel fired); its sessions are being adopted."""

    identity: str


@dataclass(frozen=True)
class TurnEnded:
    """A session's turn was ended in the database (a result reported, a cancel): its
    worker, if one of this daemon's runs it, stops it now."""

    session: str


@dataclass(frozen=True)
class HostsLost:
    """Daemons on the database stopped renewing their host rows (or left): their expired
    leases are adoptable now."""

    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Woken:
    """Another daemon announced new input for a session (PostgreSQL's NOTIFY)."""

    session: str


@dataclass(frozen=True)
class Stopping:
    """The daemon was told to stop (a signal), or to restart in place (`restart`): start
    no new work. A stop's intake refuses from now on; a restart's goes on taking messages
    for the next boot (a SIGTERM during it publishes a stop)."""

    reason: str
    restart: bool = False


E = TypeVar("E")


class Bus:
    """Typed publish/subscribe within the process; see the module's docstring."""

    def __init__(self) -> None:
        self._handlers: dict[type, list[Callable[[Any], None]]] = defaultdict(list)
        self.log = log("bus")

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._handlers[kind].append(handler)

    def publish(self, event: object) -> None:
        for handler in list(self._handlers.get(type(event), ())):
            try:
                handler(event)
            except Exception as exc:
                self.log.opt(exception=exc).error(
                    "{} failed on {}: {!r}", _name(handler), type(event).__name__, exc
                )

    def committed(self, session: str, seq: int, event_type: str, wake: bool = True) -> None:
        """Publish `Committed`: what a service that commits to a session's log calls."""
        self.publish(Committed(session, seq, event_type, wake))

    def subscribers(self) -> dict[str, list[str]]:
        """Who listens to what, by name: for the structure drawn from the code."""
        return {k.__name__: [_name(h) for h in hs] for k, hs in self._handlers.items()}


def _name(handler: Callable[..., Any]) -> str:
    """`Class.method` for a bound method; a lambda is named by the class it was written in
    (`Class.<lambda>`), a function by its qualified name."""
    owner = getattr(handler, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{handler.__name__}"
    qualname = getattr(handler, "__qualname__", repr(handler))
    return qualname.replace(".<locals>", "").replace("__init__.", "")
