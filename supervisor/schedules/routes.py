"""The schedules' routes and their bodies: make, list, read and delete schedules.

- `POST /v1/schedules` `{"cron", "text", "session": ID | null, "timezone": "UTC",
  "misfire": "run_once" | "skip"}`: 201 with the schedule and its next time. On a session
  it needs write access to it; with `session: null` each run makes a new session of kind
  `scheduled` that its owner (the caller) holds admin on. Times closer together than
  `schedules.min_interval` are a 422 on `cron`; past `schedules.max_per_owner` schedules
  of the caller's a 409 `too_many_own_schedules`, past `schedules.max_schedules` in all a
  409 `too_many_schedules`.
- `GET /v1/schedules`: those the caller may read (read access to their session, or its
  own that make a new session each run); `admin` sees all.
- `GET /v1/schedules/{id}`, `DELETE /v1/schedules/{id}` (write access to its session, or
  its own).
- `POST /v1/schedules/{id}/pause` and `.../resume` (write access, as a delete): a held
  schedule does not fire until resumed; resumed, it is armed from now (no time it was
  held for is caught up). A schedule paused because its owner's token was revoked is
  resumed only once the owner is in the tokens file again; an ended one is a 409.

Schedules follow their session's ACL: one the caller may not read is a 404, as if it did
not exist. The rules of firing are `supervisor.schedules.rules`'s; the bodies are here with
the routes (the OpenAPI document takes them from `REQUESTS` and `ANSWERS`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config
from supervisor.contract.cron import MAX_CRON, MAX_TIMEZONE, Cron, CronError, zone
from supervisor.core.vocabulary import FireOutcome, Misfire, Permission, ScheduleStatus
from supervisor.http.answers import PRINCIPAL, ApiError, answer, read_body, whole
from supervisor.http.auth import ADMIN
from supervisor.http.schemas import MAX_TEXT, SESSION_ID_PATTERN
from supervisor.schedules.rules import GAP_SAMPLE, next_due, shortest_gap
from supervisor.store import FireInfo, ScheduleInfo, ScheduleRefused, SessionNotFound, Store

SCHEDULE_ID_PATTERN = r"^s[0-9a-f]{32}$"
SCHEDULE_ID = re.compile(SCHEDULE_ID_PATTERN)
MAX_LISTED = 1000


class CreateSchedule(BaseModel):
    """A schedule: `text` is injected at every time of `cron` in `timezone`."""

    model_config = ConfigDict(extra="forbid")

    cron: str = Field(
        min_length=1,
        max_length=MAX_CRON,
        description="5 fields (minute hour day-of-month month day-of-week), or 6 with "
        "seconds first: `*/2 * * * * *` is every 2 seconds",
    )
    text: str = Field(min_length=1, max_length=MAX_TEXT, description="the message of each run")
    session: str | None = Field(
        default=None,
        pattern=SESSION_ID_PATTERN,
        description="the session each run goes to (write access needed); null: a new "
        "session of kind scheduled for each run, the caller its admin",
    )
    timezone: str = Field(
        default="UTC", min_length=1, max_length=MAX_TIMEZONE, description="an IANA time zone"
    )
    misfire: Misfire = Field(
        default=Misfire.RUN_ONCE,
        description="runs missed while no daemon ran: run_once runs the newest once (within "
        "schedules.misfire_grace), skip runs none",
    )

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        try:
            return Cron(value).expr
        except CronError as exc:
            raise PydanticCustomError("cron", "{message}", {"message": str(exc)}) from None

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        try:
            zone(value)
        except CronError as exc:
            raise PydanticCustomError("timezone", "{message}", {"message": str(exc)}) from None
        return value


class FireOut(BaseModel):
    """One scheduled time of a schedule, and what became of it."""

    scheduled_for: float = Field(description="the scheduled time, epoch seconds")
    outcome: FireOutcome
    session: str | None = Field(description="the session its message went to")
    seq: int | None = Field(description="its message's seq there; null: not injected (yet)")
    fired_at: float
    reason: str | None = Field(description="why its message was not injected, if so")


class ScheduleOut(BaseModel):
    """A schedule, its next time and its latest fire."""

    id: str = Field(pattern=SCHEDULE_ID_PATTERN)
    cron: str
    timezone: str
    text: str
    session: str | None = Field(description="null: each run makes a new session")
    owner: str | None = Field(description="the principal that made it")
    misfire: Misfire
    created_at: float
    status: ScheduleStatus = Field(
        description="active; held (a user paused it: it does not fire until resumed); "
        "paused (its owner's token was revoked: it does not fire until the owner is back "
        "in the tokens file); ended (its session was closed)"
    )
    next_fire_at: float | None = Field(
        description="its next scheduled time, epoch seconds; null: none within 50 years, or "
        "it is not active"
    )
    last_fire: FireOut | None


class ScheduleList(BaseModel):
    """The schedules the caller may read, oldest first."""

    schedules: list[ScheduleOut]


class ScheduleDeleted(BaseModel):
    """The schedule is gone; a time of it not yet injected never will be."""

    id: str = Field(pattern=SCHEDULE_ID_PATTERN)
    deleted: Literal[True] = True


REQUESTS: tuple[type[BaseModel], ...] = (CreateSchedule,)
ANSWERS: tuple[type[BaseModel], ...] = (ScheduleOut, ScheduleList, ScheduleDeleted)


def schedule_out(info: ScheduleInfo, last: FireInfo | None, now: float) -> ScheduleOut:
    """The API shape of a schedule, its next time after `now` and its newest fire."""
    try:
        since = max(info.armed_from, last.scheduled_for if last else info.armed_from)
        upcoming = next_due(Cron(info.cron, info.timezone), since, now)
    except CronError:  # a time zone this machine does not have: it cannot fire here
        upcoming = None
    if info.status != ScheduleStatus.ACTIVE:
        upcoming = None
    fire = None if last is None else FireOut.model_validate(last.to_dict())
    return ScheduleOut.model_validate(
        {**info.to_dict(), "next_fire_at": upcoming, "last_fire": fire}
    )


class ScheduleRoutes:
    """The handlers of the schedules' routes."""

    def __init__(
        self,
        config: Config,
        store: Store,
        refuse: Callable[[], None],
        known: Callable[[str], bool] = lambda principal: True,
    ) -> None:
        self.config = config
        self.store = store
        self.refuse = refuse  # the API's: 503 once the daemon is stopping
        self.known = known  # whether a principal is in the tokens file now

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/schedules", self.create)
        router.add_get("/v1/schedules", self.list)
        router.add_get("/v1/schedules/{id}", self.get)
        router.add_delete("/v1/schedules/{id}", self.delete)
        router.add_post("/v1/schedules/{id}/pause", self.pause)
        router.add_post("/v1/schedules/{id}/resume", self.resume)

    async def create(self, request: web.Request) -> web.Response:
        self.refuse()
        body = await read_body(request, CreateSchedule, self.config.http.read_timeout)
        await asyncio.to_thread(self._often_enough, body)
        principal = request[PRINCIPAL]
        if body.session is not None:
            await self._writable(principal, body.session)
        try:
            info = await asyncio.to_thread(
                self.store.schedules.create,
                cron=body.cron,
                timezone=body.timezone,
                text=body.text,
                session=body.session,
                owner=principal,
                misfire=body.misfire,
                limit=self.config.schedules.max_schedules,
                per_owner=self.config.schedules.max_per_owner,
            )
        except ScheduleRefused as exc:
            raise ApiError(409, exc.code, str(exc)) from None
        except SessionNotFound:
            raise self._unknown_session(body.session) from None
        out = schedule_out(info, None, SYSTEM.time())
        return answer(out, 201, {"Location": f"/v1/schedules/{info.id}"})

    async def list(self, request: web.Request) -> web.Response:
        limit = whole(request.query.get("limit"), "limit", 100, 1, MAX_LISTED)
        principal = request[PRINCIPAL]
        reader = None if principal == ADMIN else principal
        found = await asyncio.to_thread(self.store.schedules.visible, reader, limit)
        newest = await asyncio.to_thread(self.store.schedules.newest, [s.id for s in found])
        now = SYSTEM.time()
        listed = [schedule_out(info, newest.get(info.id), now) for info in found]
        return answer(ScheduleList(schedules=listed))

    async def get(self, request: web.Request) -> web.Response:
        info = await self._schedule(request, Permission.READ)
        newest = await asyncio.to_thread(self.store.schedules.newest, [info.id])
        return answer(schedule_out(info, newest.get(info.id), SYSTEM.time()))

    async def delete(self, request: web.Request) -> web.Response:
        self.refuse()
        info = await self._schedule(request, Permission.WRITE)
        if not await asyncio.to_thread(self.store.schedules.delete, info.id):
            raise ApiError(404, "not_found", f"no schedule {info.id!r}")
        return answer(ScheduleDeleted(id=info.id))

    async def pause(self, request: web.Request) -> web.Response:
        """Hold the schedule: it does not fire until resumed (write access, as a delete).
        Pausing a held schedule again is no error."""
        self.refuse()
        info = await self._schedule(request, Permission.WRITE)
        if info.status not in (ScheduleStatus.ACTIVE, ScheduleStatus.HELD):
            raise ApiError(409, "conflict", self._why_not(info, "paused"))
        await asyncio.to_thread(self.store.schedules.hold, info.id)
        return await self.get(request)

    async def resume(self, request: web.Request) -> web.Response:
        """Let a held schedule fire again, from now on: no time it was held for is caught
        up. Resuming an active one is no error. A schedule paused for its owner's revoked
        token resumes too, once the owner is back in the tokens file (a reload resumes it
        by itself; a start while the owner was restored does not)."""
        self.refuse()
        info = await self._schedule(request, Permission.WRITE)
        if info.status == ScheduleStatus.ENDED:
            raise ApiError(409, "conflict", self._why_not(info, "resumed"))
        if info.owner is not None and not self.known(info.owner):
            raise ApiError(
                409,
                "conflict",
                f"schedule {info.id} is not resumed: its owner {info.owner!r} is not in the "
                "tokens file; resume it once the owner's token is back",
            )
        await asyncio.to_thread(self.store.schedules.release, info.id)
        return await self.get(request)

    @staticmethod
    def _why_not(info: ScheduleInfo, done: str) -> str:
        if info.status == ScheduleStatus.PAUSED:
            return (
                f"schedule {info.id} is not {done}: it is paused because its owner "
                f"{info.owner!r} is not in the tokens file; it resumes when the owner's "
                "token is back"
            )
        return f"schedule {info.id} is not {done}: it ended (its session was closed)"

    def _often_enough(self, body: CreateSchedule) -> None:
        """A 422 for an expression whose times come closer than schedules.min_interval
        (see `supervisor.schedules.rules`: over its next GAP_SAMPLE times)."""
        least = self.config.schedules.min_interval
        if least <= 0:
            return
        upcoming = Cron(body.cron, body.timezone).upcoming(SYSTEM.time(), GAP_SAMPLE)
        gap = shortest_gap(upcoming)
        if gap is not None and gap < least:
            raise ApiError(
                422,
                "invalid",
                f"cron: {body.cron!r} runs {gap:g} s apart, more often than "
                f"schedules.min_interval allows (at least {least:g} s between two runs)",
                field="cron",
            )

    # --- who may ----------------------------------------------------------------------

    async def _writable(self, principal: str, session_id: str) -> None:
        """The caller may write `session_id` (a schedule on it): else a 422 for a session
        it cannot read (as if there were none), a 403 for one it can only read."""
        try:
            await asyncio.to_thread(self.store.sessions.get, session_id)
        except SessionNotFound:
            raise self._unknown_session(session_id) from None
        if principal == ADMIN:
            return
        held = await asyncio.to_thread(self.store.acl.permission, session_id, principal)
        if held is None:
            raise self._unknown_session(session_id)
        if not Permission(held).includes(Permission.WRITE):
            raise ApiError(
                403,
                "forbidden",
                f"{principal} has {held} access to session {session_id}; "
                "a schedule on it needs write",
            )

    @staticmethod
    def _unknown_session(session_id: str | None) -> ApiError:
        return ApiError(
            422,
            "invalid",
            f"session: no session {session_id!r} (or the caller may not read it); "
            "null makes a new session for each run",
            field="session",
        )

    async def _schedule(self, request: web.Request, need: Permission) -> ScheduleInfo:
        """The schedule the path names, if the caller holds `need` on it (else 403/404)."""
        schedule_id = request.match_info["id"]
        missing = ApiError(404, "not_found", f"no schedule {schedule_id!r}")
        if not SCHEDULE_ID.match(schedule_id):
            raise missing
        info = await asyncio.to_thread(self.store.schedules.get, schedule_id)
        principal = request[PRINCIPAL]
        if info is None:
            raise missing
        if principal == ADMIN:
            return info
        if info.session is None:  # its runs' sessions are its owner's alone
            if info.owner != principal:
                raise missing
            return info
        held = await asyncio.to_thread(self.store.acl.permission, info.session, principal)
        if held is None:
            raise missing
        if not Permission(held).includes(need):
            raise ApiError(
                403, "forbidden", f"{principal} has {held} access to its session; this needs {need}"
            )
        return info
