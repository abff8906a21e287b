"""What the desks of one session's turns share: the subagents' (`workers.spawning`),
the tasks' (`workers.tasking`) and the restarts' (`workers.restarting`). Each writes for
the session with the lease token its turns write with, then signals the supervisor of
what it committed (a signal only: the supervisor reads the rows)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from supervisor.store import Store

Notify = Callable[..., Awaitable[None]]


class SessionDesk:
    """Writes for one session's turns, with the lease token they write with."""

    def __init__(
        self, session_id: str, store: Store, token: Callable[[], int], notify: Notify
    ) -> None:
        self.session_id = session_id
        self._store = store
        self._token = token
        self._notify = notify

    async def _committed(self, session: str, seq: int | None, event_type: str) -> None:
        """Tell the supervisor that `session` committed `seq`, an event of `event_type`."""
        await self._notify("committed", session=session, seq=seq, event_type=event_type)
