"""The HTTP API (docs/reference/http.md): intake, attach, status, health and metrics.

JSON in and out; errors are `{"error": {"code", "message"}}`. A caller sees only the
sessions its principal may read (others are 404, as if they did not exist); `admin` is the
operator and sees everything. `inject` answers 202 only after the message is committed,
and once shutdown begins it answers 503 with Retry-After: nothing is accepted that could
die in memory.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from supervisor import __version__
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.traces import Trigger
from supervisor.core.vocabulary import EventType, Permission, Rejection, SessionStatus, Writer
from supervisor.deliveries.routes import DeliveryRoutes, Stirrer
from supervisor.http import answers, attach, auth, follow, hosts, openapi, pages
from supervisor.http.answers import (
    MAX_SEQ,
    PRINCIPAL,
    RETRY_AFTER,
    TOKEN_HASH,
    ApiError,
    answer,
    read_body,
    whole,
)
from supervisor.http.auth import ADMIN, Tokens
from supervisor.http.console import Console
from supervisor.http.lifecycle import Lifecycle, refuse_closed
from supervisor.http.operators import OperatorRoutes
from supervisor.http.reload_route import ReloaderView, ReloadRoutes, config_state
from supervisor.http.schemas import (
    AclChange,
    AclEntries,
    BootState,
    Health,
    Inject,
    Injected,
    Readiness,
    Status,
    Woken,
)
from supervisor.http.session_routes import SessionRoutes
from supervisor.http.storage import StorageHealth
from supervisor.metrics import CONTENT_TYPE, Metrics, TurnClock
from supervisor.restarts.routes import RestartDesk, RestartRoutes
from supervisor.runtime.bus import Bus, Delta, Published, Stopping
from supervisor.schedules.routes import ScheduleRoutes
from supervisor.store import (
    EVENT_TYPES,
    ReplayedSeq,
    SessionInfo,
    SessionNotFound,
    Store,
    request_digest,
    scoped_key,
)
from supervisor.store.reading import EventRows
from supervisor.subagents import routes as subagents
from supervisor.tasks import routes as tasks
from supervisor.tracing import TurnTraces

SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
PUBLIC = frozenset({"/healthz", "/readyz", "/openapi.json"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PoolView(Protocol):
    """What the API needs of the worker pool (`supervisor.pool.Pool` is one)."""

    def wake(self, session_id: str) -> None:
        """New input was committed for the session."""

    def touch(self, session_id: str) -> None:
        """A request touched the session: an interrupted turn of it may go on."""

    def interrupt(self, session_id: str) -> None:
        """The session's turn was ended in the database (interrupt, close): stop it now."""

    def streamed_so_far(self, session_id: str) -> tuple[str, str, bool] | None:
        """What the session's turn in flight streamed since its last committed answer."""

    def status(self) -> dict[str, Any]:
        """The slots and workers, for /v1/status."""

    def breaker(self) -> dict[str, Any]:
        """The breaker, for /v1/status."""


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
        keeper: tasks.Canceller | None = None,
        courier: Stirrer | None = None,
        reloader: ReloaderView | None = None,
        restarts: RestartDesk | None = None,
        bus: Bus | None = None,
        host_id: str = "",
        clock: Clock = SYSTEM,
        traces: TurnTraces | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.hub = hub
        self.tokens = tokens
        self.metrics = metrics
        self.boot_id = boot_id
        self.host_id = host_id  # daemon.host_id as resolved: this daemon on the database
        metrics.state.host_id, metrics.state.hosts = host_id, lambda: hosts.read(store)
        self.pool = pool
        self.keeper = keeper  # the task keeper: a cancel signals the runner at once
        self.courier = courier  # the deliveries' sender: a retry goes at once
        self.reloader = reloader  # taken once the daemon is ready (a 503 before)
        self.configured: list[Any] = []  # the route objects that read the configuration
        self.restarts = restarts
        self.traces = traces if traces is not None else TurnTraces(None)  # request spans
        self.ready = False
        self.stopping = False  # intake refuses (a stop)
        self.restarting = False  # a restart's drain: not ready, intake still takes messages
        self.storage = StorageHealth(store.probe_write, metrics)
        self.started_at = clock.time()  # this boot's, for the status (uptime)
        self.turn_clock = TurnClock(metrics)
        self.console = Console() if config.http.console else None
        self.lifecycle = Lifecycle(store, self._session, self.publish, pool)
        self.pages = pages.Pages(EventRows(store.db).batches)  # replays, /events: off the loop
        self.log = log("intake")
        if bus is not None:
            bus.subscribe(Published, self._published)
            bus.subscribe(Delta, self._delta)
            bus.subscribe(Stopping, self._stopping)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.http.max_body,
            middlewares=[
                answers.errors(self.storage, self.metrics, self.config.http.max_body),
                auth.bearer(self.tokens, self._public),
            ],
        )
        r = app.router
        # /v1/sessions (POST, GET) and /v1/sessions/{id} (GET, PUT)
        self._reads_config(
            SessionRoutes(
                self.config,
                self.store,
                self.storage,
                self._session,
                self._refuse_while_stopping,
                self.pool,
            )
        ).add(r)
        r.add_post("/v1/sessions/{id}/inject", self.inject)
        r.add_post("/v1/sessions/{id}/wake", self.wake)
        r.add_delete("/v1/sessions/{id}", self.lifecycle.close)
        r.add_post("/v1/sessions/{id}/interrupt", self.lifecycle.interrupt)
        r.add_post("/v1/sessions/{id}/release", self.lifecycle.release)
        r.add_get("/v1/sessions/{id}/events", self.events)
        r.add_get("/v1/sessions/{id}/attach", self.attach)
        r.add_put("/v1/sessions/{id}/acl", self.acl)
        r.add_get("/v1/sessions/{id}/subagents", subagents.route(self.store, self._session))
        # /v1/sessions/{id}/tasks, /v1/tasks/{id} (GET, DELETE) and /v1/tasks/{id}/output
        routes = tasks.Routes(self.store, self._session, self.keeper, self.config, self.host_id)
        self._reads_config(routes).add(r)
        schedules = ScheduleRoutes(
            self.config, self.store, self._refuse_while_stopping, self._known_principal
        )
        self._reads_config(schedules).add(r)
        sent = DeliveryRoutes(self.config, self.store, self._refuse_while_stopping, self.courier)
        self._reads_config(sent).add(r)
        restarts = RestartRoutes(self.config, self.store, self.host_id, lambda: self.restarts)
        self._reads_config(restarts).add(r)
        reloads = ReloadRoutes(
            self.config, self._reloader, lambda: self.stopping or self.restarting
        )
        self._reads_config(reloads).add(r)
        OperatorRoutes(self.store, self.host_id).add(r)  # /v1/boots, /v1/breaker/reset
        r.add_get("/v1/status", self.status)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics_text)
        r.add_get("/openapi.json", self.openapi_document)
        if self.console is not None:
            self.console.add(app)  # /ui: the operator console's files (no data)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self.pages.cleanup)  # after the streams ended
        return app

    def _known_principal(self, principal: str) -> bool:
        """Whether `principal` is the admin or in the tokens file now (a reload changes it)."""
        return principal == ADMIN or principal in self.tokens.principals()

    def _reads_config(self, routes: Any) -> Any:
        self.configured.append(routes)
        return routes

    def _reloader(self) -> ReloaderView | None:
        return self.reloader if self.ready else None  # a reload while it starts is a 503

    def _published(self, event: Published) -> None:
        self.publish(event.session, event.event)

    def _delta(self, delta: Delta) -> None:
        """A turn's live output: to the session's attach streams only (never stored)."""
        dropped = self.hub.delta(delta)
        if dropped:
            self.metrics.deltas_dropped.labels("stream").inc(dropped)

    def _stopping(self, event: Stopping) -> None:
        if event.restart:
            self.restarting = True  # not ready; intake goes on, answered after the restart
        else:
            self.stopping = True  # intake refuses from this moment

    def reconfigure(self, config: Config) -> None:
        """A reload: the handlers read `config` from now on (`http.*` needs a restart)."""
        self.config = config
        for routes in self.configured:
            routes.config = config

    def publish(self, session_id: str, event: dict[str, Any]) -> None:
        """An event was committed (its seq and type): count it and wake its attach streams.

        Streams read the events themselves from the database, so what reaches a client is
        always what was stored, whoever sent the signal.
        """
        kind = event.get("type")
        seq = event.get("seq")
        if not isinstance(kind, str) or kind not in EVENT_TYPES:
            return
        if not isinstance(seq, int) or isinstance(seq, bool):
            return
        self.metrics.events_committed.labels(kind).inc()
        self.turn_clock.heard(session_id, kind, self.clock.monotonic())
        if kind == EventType.COMPACTION:
            self.metrics.compactions.inc()
        self.hub.publish(session_id, {"seq": seq, "type": kind})

    def _public(self, path: str) -> bool:
        if path in PUBLIC or (self.console is not None and self.console.public(path)):
            return True
        return path == "/metrics" and self.config.auth.metrics_public

    # --- helpers --------------------------------------------------------------------

    async def _session(
        self, request: web.Request, need: Permission = Permission.READ
    ) -> SessionInfo:
        session_id = request.match_info["id"]
        missing = ApiError(404, "not_found", f"no session {session_id!r}")
        if not SESSION_ID.match(session_id):
            raise missing
        try:
            info = await asyncio.to_thread(self.store.sessions.get, session_id)
        except SessionNotFound:
            raise missing from None
        principal = request[PRINCIPAL]
        if principal != ADMIN:
            held = await asyncio.to_thread(self.store.acl.permission, session_id, principal)
            if held is None:
                raise missing
            if not Permission(held).includes(need):
                raise ApiError(
                    403, "forbidden", f"{principal} has {held} access; this needs {need}"
                )
        if self.pool is not None and info.active_turn_id:
            self.pool.touch(info.id)  # first touch: an interrupted turn may go on
        return info

    def _refuse_while_stopping(self) -> None:
        if self.stopping:
            self.metrics.intake_rejections.labels(Rejection.STOPPING).inc()
            raise ApiError(
                503,
                "stopping",
                "the daemon is stopping; retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )

    @staticmethod
    def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
        return whole(request.query.get(name), name, default, low, high)

    # --- routes ---------------------------------------------------------------------

    async def inject(self, request: web.Request) -> web.Response:
        self._refuse_while_stopping()
        info = await self._session(request, Permission.WRITE)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not 0 < len(key) <= 200:
            raise ApiError(
                422,
                "invalid",
                "Idempotency-Key must be 1 to 200 characters",
                field="Idempotency-Key",
            )
        body = await read_body(request, Inject, self.config.http.read_timeout)
        refuse_closed(info)
        if info.status == SessionStatus.QUARANTINED:
            raise ApiError(
                409,
                "quarantined",
                "the session is quarantined: its turn failed every time it ran. A principal "
                f"with write access can release it with POST /v1/sessions/{info.id}/release "
                f"(or `turnkeeper sessions release {info.id}`); then send the message again",
            )
        principal = request[PRINCIPAL]
        # The request's span: the next run of the session links to it (`supervisor.tracing`).
        span = self.traces.request(
            "POST /v1/sessions/{id}/inject",
            info.id,
            {"http.request.method": "POST", "http.route": "/v1/sessions/{id}/inject"},
        )
        try:
            seq = await self.store.events.append_async(
                info.id,
                EventType.USER_MESSAGE,
                {"text": body.text, "by": principal},
                writer=Writer.INTAKE,
                # A key is the client's own: scoped to its principal, bound to this body.
                idempotency_key=None if key is None else scoped_key(principal, key),
                idempotency_digest=None if key is None else request_digest(body.model_dump_json()),
            )
            if span is not None:
                span.set_attribute("turnkeeper.event.seq", int(seq))
        finally:
            if span is not None:
                span.end()
        self.storage.worked()
        if isinstance(seq, ReplayedSeq):  # committed before: nothing new to count
            self.metrics.intake_replays.labels(EventType.USER_MESSAGE).inc()
            return answer(Injected(seq=int(seq)), 202, {"Idempotent-Replayed": "true"})
        self.publish(info.id, {"seq": seq, "type": EventType.USER_MESSAGE})
        if span is not None:
            self.traces.arrived(info.id, Trigger.INTAKE, span)
        if self.pool is not None:
            self.pool.wake(info.id)
        return answer(Injected(seq=seq), 202)

    async def wake(self, request: web.Request) -> web.Response:
        self._refuse_while_stopping()
        info = await self._session(request, Permission.WRITE)
        refuse_closed(info)
        await asyncio.to_thread(self.store.sessions.request_turn, info.id)
        self.traces.arrived(info.id, Trigger.INTAKE)
        if self.pool is not None:
            self.pool.wake(info.id)
        return answer(Woken(pending=True), 202)

    async def events(self, request: web.Request) -> web.Response:
        info = await self._session(request)
        after = self._int(request, "after", 0, 0, MAX_SEQ)
        limit = self._int(request, "limit", 100, 1, 1000)
        body = await self.pages.json(info.id, after, limit)  # read and encoded off the loop
        return web.Response(body=body, content_type="application/json", charset="utf-8")

    async def attach(self, request: web.Request) -> web.StreamResponse:
        self._refuse_while_stopping()
        info = await self._session(request)
        header = request.headers.get("Last-Event-ID")
        if header is not None:
            after = whole(header, "Last-Event-ID", 0, 0, MAX_SEQ)
        else:
            after = self._int(request, "after", 0, 0, MAX_SEQ)
        principal = request[PRINCIPAL]
        limit = self.config.http.max_streams_per_principal
        if self.hub.streams_of(principal) >= limit:
            self.metrics.intake_rejections.labels(Rejection.TOO_MANY_STREAMS).inc()
            raise ApiError(
                429,
                "too_many_streams",
                f"{principal} already holds {limit} attach streams "
                "(http.max_streams_per_principal); close one first",
                headers={"Retry-After": RETRY_AFTER},
            )
        if not self.hub.following:  # for the commits of other hosts, which nobody signals here
            self.hub.follow(follow.Heads(self.store.db))
        # A reload may have revoked the token while the session was read; from here on (no
        # await before the subscription) a reload's hang-up reaches this stream.
        if self.tokens.principals().get(principal) != request[TOKEN_HASH]:
            raise ApiError(
                401,
                "unauthorized",
                "this token was revoked or replaced by a reload; send the new one",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await attach.stream(
            request, info.id, after, self.hub, self.pages.sse, principal=principal
        )

    async def acl(self, request: web.Request) -> web.Response:
        info = await self._session(request, Permission.ADMIN)
        body = await read_body(request, AclChange, self.config.http.read_timeout)
        by = request[PRINCIPAL]
        if body.permission is None:
            seq = await asyncio.to_thread(self.store.acl.revoke, info.id, body.principal, by=by)
        else:
            seq = await asyncio.to_thread(
                self.store.acl.grant, info.id, body.principal, body.permission, by=by
            )
        self.publish(info.id, {"seq": seq, "type": EventType.ACL})
        entries = await asyncio.to_thread(self.store.acl.entries, info.id)
        return answer(AclEntries.model_validate({"acl": entries}))

    async def status(self, request: web.Request) -> web.Response:
        if request[PRINCIPAL] != ADMIN:
            raise ApiError(403, "forbidden", "only the admin principal may read the status")
        counts = await asyncio.to_thread(self.store.sessions.counts)
        pool: dict[str, Any] = (
            self.pool.status()
            if self.pool is not None
            else {"slots": [], "restarts": 0, "model": {"state": "ok", "since": None}}
        )
        breaker = self.pool.breaker() if self.pool is not None else None
        seen = await asyncio.to_thread(hosts.seen, self.store, self.host_id)
        return answer(
            Status(
                boot=BootState(
                    id=self.boot_id,
                    ready=self.ready,
                    stopping=self.stopping or self.restarting,
                    started_at=self.started_at,
                    version=__version__,
                ),
                config=config_state(self.reloader, self.config),
                breaker=breaker,
                slots=pool["slots"],
                worker_restarts=pool["restarts"],
                model=pool["model"],
                sessions=counts,
                attach_streams=self.hub.streams,
                **seen,
            )
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return answer(Health())

    async def readyz(self, request: web.Request) -> web.Response:
        if self.stopping or self.restarting:
            return self._readiness(Readiness(status="stopping"), 503)
        if not self.ready:
            return self._readiness(Readiness(status="starting"), 503)
        if not await self.storage.ok():
            why = Readiness(status="storage_unavailable", error=self.storage.error)
            return self._readiness(why, 503)
        return self._readiness(Readiness(status="ready"))

    @staticmethod
    def _readiness(body: Readiness, status: int = 200) -> web.Response:
        return web.json_response(body.model_dump(mode="json", exclude_unset=True), status=status)

    async def metrics_text(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document())

    async def _on_shutdown(self, app: web.Application) -> None:
        # End the attach streams now, or aiohttp waits for them twice shutdown_timeout.
        self.hub.close_all()
