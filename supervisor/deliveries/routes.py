"""The routes of the delivery outbox: list deliveries, read one, retry one or a target's.

- `GET /v1/deliveries?status=&session=&limit=`: newest first. The admin token sees every
  delivery; any other principal names a `session` it may read and sees its deliveries.
- `GET /v1/deliveries/{id}` (read on its session): one delivery.
- `POST /v1/deliveries/{id}/retry` (admin): a dead delivery is pending again with its
  attempts counted from 0, a pending one is due now; the sender looks again at once. A
  delivered one is a 409: it is not sent twice.
- `POST /v1/deliveries/retry {"target": NAME}` (admin): what a retry of one does, for
  every dead and pending delivery of the target at once (one transaction), but those being
  sent right now. They go out in the order they were produced: each session's in seq
  order, the oldest first across sessions.

A delivery is seen through its session's ACL: one of a session the caller may not read is
a 404, as if it did not exist. Which sessions are delivered where is bound by
`PUT /v1/sessions/{id}` (`session_routes.py`); the sending is the courier's
(`supervisor.deliveries.service`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from supervisor.contract.config import Config
from supervisor.contract.delivery_targets import TARGET_NAME
from supervisor.core.vocabulary import DeliveryKind, DeliveryStatus
from supervisor.http.answers import PRINCIPAL, ApiError, answer, read_body, whole
from supervisor.http.auth import ADMIN
from supervisor.http.schemas import SESSION_ID_PATTERN
from supervisor.store import DeliveryInfo, SessionNotFound, Store

DELIVERY_ID_PATTERN = r"^d[0-9a-f]{32}$"
DELIVERY_ID = re.compile(DELIVERY_ID_PATTERN)
SESSION_ID = re.compile(SESSION_ID_PATTERN)
MAX_LISTED = 1000  # deliveries one answer lists (`limit`)
LISTED = 100  # ... unless told
STATUSES = tuple(status.value for status in DeliveryStatus)


class DeliveryOut(BaseModel):
    """One event of a session pushed (or to push) to a delivery target."""

    id: str = Field(
        pattern=DELIVERY_ID_PATTERN, description="also its Idempotency-Key at the target"
    )
    target: str = Field(description="the delivery target's name")
    session: str = Field(pattern=SESSION_ID_PATTERN)
    seq: int = Field(ge=1, description="its event's seq in the session")
    kind: DeliveryKind = Field(description="what it carries: an event type, or answer")
    status: DeliveryStatus = Field(
        description="pending (sent, or sent again after the backoff), delivered (2xx), "
        "or dead (refused, or not delivered within delivery.max_age, or failed "
        "delivery.max_attempts times if set)"
    )
    attempts: int = Field(ge=0, description="attempts made since it was written or retried")
    next_at: float = Field(description="when it is due next (database clock); 0: at once")
    created_at: float = Field(description="its event's commit time")
    last_code: int | None = Field(description="the HTTP status of the last attempt, if any")
    last_error: str = Field(description="what the last failed attempt met, in words")
    delivered_at: float | None
    updated_at: float


class DeliveryList(BaseModel):
    """Deliveries, newest first."""

    deliveries: list[DeliveryOut]


class RetryTarget(BaseModel):
    """Send a target's dead and pending deliveries again now."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(pattern=TARGET_NAME, description="a configured delivery target's name")


class TargetRetried(BaseModel):
    """What a retry of a target's deliveries did."""

    target: str
    revived: int = Field(ge=0, description="dead deliveries pending again, attempts from 0")
    due: int = Field(ge=0, description="pending deliveries, in their backoff, due now")


REQUESTS: tuple[type[BaseModel], ...] = (RetryTarget,)
ANSWERS: tuple[type[BaseModel], ...] = (DeliveryOut, DeliveryList, TargetRetried)


def delivery_out(delivery: DeliveryInfo) -> DeliveryOut:
    """A delivery as the API answers it."""
    return DeliveryOut.model_validate(delivery.to_dict())


class Stirrer(Protocol):
    def stir(self) -> None:
        """Look at the outbox again now."""


class DeliveryRoutes:
    """The handlers of the three routes (the module docstring)."""

    def __init__(
        self, config: Config, store: Store, refuse: Callable[[], None], courier: Stirrer | None
    ) -> None:
        self.config = config
        self.store = store
        self.refuse = refuse  # the API's: 503 once the daemon is stopping
        self.courier = courier  # the deliveries service: a retry is sent at once

    def add(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/deliveries", self.list)
        router.add_get("/v1/deliveries/{id}", self.get)
        router.add_post("/v1/deliveries/{id}/retry", self.retry)
        router.add_post("/v1/deliveries/retry", self.retry_target)

    async def list(self, request: web.Request) -> web.Response:
        limit = whole(request.query.get("limit"), "limit", LISTED, 1, MAX_LISTED)
        status = request.query.get("status")
        if status is not None and status not in STATUSES:
            raise ApiError(
                422,
                "invalid",
                f"status: {status[:40]!r} is not a delivery status ({', '.join(STATUSES)})",
                field="status",
            )
        session = request.query.get("session")
        principal = request[PRINCIPAL]
        if session is None and principal != ADMIN:
            raise ApiError(
                403,
                "forbidden",
                "only the admin principal may list every delivery; "
                "give session=ID of a session you may read",
            )
        if session is not None:
            await self._readable(principal, session)
        found = await asyncio.to_thread(
            self.store.deliveries.list, status=status, session=session, limit=limit
        )
        return answer(DeliveryList(deliveries=[delivery_out(d) for d in found]))

    async def get(self, request: web.Request) -> web.Response:
        delivery = await self._delivery(request)
        principal = request[PRINCIPAL]
        if principal != ADMIN:
            held = await asyncio.to_thread(self.store.acl.permission, delivery.session, principal)
            if held is None:
                raise self._missing(delivery.id)
        return answer(delivery_out(delivery))

    async def retry(self, request: web.Request) -> web.Response:
        self.refuse()
        if request[PRINCIPAL] != ADMIN:
            raise ApiError(403, "forbidden", "only the admin principal may retry a delivery")
        delivery = await self._delivery(request)
        if self.config.delivery.target(delivery.target) is None:
            raise ApiError(
                409,
                "unknown_target",
                f"delivery {delivery.id} is for target {delivery.target!r}, which is not "
                "configured any more ([[delivery.targets]]); it would never be sent",
            )
        retried = await asyncio.to_thread(self.store.deliveries.retry, delivery.id)
        if retried is None:
            raise self._missing(delivery.id)
        if retried.status == DeliveryStatus.DELIVERED:
            raise ApiError(
                409,
                "delivered",
                f"delivery {retried.id} was already delivered; it is not sent twice",
            )
        if self.courier is not None:
            self.courier.stir()
        return answer(delivery_out(retried))

    async def retry_target(self, request: web.Request) -> web.Response:
        self.refuse()
        if request[PRINCIPAL] != ADMIN:
            raise ApiError(403, "forbidden", "only the admin principal may retry deliveries")
        body = await read_body(request, RetryTarget, self.config.http.read_timeout)
        if self.config.delivery.target(body.target) is None:
            raise ApiError(
                409,
                "unknown_target",
                f"target {body.target!r} is not configured ([[delivery.targets]]); its "
                "deliveries would never be sent",
            )
        revived, due = await asyncio.to_thread(self.store.deliveries.retry_all, body.target)
        if self.courier is not None and (revived or due):
            self.courier.stir()
        return answer(TargetRetried(target=body.target, revived=revived, due=due))

    # --- who may ----------------------------------------------------------------------

    async def _delivery(self, request: web.Request) -> DeliveryInfo:
        """The delivery the path names (not yet checked against its session's ACL)."""
        delivery_id = request.match_info["id"]
        if not DELIVERY_ID.match(delivery_id):
            raise self._missing(delivery_id)
        found = await asyncio.to_thread(self.store.deliveries.get, delivery_id)
        if found is None:
            raise self._missing(delivery_id)
        return found

    async def _readable(self, principal: str, session_id: str) -> None:
        """The caller may read `session_id`, else a 404 as if it did not exist; a malformed
        id is a 422 on `session`."""
        if not SESSION_ID.match(session_id):
            raise ApiError(
                422, "invalid", "session: must be a session id (32 hex digits)", field="session"
            )
        missing = ApiError(404, "not_found", f"no session {session_id!r}")
        try:
            await asyncio.to_thread(self.store.sessions.get, session_id)
        except SessionNotFound:
            raise missing from None
        if principal == ADMIN:
            return
        held = await asyncio.to_thread(self.store.acl.permission, session_id, principal)
        if held is None:  # any access includes read
            raise missing

    @staticmethod
    def _missing(delivery_id: str) -> ApiError:
        return ApiError(404, "not_found", f"no delivery {delivery_id[:40]!r}")
