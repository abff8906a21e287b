"""The operator's routes over the boot log (admin only), as `turnkeeper boots` and
`turnkeeper breaker reset` work on the database:

- `GET /v1/boots?limit=N`: recent daemon starts of every host, newest first, each with its
  state (its outcome, else running, crashed or unknown) and how it found the breaker.
- `POST /v1/breaker/reset`: clear this host's breaker: its boots until now stop counting.
  The daemon picks the reset up within seconds and runs the boot scan it held back, as it
  does after the command.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field

from supervisor.http.answers import PRINCIPAL, ApiError, answer, whole
from supervisor.http.auth import ADMIN
from supervisor.store import Store
from supervisor.store.boot_states import boot_json, boot_state, process_check

LISTED = 20  # boots one answer lists, unless told (`limit`)
MAX_LISTED = 1000


class BootOut(BaseModel):
    """One daemon start as the boot log has it."""

    boot_id: str
    host: str
    pid: int
    version: str
    started_at: float
    ended_at: float | None
    outcome: str | None = Field(description="clean, unclean or startup_failed; null: no end")
    state: str = Field(
        description="the outcome, else running, crashed (no end recorded and its process "
        "is gone: SIGKILL, OOM) or unknown (another host's boot with no end)"
    )
    breaker: dict[str, Any] | None = Field(
        description="how the boot found the breaker (tripped, unclean boots, reset_at)"
    )
    attempted: list[str] = Field(description="the side work the boot began (boot scan, ...)")


class BootList(BaseModel):
    """Recent boots, newest first; `host` is this daemon's host id."""

    host: str
    boots: list[BootOut]


class BreakerReset(BaseModel):
    """The breaker of `host` was reset: its boots started until `reset_at` stop counting."""

    host: str
    reset_at: float


ANSWERS: tuple[type[BaseModel], ...] = (BootOut, BootList, BreakerReset)


class OperatorRoutes:
    """The handlers of the two routes (the module docstring)."""

    def __init__(self, store: Store, host_id: str) -> None:
        self.store = store
        self.host_id = host_id

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/boots", self.boots)
        router.add_post("/v1/breaker/reset", self.reset)

    async def boots(self, request: web.Request) -> web.Response:
        self._admin(request, "read the boot log")
        limit = whole(request.query.get("limit"), "limit", LISTED, 1, MAX_LISTED)

        def read() -> list[dict[str, Any]]:
            rows = self.store.boots.recent(limit)
            running = process_check(self.store.now())
            return [boot_json(b, boot_state(b, self.host_id, running)) for b in rows]

        found = await asyncio.to_thread(read)
        return answer(BootList.model_validate({"host": self.host_id, "boots": found}))

    async def reset(self, request: web.Request) -> web.Response:
        self._admin(request, "reset the breaker")
        try:
            at = await asyncio.to_thread(self.store.boots.reset_breaker, self.host_id)
        except LookupError as exc:
            raise ApiError(409, "conflict", str(exc)) from None
        return answer(BreakerReset(host=self.host_id, reset_at=at))

    @staticmethod
    def _admin(request: web.Request, what: str) -> None:
        if request[PRINCIPAL] != ADMIN:
            raise ApiError(403, "forbidden", f"only the admin principal may {what}")
