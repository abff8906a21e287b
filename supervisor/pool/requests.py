"""What requests and the other services tell the pool about sessions: signals only,
each carried out by `Ownership`."""

from __future__ import annotations

from supervisor.core.vocabulary import INPUT_EVENTS
from supervisor.pool.ownership import Ownership
from supervisor.runtime.bus import Bus, Committed, Published


class Requests:
    """The request side of `supervisor.pool.pool.Pool`."""

    ownership: Ownership
    bus: Bus

    def wake(self, session_id: str) -> None:
        """New input was committed for the session: wake its owner, or find it one."""
        self.ownership.wake(session_id)

    def _committed(self, event: Committed) -> None:
        """An event was committed (only a signal: readers read it from the database); its
        readers hear of it, and new input (a subagent's task, or its result) wakes its
        session's owner."""
        self.bus.publish(Published(event.session, {"seq": event.seq, "type": event.event_type}))
        if event.wake and event.event_type in INPUT_EVENTS:
            self.wake(event.session)

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on."""
        self.ownership.touch(session_id)

    def interrupt(self, session_id: str) -> None:
        """The session's turn was ended in the database (interrupt, close): stop it now."""
        self.ownership.interrupt(session_id)
