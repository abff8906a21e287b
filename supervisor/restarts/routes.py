"""The routes of restart requests: ask the daemon to restart itself, and read the requests.

- `POST /v1/restart` (admin) `{"reason": TEXT, "drain": SECONDS | null}`: a 202 with the
  new request, `in_progress` false; a 200 with the request already under way (its asker and
  reason, not this one's), `in_progress` true. One within `restart.min_interval` of the last
  is a 429 with Retry-After; a daemon that will not restart (its configuration on disk does
  not load, or it is stopping for another reason) a 409 `restart_refused`.
- `GET /v1/restarts?limit=&all=` (admin): the requests, newest first; this daemon's host
  only, unless `all=true`.
- `GET /v1/restarts/{id}` (admin): one request, its outcome once a later boot settled it.

The route only carries a request to the desk (`RestartDesk`, the daemon's: admission, the
stop, the re-exec, the settlement). It answers while the daemon is stopping, unlike intake:
a request then is the one in progress, or the desk refuses it.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from supervisor.contract.config import Config
from supervisor.core.vocabulary import RestartOutcome, RestartState
from supervisor.http.answers import PRINCIPAL, RETRY_AFTER, ApiError, answer, read_body, whole
from supervisor.http.auth import ADMIN
from supervisor.http.schemas import SESSION_ID_PATTERN
from supervisor.restarts.rules import REASON_MAX, RestartRefused
from supervisor.store import Store
from supervisor.store.restarts import Admitted, RateLimited, RestartInfo

RESTART_ID_PATTERN = SESSION_ID_PATTERN  # uuid4 hex, as a session's
RESTART_ID = re.compile(RESTART_ID_PATTERN)
MAX_DRAIN = 3600.0  # seconds a request may let turns run before the restart
MAX_LISTED = 1000  # requests one answer lists (`limit`)
LISTED = 50  # ... unless told
FLAGS = {"true": True, "false": False}


class RestartDesk(Protocol):
    """What the route needs of the daemon (`supervisor.restarts.service`'s desk is one)."""

    async def request(self, *, by: str, reason: str, drain: float | None) -> Admitted:
        """Admit a restart asked by principal `by`; the one in progress if there is one.

        Raises RateLimited (within restart.min_interval of the last) or RestartRefused.
        """


class RestartBody(BaseModel):
    """A restart of the daemon: why, and how long turns in flight may run first."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(
        default="",
        max_length=REASON_MAX,
        description="why, for the log, the listing and `turnkeeper restarts`",
    )
    drain: float | None = Field(
        default=None,
        ge=0,
        le=MAX_DRAIN,
        strict=True,
        allow_inf_nan=False,
        description="seconds the turns and tasks in flight may take to finish before the "
        "restart (0: cut at once, continued after it); null: restart.drain_budget",
    )


class RestartOut(BaseModel):
    """A restart request and, once a later boot settled it, how it ended."""

    id: str = Field(pattern=RESTART_ID_PATTERN)
    host: str = Field(description="the daemon.host_id of the daemon asked")
    boot: str = Field(description="the boot that admitted it")
    pid: int = Field(description="the pid of that boot's supervisor")
    session: str | None = Field(description="the session whose turn asked; null: an operator")
    turn_id: str | None
    requested_by: str = Field(description="the operator's principal, or agent")
    reason: str
    drain: float | None = Field(description="seconds for turns to finish; null: the default")
    state: RestartState
    requested_at: float = Field(description="database clock, epoch seconds")
    started_at: float | None = Field(description="when the daemon began to stop for it")
    settled_at: float | None
    version_before: str
    config_before: str = Field(description="the configuration's version (12 hex digits)")
    outcome: RestartOutcome | None = Field(description="null until it is done")
    detail: str = Field(description="what happened, when it did not simply work")
    boot_after: str | None = Field(description="the boot that settled it")
    version_after: str | None
    config_after: str | None
    seconds: float | None = Field(description="from its start (else its request) to settling")
    request_seq: int | None = Field(description="its session's restart_requested, if any")
    notice_seq: int | None = Field(description="the notice its session got when it settled")
    result_seq: int | None = Field(description="the restart_result its session got")


class RestartAnswer(BaseModel):
    """The request admitted now, or the one in progress that answers this one."""

    restart: RestartOut
    in_progress: bool = Field(description="true: a restart was already under way; this is it")


class RestartList(BaseModel):
    """Restart requests, newest first."""

    restarts: list[RestartOut]


REQUESTS: tuple[type[BaseModel], ...] = (RestartBody,)
ANSWERS: tuple[type[BaseModel], ...] = (RestartOut, RestartAnswer, RestartList)


def restart_out(info: RestartInfo) -> RestartOut:
    """A restart request as the API answers it."""
    return RestartOut.model_validate(info.as_dict())


class RestartRoutes:
    """The handlers of the three routes (the module docstring)."""

    def __init__(
        self,
        config: Config,
        store: Store,
        host_id: str,
        desk: Callable[[], RestartDesk | None],
    ) -> None:
        self.config = config
        self.store = store
        self.host_id = host_id
        self.desk = desk  # the daemon attaches its desk after the app is made

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/restart", self.request)
        router.add_get("/v1/restarts", self.list)
        router.add_get("/v1/restarts/{id}", self.get)

    async def request(self, request: web.Request) -> web.Response:
        by = self._admin(request, "restart the daemon")
        body = await read_body(request, RestartBody, self.config.http.read_timeout)
        desk = self.desk()
        if desk is None:
            raise ApiError(
                503,
                "restart_unavailable",
                "the daemon takes no restart request yet (it is starting); retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )
        try:
            admitted = await desk.request(by=by, reason=body.reason, drain=body.drain)
        except RateLimited as exc:
            wait = str(max(1, math.ceil(exc.retry_after)))
            raise ApiError(429, "rate_limited", str(exc), headers={"Retry-After": wait}) from None
        except RestartRefused as exc:
            raise ApiError(409, "restart_refused", str(exc)) from None
        out = RestartAnswer(restart=restart_out(admitted.info), in_progress=not admitted.new)
        return answer(out, 202 if admitted.new else 200)

    async def list(self, request: web.Request) -> web.Response:
        self._admin(request, "list restart requests")
        limit = whole(request.query.get("limit"), "limit", LISTED, 1, MAX_LISTED)
        every = FLAGS.get(request.query.get("all", "false"))
        if every is None:
            raise ApiError(422, "invalid", "all must be true or false", field="all")
        host = None if every else self.host_id
        found = await asyncio.to_thread(self.store.restarts.list, host=host, limit=limit)
        return answer(RestartList(restarts=[restart_out(info) for info in found]))

    async def get(self, request: web.Request) -> web.Response:
        self._admin(request, "read restart requests")
        restart_id = request.match_info["id"]
        missing = ApiError(404, "not_found", f"no restart request {restart_id[:40]!r}")
        if not RESTART_ID.match(restart_id):
            raise missing
        found = await asyncio.to_thread(self.store.restarts.get, restart_id)
        if found is None:
            raise missing
        return answer(restart_out(found))

    @staticmethod
    def _admin(request: web.Request, what: str) -> str:
        """The caller's principal, if it is the admin; else a 403."""
        principal: str = request[PRINCIPAL]
        if principal != ADMIN:
            raise ApiError(403, "forbidden", f"only the admin principal may {what}")
        return principal
