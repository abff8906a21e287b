"""The routes that end something: a turn in flight (interrupt), a session (close), a
quarantine (release).

The rules are the store's (`supervisor.store.lifecycle`), each one transaction, the same
for the API and the command line; these routes check who may, tell the pool, and wake
the session's attach streams for what was written.

- `POST /v1/sessions/{id}/interrupt` (write): the turn in flight ends for good.
- `DELETE /v1/sessions/{id}` (admin): the session is closed; again is 200 again.
- `POST /v1/sessions/{id}/release` (write): a quarantine is lifted; the poisoned turn is
  ended `failed` and never retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from supervisor.core.vocabulary import Permission, SessionStatus, Writer
from supervisor.http.answers import ApiError, answer
from supervisor.http.schemas import Closed, Interrupted, Released
from supervisor.store import SessionClosed, SessionInfo, Store

Publish = Callable[[str, dict[str, Any]], None]


class Lookup(Protocol):
    """The session a request names, if its principal holds `need` on it (else 403/404)."""

    def __call__(self, request: web.Request, need: Permission) -> Awaitable[SessionInfo]: ...


class Workers(Protocol):
    """What these routes tell the pool (`supervisor.pool.Pool` is one)."""

    def wake(self, session_id: str) -> None: ...

    def interrupt(self, session_id: str) -> None: ...


def refuse_closed(info: SessionInfo) -> None:
    """A closed session takes nothing that would need a turn (the store says so too)."""
    if info.status == SessionStatus.CLOSED:
        raise ApiError(409, "closed", str(SessionClosed(info.id)))


class Lifecycle:
    """The handlers of the three routes."""

    def __init__(
        self, store: Store, session: Lookup, publish: Publish, pool: Workers | None
    ) -> None:
        self.store = store
        self.session = session
        self.publish = publish
        self.pool = pool

    async def interrupt(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.WRITE)
        seq = await asyncio.to_thread(self.store.sessions.interrupt, info.id, request["principal"])
        if seq is not None:
            await self._publish_after(info.id, seq - 1, limit=1)
            self._stop_worker(info.id)
        return answer(Interrupted(interrupted=seq is not None, seq=seq))

    async def close(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.ADMIN)
        if await asyncio.to_thread(self.store.sessions.close, info.id, request["principal"]):
            await self._publish_after(info.id, info.last_seq, Writer.SUPERVISOR)
            self._stop_worker(info.id)  # its turn, or its idle runner: it runs nothing more
        return answer(Closed(id=info.id))

    async def release(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.WRITE)
        released = await asyncio.to_thread(
            self.store.sessions.release, info.id, request["principal"]
        )
        status = SessionStatus(info.status)
        if released:
            await self._publish_after(info.id, info.last_seq, Writer.SUPERVISOR)
            status = SessionStatus.OPEN
            if self.pool is not None:
                self.pool.wake(info.id)  # input sent while it was quarantined runs now
        return answer(Released(id=info.id, released=released, status=status))

    def _stop_worker(self, session_id: str) -> None:
        if self.pool is not None:
            self.pool.interrupt(session_id)

    async def _publish_after(
        self, session_id: str, after: int, writer: Writer | None = None, limit: int = 1000
    ) -> None:
        """Count and signal what the store wrote for this route: the events after `after`
        (by `writer`: a worker's events in between were signalled by the worker itself)."""
        records = await asyncio.to_thread(self.store.events.read, session_id, after, limit)
        for record in records:
            if writer is None or record.writer == writer:
                self.publish(session_id, record.to_dict())
