"""The routes that end something: a turn in flight (interrupt), a session (close), a
quarantine (release).

The rules are the store's (`supervisor.store.lifecycle`), each one transaction, the same
for the API and the command line; these routes check who may, tell the pool, and wake
the session's attach streams for what was written.

- `POST /v1/sessions/{id}/interrupt` (write): the turn in flight ends for good.
- `DELETE /v1/sessions/{id}` (admin): the session is closed; again is 200 again.
- `POST /v1/sessions/{id}/release` (write): a quarantine is lifted; the poisoned turn is
  ended `failed` and never retried.

An interrupt and a close cancel the session's running subagents too, theirs as well, in
the same transaction (their turns ended, their leases revoked); the route then stops the
workers running them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from supervisor.core.vocabulary import EventType, Permission, SessionKind, SessionStatus
from supervisor.http.answers import PRINCIPAL, ApiError, answer
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

    def streamed_so_far(self, session_id: str) -> tuple[str, str, bool] | None: ...


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
        # What the model streamed so far is committed as the cut answer, with the end.
        streamed = self.pool.streamed_so_far(info.id) if self.pool is not None else None
        written = await asyncio.to_thread(
            self.store.sessions.interrupt, info.id, request[PRINCIPAL], streamed
        )
        seq = written[-1][0] if written else None
        if written:
            self._publish(info.id, written)
            self._stop_worker(info.id)
        await self._stop_subagents(info.id)  # cancelled even when the session was idle
        await self._report_if_subagent(info)
        return answer(Interrupted(interrupted=seq is not None, seq=seq))

    async def close(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.ADMIN)
        written = await asyncio.to_thread(self.store.sessions.close, info.id, request[PRINCIPAL])
        if written:
            self._publish(info.id, written)
            self._stop_worker(info.id)  # its turn, or its idle runner: it runs nothing more
            await self._stop_subagents(info.id)
            await self._report_if_subagent(info)
        return answer(Closed(id=info.id))

    async def release(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.WRITE)
        written = await asyncio.to_thread(self.store.sessions.release, info.id, request[PRINCIPAL])
        status = SessionStatus(info.status)
        if written:
            self._publish(info.id, written)
            status = SessionStatus.OPEN
            if self.pool is not None:
                self.pool.wake(info.id)  # input sent while it was quarantined runs now
        return answer(Released(id=info.id, released=bool(written), status=status))

    def _stop_worker(self, session_id: str) -> None:
        if self.pool is not None:
            self.pool.interrupt(session_id)

    async def _stop_subagents(self, session_id: str) -> None:
        """Stop the workers of the session's subagents, which the store cancelled.

        Only a signal: their leases were revoked with the cancellation, so a worker that
        misses it commits nothing more anyway. A child that had ended already runs nothing,
        and the signal is a no-op for it.
        """
        if self.pool is None:
            return
        for child_id in await asyncio.to_thread(self.store.subagents.descendants, session_id):
            self.pool.interrupt(child_id)

    async def _report_if_subagent(self, info: SessionInfo) -> None:
        """A subagent interrupted or closed itself is over: its parent is told now (once;
        the reconciler would tell it at its next pass otherwise) and runs a turn on it."""
        if info.kind == SessionKind.SUBAGENT:
            done = await asyncio.to_thread(self.store.subagents.report, info.id)
            if done is not None:
                self._publish(done.parent, [(done.seq, EventType.SUBAGENT_RESULT)])
                if self.pool is not None:  # its parent hears of it now, as of any result
                    self.pool.wake(done.parent)

    def _publish(self, session_id: str, written: list[tuple[int, EventType]]) -> None:
        """Count and signal what the store wrote for this route."""
        for seq, kind in written:
            self.publish(session_id, {"seq": seq, "type": kind})
