"""The HTTP API (DESIGN.md section 6): intake, attach, status, health and metrics.

JSON in and out; errors are `{"error": {"code", "message"}}`. A caller sees only the
sessions its principal may read (others are 404, as if they did not exist); `admin` is the
operator and sees everything. `inject` answers 202 only after the message is committed,
and once shutdown begins it answers 503 with Retry-After: nothing is accepted that could
die in memory.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import peewee
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core import autonomy
from supervisor.http import attach, openapi
from supervisor.http.auth import ADMIN, Tokens
from supervisor.http.metrics import CONTENT_TYPE, Metrics
from supervisor.store import (
    EVENT_TYPES,
    PERMISSIONS,
    IdempotencyConflict,
    ReplayedSeq,
    SessionInfo,
    SessionNotFound,
    StorageUnavailable,
    Store,
    request_digest,
    scoped_key,
)

SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
PUBLIC = frozenset({"/healthz", "/readyz", "/openapi.json"})
RETRY_AFTER = "5"
STORAGE_PROBE = 5.0  # seconds between write probes while the store takes no writes
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


MAX_SEQ = 2**62  # beyond any seq, and within every backend's BIGINT
_WHOLE = re.compile(r"[0-9]{1,19}")


def _whole(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    """A whole number from a query value or header: ASCII digits only, within [low, high]."""
    if raw is None:
        return default
    if not _WHOLE.fullmatch(raw) or not low <= int(raw) <= high:
        raise ApiError(
            422, "invalid", f"{name} must be a whole number from {low} to {high}", field=name
        )
    return int(raw)


class PoolView(Protocol):
    """What the API needs of the worker pool (`supervisor.pool.Pool` is one)."""

    def input(self, session_id: str) -> None:
        """New input was committed for the session."""

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on."""

    def interrupt(self, session_id: str) -> None:
        """The operator ended the session's turn (already in the database)."""

    def status(self) -> dict[str, Any]:
        """The slots and workers, for /v1/status."""

    def breaker(self) -> dict[str, Any]:
        """The breaker, for /v1/status."""


class ApiError(Exception):
    """An error answer: status, a stable code, a message naming what to fix."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.headers, self.extra = status, code, headers, extra


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message, **extra}}, status=status, headers=headers
    )


class RunBody(BaseModel):
    """An autonomous run: what to achieve, how to go on, and what it may spend."""

    model_config = ConfigDict(extra="forbid")
    goal: str = Field(min_length=1, max_length=100_000)
    prompt: str = Field(
        "Continue working towards the goal. Say [goal met] when it is achieved.",
        min_length=1,
        max_length=100_000,
    )
    max_turns: int = Field(ge=1, le=100_000)
    max_tokens: int | None = Field(None, ge=1)
    deadline_seconds: float | None = Field(None, gt=0)


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["attached", "channel", "autonomous", "subagent"] = "attached"
    title: str = Field("", max_length=200)
    agent: str = Field("", max_length=200, pattern=r"^$|^[\w.]+:\w+$")
    run: RunBody | None = None

    @model_validator(mode="after")
    def _run_for_autonomous(self) -> CreateSession:
        if (self.kind == "autonomous") != (self.run is not None):
            raise ValueError("run (goal, max_turns, ...) goes with kind autonomous, and only there")
        return self


class Inject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=100_000)


class AclChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    principal: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,100}$")
    permission: Literal["read", "write", "admin"] | None


class Api:
    """The aiohttp application and its handlers."""

    def __init__(
        self,
        config: Config,
        store: Store,
        hub: attach.Hub,
        tokens: Tokens,
        metrics: Metrics,
        *,
        boot_id: str,
        pool: PoolView | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.tokens = tokens
        self.metrics = metrics
        self.boot_id = boot_id
        self.pool = pool
        self.ready = False
        self.stopping = False
        self.storage_error: str | None = None  # why the last write failed, until one works
        self._storage_failed_at = 0.0
        self.log = log("intake")

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.http.max_body, middlewares=[self._errors, self._auth]
        )
        r = app.router
        r.add_post("/v1/sessions", self.create)
        r.add_get("/v1/sessions", self.list)
        r.add_get("/v1/sessions/{id}", self.get)
        r.add_post("/v1/sessions/{id}/inject", self.inject)
        r.add_post("/v1/sessions/{id}/wake", self.wake)
        r.add_post("/v1/sessions/{id}/interrupt", self.interrupt)
        r.add_get("/v1/sessions/{id}/events", self.events)
        r.add_get("/v1/sessions/{id}/attach", self.attach)
        r.add_put("/v1/sessions/{id}/acl", self.acl)
        r.add_get("/v1/status", self.status)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics_text)
        r.add_get("/openapi.json", self.openapi_document)
        app.on_shutdown.append(self._on_shutdown)
        return app

    def publish(self, session_id: str, event: dict[str, Any]) -> None:
        """An event was committed (its seq and type): count it and wake its attach streams.

        Streams read the events themselves from the database, so what reaches a client is
        always what was stored, whoever sent the signal.
        """
        kind = event.get("type")
        seq = event.get("seq")
        if kind not in EVENT_TYPES or not isinstance(seq, int) or isinstance(seq, bool):
            return
        self.metrics.events_committed.labels(kind).inc()
        self.hub.publish(session_id, {"seq": seq, "type": kind})

    # --- middlewares ----------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            response = error_response(exc.status, exc.code, str(exc), exc.headers, **exc.extra)
            if exc.status in (400, 408):
                response.force_close()  # the rest of a broken or late body is not read
            return response
        except IdempotencyConflict as exc:
            return error_response(409, "idempotency_conflict", str(exc), seq=exc.seq)
        except (StorageUnavailable, peewee.DatabaseError) as exc:
            self._storage_failed(request, exc)
            return error_response(
                503,
                "storage_unavailable",
                "the database cannot be written now; nothing of this request was stored, "
                "retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )
        except web.HTTPException as exc:
            if exc.status == 413:
                self.metrics.intake_rejections.labels("too_large").inc()
                return error_response(
                    413,
                    "too_large",
                    f"the body is over http.max_body ({self.config.http.max_body} bytes)",
                )
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
            return error_response(exc.status, code, exc.reason, headers=headers)
        except Exception:
            self.log.exception("{} {} failed", request.method, request.path)
            return error_response(500, "internal", "internal error; see the daemon's log")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        public = request.path in PUBLIC or (
            request.path == "/metrics" and self.config.auth.metrics_public
        )
        if not public:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # Auth schemes are case-insensitive (RFC 7235 section 2.1).
            bearer = scheme.lower() == "bearer"
            principal = self.tokens.principal(token.strip()) if bearer else None
            if principal is None:
                return error_response(
                    401,
                    "unauthorized",
                    "send Authorization: Bearer <token>",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            request["principal"] = principal
        return await handler(request)

    # --- helpers --------------------------------------------------------------------

    async def _body(self, request: web.Request, model: type[M]) -> M:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.http.read_timeout)
        except web.HTTPException:
            raise  # 413, answered by the error middleware
        except TimeoutError as exc:
            raise ApiError(
                408, "timeout", f"the body did not arrive within {self.config.http.read_timeout} s"
            ) from exc
        except Exception as exc:  # a broken transfer or content encoding
            raise ApiError(400, "bad_body", f"the body cannot be read: {exc}") from exc
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}") from exc
        except RecursionError as exc:
            raise ApiError(400, "malformed_json", "the body is nested too deeply") from exc
        except ValueError as exc:  # a number Python will not convert (over 4300 digits)
            raise ApiError(
                400, "malformed_json", f"the body cannot be read as JSON: {exc}"
            ) from exc
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            raise ApiError(422, "invalid", f"{field}: {first['msg']}", field=field) from exc

    async def _session(self, request: web.Request, need: str = "read") -> SessionInfo:
        session_id = request.match_info["id"]
        missing = ApiError(404, "not_found", f"no session {session_id!r}")
        if not SESSION_ID.match(session_id):
            raise missing
        try:
            info = await asyncio.to_thread(self.store.sessions.get, session_id)
        except SessionNotFound:
            raise missing from None
        principal = request["principal"]
        if principal != ADMIN:
            held = await asyncio.to_thread(self.store.acl.permission, session_id, principal)
            if held is None:
                raise missing
            if PERMISSIONS.index(held) < PERMISSIONS.index(need):
                raise ApiError(
                    403, "forbidden", f"{principal} has {held} access; this needs {need}"
                )
        if self.pool is not None and info.active_turn_id:
            self.pool.touch(info.id)  # first touch: an interrupted turn may go on
        return info

    def _storage_failed(self, request: web.Request, exc: Exception) -> None:
        """A request could not be stored: readiness fails until a write works again."""
        self.metrics.intake_rejections.labels("storage_unavailable").inc()
        if self.storage_error is None:
            self.log.error("the database takes no writes: {}; intake answers 503", exc)
        self.storage_error = str(exc)
        self._storage_failed_at = time.monotonic()

    def _storage_ok_now(self) -> None:
        if self.storage_error is not None:
            self.storage_error = None
            self.log.info("the database takes writes again")

    async def _storage_ok(self) -> bool:
        """Whether the store takes writes; after a failure, probed every STORAGE_PROBE s."""
        if self.storage_error is None:
            return True
        if time.monotonic() - self._storage_failed_at < STORAGE_PROBE:
            return False
        try:
            await asyncio.to_thread(self.store.probe_write)
        except (StorageUnavailable, peewee.DatabaseError) as exc:
            self.storage_error = str(exc)
            self._storage_failed_at = time.monotonic()
            return False
        self._storage_ok_now()
        return True

    def _refuse_while_stopping(self) -> None:
        if self.stopping:
            self.metrics.intake_rejections.labels("stopping").inc()
            raise ApiError(
                503,
                "stopping",
                "the daemon is stopping; retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )

    @staticmethod
    def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
        return _whole(request.query.get(name), name, default, low, high)

    async def _publish_seq(self, session_id: str, seq: int | None) -> None:
        if seq is not None:
            for record in await asyncio.to_thread(self.store.events.read, session_id, seq - 1, 1):
                self.publish(session_id, record.to_dict())

    # --- routes ---------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        self._refuse_while_stopping()
        body = await self._body(request, CreateSession)
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
        first: list[tuple[str, dict[str, Any]]] = []
        if body.run is not None:
            now = time.time()
            r = body.run
            deadline = None if r.deadline_seconds is None else now + r.deadline_seconds
            run = autonomy.Run(r.goal, r.prompt, r.max_turns, r.max_tokens, deadline)
            first = [("checkpoint", run.start_payload(now)), ("user_message", {"text": r.goal})]
        info = await asyncio.to_thread(
            self.store.sessions.create,
            request["principal"],
            kind=body.kind,
            title=body.title,
            agent=body.agent,
            events=first,
        )
        self._storage_ok_now()
        if first and self.pool is not None:
            self.pool.input(info.id)
        return web.json_response(
            info.to_dict(), status=201, headers={"Location": f"/v1/sessions/{info.id}"}
        )

    async def list(self, request: web.Request) -> web.Response:
        limit = self._int(request, "limit", 100, 1, 1000)
        principal = request["principal"]
        sessions = await asyncio.to_thread(
            self.store.sessions.list, None if principal == ADMIN else principal, limit
        )
        return web.json_response({"sessions": [s.to_dict() for s in sessions]})

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response((await self._session(request)).to_dict())

    async def inject(self, request: web.Request) -> web.Response:
        self._refuse_while_stopping()
        info = await self._session(request, "write")
        key = request.headers.get("Idempotency-Key")
        if key is not None and not 0 < len(key) <= 200:
            raise ApiError(
                422,
                "invalid",
                "Idempotency-Key must be 1 to 200 characters",
                field="Idempotency-Key",
            )
        body = await self._body(request, Inject)
        if info.status == "quarantined":
            raise ApiError(
                409, "quarantined", "the session is quarantined; an operator must release it first"
            )
        principal = request["principal"]
        seq = await self.store.events.append_async(
            info.id,
            "user_message",
            {"text": body.text, "by": principal},
            writer="intake",
            # A key is the client's own: scoped to its principal, bound to this body.
            idempotency_key=None if key is None else scoped_key(principal, key),
            idempotency_digest=None if key is None else request_digest(body.model_dump_json()),
        )
        self._storage_ok_now()
        if isinstance(seq, ReplayedSeq):
            return web.json_response(
                {"seq": int(seq)}, status=202, headers={"Idempotent-Replayed": "true"}
            )
        await self._publish_seq(info.id, seq)
        if self.pool is not None:
            self.pool.input(info.id)
        return web.json_response({"seq": seq}, status=202)

    async def wake(self, request: web.Request) -> web.Response:
        self._refuse_while_stopping()
        info = await self._session(request, "write")
        await asyncio.to_thread(self.store.sessions.request_turn, info.id)
        if self.pool is not None:
            self.pool.input(info.id)
        return web.json_response({"pending": True}, status=202)

    async def interrupt(self, request: web.Request) -> web.Response:
        info = await self._session(request, "write")
        seq = await asyncio.to_thread(self.store.sessions.interrupt, info.id, request["principal"])
        if seq is not None:
            await self._publish_seq(info.id, seq)
            if self.pool is not None:
                self.pool.interrupt(info.id)
        return web.json_response({"interrupted": seq is not None, "seq": seq})

    async def events(self, request: web.Request) -> web.Response:
        info = await self._session(request)
        after = self._int(request, "after", 0, 0, MAX_SEQ)
        limit = self._int(request, "limit", 100, 1, 1000)
        records = await asyncio.to_thread(self.store.events.read, info.id, after, limit)
        return web.json_response({"events": [r.to_dict() for r in records]})

    async def attach(self, request: web.Request) -> web.StreamResponse:
        self._refuse_while_stopping()
        info = await self._session(request)
        header = request.headers.get("Last-Event-ID")
        if header is not None:
            after = _whole(header, "Last-Event-ID", 0, 0, MAX_SEQ)
        else:
            after = self._int(request, "after", 0, 0, MAX_SEQ)
        principal = request["principal"]
        limit = self.config.http.max_streams_per_principal
        if self.hub.streams_of(principal) >= limit:
            self.metrics.intake_rejections.labels("too_many_streams").inc()
            raise ApiError(
                429,
                "too_many_streams",
                f"{principal} already holds {limit} attach streams "
                "(http.max_streams_per_principal); close one first",
                headers={"Retry-After": RETRY_AFTER},
            )
        return await attach.stream(
            request, info.id, after, self.hub, self.store.events.read, principal=principal
        )

    async def acl(self, request: web.Request) -> web.Response:
        info = await self._session(request, "admin")
        body = await self._body(request, AclChange)
        by = request["principal"]
        if body.permission is None:
            seq = await asyncio.to_thread(self.store.acl.revoke, info.id, body.principal, by=by)
        else:
            seq = await asyncio.to_thread(
                self.store.acl.grant, info.id, body.principal, body.permission, by=by
            )
        await self._publish_seq(info.id, seq)
        entries = await asyncio.to_thread(self.store.acl.entries, info.id)
        return web.json_response({"acl": entries})

    async def status(self, request: web.Request) -> web.Response:
        if request["principal"] != ADMIN:
            raise ApiError(403, "forbidden", "only the admin principal may read the status")
        counts = await asyncio.to_thread(self.store.sessions.counts)
        pool = self.pool.status() if self.pool is not None else {"slots": [], "restarts": 0}
        breaker = self.pool.breaker() if self.pool is not None else None
        return web.json_response(
            {
                "boot": {"id": self.boot_id, "ready": self.ready, "stopping": self.stopping},
                "breaker": breaker,
                "slots": pool["slots"],
                "worker_restarts": pool["restarts"],
                "sessions": counts,
                "attach_streams": self.hub.streams,
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.stopping:
            return web.json_response({"status": "stopping"}, status=503)
        if not self.ready:
            return web.json_response({"status": "starting"}, status=503)
        if not await self._storage_ok():
            return web.json_response(
                {"status": "storage_unavailable", "error": self.storage_error}, status=503
            )
        return web.json_response({"status": "ready"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document())

    async def _on_shutdown(self, app: web.Application) -> None:
        # End the attach streams now, or aiohttp waits for them twice shutdown_timeout.
        self.hub.close_all()
