"""The routes of sessions themselves: create, list, read, and bind one to a delivery target.

- `POST /v1/sessions`: a new session; the caller gets admin on it. With `deliver_to` it
  is bound to that delivery target from its first event on.
- `GET /v1/sessions`: the sessions the caller may read (all for the admin token).
- `GET /v1/sessions/{id}` (read): one session.
- `PUT /v1/sessions/{id}` (write) `{"deliver_to": NAME | null}`: bind the session to a
  target, or unbind it; its events from the next commit on are delivered (or not).

A target is the operator's (`[[delivery.targets]]`): a request only names one, and a
name that is not configured is a 422 on `deliver_to`. No URL ever comes from a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.core import autonomy
from supervisor.core.vocabulary import EventType, Permission
from supervisor.http.answers import PRINCIPAL, ApiError, answer, read_body, whole
from supervisor.http.auth import ADMIN
from supervisor.http.lifecycle import Lookup
from supervisor.http.schemas import (
    CreateSession,
    SessionDetail,
    SessionList,
    SessionOut,
    SessionUpdate,
)
from supervisor.http.storage import StorageHealth
from supervisor.store import SessionInfo, SessionNotFound, Store, TooManySessions

MAX_LISTED = 1000  # sessions one answer lists (`limit`)
LISTED = 100  # ... unless told


def session_out(info: SessionInfo) -> SessionOut:
    """A session as the API answers it."""
    return SessionOut.model_validate(info.to_dict())


class Waker(Protocol):
    """What these routes tell the pool (`supervisor.pool.Pool` is one)."""

    def wake(self, session_id: str) -> None: ...


class SessionRoutes:
    """The handlers of the four routes (the module docstring)."""

    def __init__(
        self,
        config: Config,
        store: Store,
        storage: StorageHealth,
        session: Lookup,
        refuse: Callable[[], None],
        pool: Waker | None,
    ) -> None:
        self.config = config
        self.store = store
        self.storage = storage
        self.session = session
        self.refuse = refuse  # the API's: 503 once the daemon is stopping
        self.pool = pool

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/sessions", self.create)
        router.add_get("/v1/sessions", self.list)
        router.add_get("/v1/sessions/{id}", self.get)
        router.add_put("/v1/sessions/{id}", self.update)

    async def create(self, request: web.Request) -> web.Response:
        self.refuse()
        body = await read_body(request, CreateSession, self.config.http.read_timeout)
        allowed = self.config.agent.allowed_classes()
        if body.agent and body.agent not in allowed:
            # Decided here, before anything is stored or imported: an agent is code.
            raise ApiError(
                422,
                "invalid",
                f"agent: {body.agent!r} is not an agent this daemon runs; "
                f"allowed: {', '.join(allowed)} (the operator lists them in agent.allowed)",
                field="agent",
            )
        deliver = None
        if body.deliver_to is not None:
            target = self.target(body.deliver_to, request[PRINCIPAL])
            deliver = (target.name, " ".join(sorted(target.events)))
        first: list[tuple[str, dict[str, Any]]] = []
        if body.run is not None:
            now = SYSTEM.time()
            r = body.run
            deadline = None if r.deadline_seconds is None else now + r.deadline_seconds
            run = autonomy.Run(r.goal, r.prompt, r.max_turns, r.max_tokens, deadline)
            first = [
                (EventType.CHECKPOINT, run.start_payload(now)),
                (EventType.USER_MESSAGE, {"text": r.goal}),
            ]
        try:
            info = await asyncio.to_thread(
                self.store.sessions.create,
                request[PRINCIPAL],
                kind=body.kind,
                title=body.title,
                agent=body.agent,
                events=first,
                deliver=deliver,
                max_open=self.config.auth.max_open_sessions_per_principal,
            )
        except TooManySessions as exc:
            raise ApiError(429, "too_many_sessions", str(exc)) from None
        self.storage.worked()
        if first and self.pool is not None:
            self.pool.wake(info.id)
        detail = await self.detail(info)
        return answer(detail, 201, {"Location": f"/v1/sessions/{info.id}"})

    async def list(self, request: web.Request) -> web.Response:
        limit = whole(request.query.get("limit"), "limit", LISTED, 1, MAX_LISTED)
        principal = request[PRINCIPAL]
        sessions = await asyncio.to_thread(
            self.store.sessions.list, None if principal == ADMIN else principal, limit
        )
        return answer(SessionList(sessions=[session_out(s) for s in sessions]))

    async def get(self, request: web.Request) -> web.Response:
        return answer(await self.detail(await self.session(request, Permission.READ)))

    async def detail(self, info: SessionInfo) -> SessionDetail:
        """The session with its use of the context window."""
        window = self.config.model.context_window
        use = await asyncio.to_thread(self.store.events.context_use, info.id, window)
        return SessionDetail.model_validate({**info.to_dict(), "context": use})

    async def update(self, request: web.Request) -> web.Response:
        self.refuse()
        info = await self.session(request, Permission.WRITE)
        body = await read_body(request, SessionUpdate, self.config.http.read_timeout)
        principal = request[PRINCIPAL]
        current = self.config.delivery.target(info.deliver_to) if info.deliver_to else None
        if current is not None and not may_use(current, principal):
            # Unbinding or rebinding takes the replies away from the current target: only
            # those that may send to it may.
            raise ApiError(
                403,
                "forbidden",
                f"deliver_to: {principal!r} may not change where this session's replies go: "
                f"its target {current.name!r} lists the principals who may",
                field="deliver_to",
            )
        if body.deliver_to is None:
            name, kinds = None, []
        else:
            target = self.target(body.deliver_to, principal)
            name, kinds = target.name, list(target.events)
        try:
            bound = await asyncio.to_thread(self.store.deliveries.bind, info.id, name, kinds)
        except SessionNotFound:
            raise ApiError(404, "not_found", f"no session {info.id!r}") from None
        self.storage.worked()
        return answer(session_out(bound))

    def target(self, name: str, principal: str) -> DeliveryTarget:
        """The configured target called `name`, else a 422 naming those there are; a 403
        if the target names the principals that may use it and `principal` is not one."""
        found = self.config.delivery.target(name)
        if found is not None:
            if not may_use(found, principal):
                raise ApiError(
                    403,
                    "forbidden",
                    f"deliver_to: {principal!r} may not send sessions to target {found.name!r} "
                    "(its principals list who may)",
                    field="deliver_to",
                )
            return found
        # Only the targets the caller may use are named: the others are none of its business.
        names = [t.name for t in self.config.delivery.targets if may_use(t, principal)]
        there = (
            f"yours to use: {', '.join(names)}"
            if names
            else "none you may use: the operator lists them in [[delivery.targets]]"
        )
        raise ApiError(
            422,
            "invalid",
            f"deliver_to: {name[:60]!r} is not a delivery target of this daemon ({there}); "
            "a session names a target, never a URL",
            field="deliver_to",
        )


def may_use(target: DeliveryTarget, principal: str) -> bool:
    """Whether `principal` may send sessions to `target` (or take one away from it): any
    principal where the target lists none, else the admin and those it lists."""
    return not target.principals or principal == ADMIN or principal in target.principals
