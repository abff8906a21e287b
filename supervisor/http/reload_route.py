"""`POST /v1/reload` (admin): read the configuration again and apply it, as SIGHUP does.

Body (optional) `{"wait": true, "workers": false}`: with `wait` true the answer comes once
the new configuration is in force (the pool resized, the workers replaced if a key they
read changed, or always with `workers` true); with false once it is applied to the
supervisor and the workers' changes have begun. The answer is what changed (`ReloadOut`)
and, in `incomplete`, why the pool is not (yet) as the configuration in force says (a new
worker that could not start stopped the rolling restart; the daemon began to stop). A
configuration a start would refuse changes nothing: a 422 `invalid_config` whose message
is the start's one line, with the result beside it. While the daemon stops, a 503.

The route only carries the request to the daemon's reloader (`supervisor.reloading`);
`/v1/status` shows the configuration in force (`config_state`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config, config_version
from supervisor.http.answers import PRINCIPAL, RETRY_AFTER, ApiError, answer, read_body
from supervisor.http.auth import ADMIN
from supervisor.http.schemas import ConfigState, ErrorDetail


class ResultView(Protocol):
    """What the route needs of a reload's result (`supervisor.reloading.ReloadResult`)."""

    ok: bool
    error: str | None
    code: str  # of a refusal: invalid_config (422), stopping (503), failed (500)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-safe data (`ReloadOut`'s fields)."""


class ReloaderView(Protocol):
    """What the route and the status need of the daemon's reloader."""

    version: str
    loaded_at: float

    async def reload(self, *, wait: bool = True, workers: bool = False) -> ResultView:
        """Read the configuration again and apply it; never raises for a bad one."""


class ReloadBody(BaseModel):
    """A reload: whether the answer waits until the new configuration is in force."""

    model_config = ConfigDict(extra="forbid")

    wait: bool = Field(
        default=True,
        strict=True,
        description="true: answer once the pool is resized and the workers replaced (if a "
        "key they read changed); false: once the configuration is applied to the supervisor",
    )
    workers: bool = Field(
        default=False,
        strict=True,
        description="true: replace every worker even if no key they read changed (an MCP "
        "server that was down and is fixed, agent code upgraded in place)",
    )


class ChangeOut(BaseModel):
    """One key the reload found changed, its values with secrets shown as ***."""

    key: str = Field(description="dotted: pool.workers, mcp.servers.NAME.command, ...")
    before: Any = Field(description="null: absent (an entry added)")
    after: Any = Field(description="null: absent (an entry removed)")
    effect: Literal["live", "workers", "restart"] = Field(
        description="live: applied by the supervisor; workers: the workers were replaced; "
        "restart: needs a restart of the daemon, left as it was"
    )


class McpNotStarted(BaseModel):
    """An MCP server of a worker the reload started that did not start."""

    worker: str
    server: str
    state: str = Field(description="its state when the worker was ready: backoff or down")


class ReloadOut(BaseModel):
    """What a reload did."""

    ok: bool = Field(description="false: the configuration was refused, nothing changed")
    error: str | None = Field(description="why it was refused: the start's one line")
    version_before: str = Field(description="the configuration's version before the reload")
    version: str = Field(description="the version in force now")
    loaded_at: float = Field(description="when the configuration in force was loaded")
    changes: list[ChangeOut]
    needs_restart: list[str] = Field(description="keys changed that need a restart, not applied")
    revoked: list[str] = Field(
        default_factory=list,
        description="principals the tokens file no longer lists: their requests in flight are "
        "refused, their schedules paused, their running tasks cancelled",
    )
    workers_replaced: bool = Field(
        description="the workers were replaced (a key they read changed, or `workers` asked)"
    )
    incomplete: str | None = Field(
        description="why the pool is not yet as the configuration says, although it is in "
        "force: a new worker that could not start stopped the rolling restart (the workers "
        "not yet replaced go on), an MCP server of a worker it started did not start, or the "
        "daemon began to stop",
    )
    mcp_not_started: list[McpNotStarted] = Field(
        default_factory=list,
        description="the MCP servers of the workers the reload started that did not start "
        "(failed their first start: those workers run without their tools)",
    )


class ReloadRefused(BaseModel):
    """A configuration a start would refuse (422): the one line, and the result."""

    error: ErrorDetail
    result: ReloadOut | None = Field(default=None, description="absent for a malformed body")


REQUESTS: tuple[type[BaseModel], ...] = (ReloadBody,)
ANSWERS: tuple[type[BaseModel], ...] = (ChangeOut, McpNotStarted, ReloadOut, ReloadRefused)
STARTED = SYSTEM.time()  # this process's start: when its configuration was loaded, at the latest


def config_state(reloader: ReloaderView | None, config: Config) -> ConfigState:
    """The configuration in force, for `/v1/status`."""
    source = None if config.source is None else str(config.source)
    if reloader is None:  # an API without a reloader: the configuration it was given
        return ConfigState(version=config_version(config), loaded_at=STARTED, source=source)
    return ConfigState(version=reloader.version, loaded_at=reloader.loaded_at, source=source)


class ReloadRoutes:
    """The handler of `POST /v1/reload` (the module docstring)."""

    def __init__(
        self,
        config: Config,
        reloader: Callable[[], ReloaderView | None],
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config  # read on each request: a reload swaps it
        self.reloader = reloader  # the daemon attaches its reloader after the app is made
        self.stopping = stopping

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/reload", self.reload)

    async def reload(self, request: web.Request) -> web.Response:
        if request[PRINCIPAL] != ADMIN:
            raise ApiError(403, "forbidden", "only the admin principal may reload the daemon")
        body = ReloadBody()
        if request.can_read_body:
            body = await read_body(request, ReloadBody, self.config.http.read_timeout)
        reloader = self.reloader()
        if self.stopping() or reloader is None:
            raise ApiError(
                503,
                "stopping" if self.stopping() else "starting",
                "the daemon is stopping; a reload has nothing to apply"
                if self.stopping()
                else "the daemon takes no reload yet (it is starting); retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )
        # Shielded: a client that goes away does not cut a reload in half.
        result = await asyncio.shield(reloader.reload(wait=body.wait, workers=body.workers))
        out = ReloadOut.model_validate(result.as_dict())
        if result.ok:
            return answer(out)
        message = result.error or "refused"
        if result.code == "stopping":
            raise ApiError(503, "stopping", message, headers={"Retry-After": RETRY_AFTER})
        if result.code == "failed":
            raise ApiError(500, "reload_failed", message)
        error = ErrorDetail(code="invalid_config", message=message)
        return answer(ReloadRefused(error=error, result=out), 422)
