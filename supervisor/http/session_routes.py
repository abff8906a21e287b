"""The routes of sessions themselves: create, list, read, and bind one to a delivery target.

- `POST /v1/sessions`: a new session; the caller gets admin on it. With `deliver_to` it
  is bound to that delivery target from its first event on.
- `GET /v1/sessions`: the sessions the caller may read (all for the admin token), a page
  at a time (`limit`, `offset`, `next_offset`), newest first (`order=activity`: the last
  active first), found by `q` (a title contains it or an id starts with it) and `status`.
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
from supervisor.core.vocabulary import EventType, Permission, SessionStatus
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
from supervisor.store.waiting import may_wait, waiting_for

MAX_LISTED = 1000  # sessions one answer lists (`limit`)
LISTED = 100  # ... unless told
MAX_OFFSET = 1_000_000  # sessions a page may skip (`offset`)
MAX_QUERY = 200  # characters of `q`
ORDERS = ("created", "activity")


def session_out(
    info: SessionInfo,
    permission: str | None = None,
    waiting: str | None = None,
    operator: bool = False,
) -> SessionOut:
    """A session as the API answers it, with the caller's permission on it and what it
    waits for, when known; the worker holding its lease (host, boot, slot) only for the
    admin token, which alone sees hosts and boots."""
    return SessionOut.model_validate(
        {
            **info.to_dict(),
            "owner": info.owner if operator else None,
            "quarantined_at": info.quarantined_at,
            "quarantine_reason": info.quarantine_reason,
            "waiting": waiting,
            "permission": permission,
        }
    )


def statuses(value: str | None) -> list[str]:
    """The `status` query parameter: states joined by commas (none: every state)."""
    if not value:
        return []
    named = value.split(",")
    known = [s.value for s in SessionStatus]
    for name in named:
        if name not in known:
            raise ApiError(
                422,
                "invalid",
                f"status: {name[:40]!r} is not a session state; use {', '.join(known)} "
                "(several joined by commas)",
                field="status",
            )
    return named


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
        detail = await self.detail(info, request[PRINCIPAL])
        return answer(detail, 201, {"Location": f"/v1/sessions/{info.id}"})

    async def list(self, request: web.Request) -> web.Response:
        query = request.query
        limit = whole(query.get("limit"), "limit", LISTED, 1, MAX_LISTED)
        offset = whole(query.get("offset"), "offset", 0, 0, MAX_OFFSET)
        text = query.get("q", "").strip()
        if len(text) > MAX_QUERY:
            raise ApiError(422, "invalid", f"q: at most {MAX_QUERY} characters", field="q")
        order = query.get("order", "created")
        if order not in ORDERS:
            raise ApiError(
                422, "invalid", f"order: {order[:40]!r}; use {' or '.join(ORDERS)}", field="order"
            )
        wanted = statuses(query.get("status"))
        principal = request[PRINCIPAL]
        admin = principal == ADMIN
        delays = tuple(self.config.recovery.attempt_delays)

        def read() -> tuple[list[SessionOut], bool]:
            found, more = self.store.sessions.page(
                None if admin else principal,
                limit=limit,
                offset=offset,
                text=text,
                statuses=wanted,
                by_activity=order == "activity",
            )
            now = self.store.now()
            return [
                session_out(
                    info,
                    Permission.ADMIN if admin else held,
                    waiting_for(self.store, info, delays) if may_wait(info, now) else None,
                    operator=admin,
                )
                for info, held in found
            ], more

        listed, more = await asyncio.to_thread(read)
        return answer(SessionList(sessions=listed, next_offset=offset + limit if more else None))

    async def get(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.READ)
        return answer(await self.detail(info, request[PRINCIPAL]))

    async def detail(self, info: SessionInfo, principal: str) -> SessionDetail:
        """The session with its use of the context window, what it waits for and the
        caller's permission on it."""
        window = self.config.model.context_window
        delays = tuple(self.config.recovery.attempt_delays)

        def read() -> tuple[dict[str, Any], str | None, str | None]:
            use = self.store.events.context_use(info.id, window)
            waiting = waiting_for(self.store, info, delays)
            held = (
                Permission.ADMIN
                if principal == ADMIN
                else self.store.acl.permission(info.id, principal)
            )
            return use, waiting, held

        use, waiting, held = await asyncio.to_thread(read)
        out = session_out(info, held, waiting, operator=principal == ADMIN)
        return SessionDetail.model_validate({**out.model_dump(), "context": use})

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
        held = (
            Permission.ADMIN
            if principal == ADMIN
            else await asyncio.to_thread(self.store.acl.permission, info.id, principal)
        )
        return answer(session_out(bound, held, operator=principal == ADMIN))

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
