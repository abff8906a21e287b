"""The OpenAPI 3.1 document of the HTTP API, served at /openapi.json.

Its component schemas are built from the pydantic models the handlers use
(`schemas.py`, `model_json_schema`), so they are what the code validates and answers; only
the table of paths below is written by hand. A property test (tests/http/test_api_fuzz.py)
drives the real server from this document and fails on any answer that does not match it.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from supervisor import __version__
from supervisor.core.vocabulary import SessionStatus, TaskStatus
from supervisor.deliveries import routes as deliveries
from supervisor.deliveries.routes import DeliveryList, DeliveryOut, TargetRetried
from supervisor.http import console, operators, reload_route
from supervisor.http.operators import BootList, BreakerReset
from supervisor.http.reload_route import ReloadOut, ReloadRefused
from supervisor.http.schemas import (
    ANSWERS,
    REQUESTS,
    SESSION_ID_PATTERN,
    TASK_ID_PATTERN,
    AclEntries,
    Closed,
    ErrorBody,
    EventList,
    Health,
    Injected,
    Interrupted,
    Readiness,
    Released,
    SessionDetail,
    SessionList,
    SessionOut,
    Status,
    SubagentList,
    TaskList,
    TaskOut,
    Woken,
)
from supervisor.restarts import routes as restarts
from supervisor.restarts.routes import RestartAnswer, RestartList, RestartOut
from supervisor.schedules import routes as schedules
from supervisor.schedules.routes import ScheduleDeleted, ScheduleList, ScheduleOut

ERRORS = {
    400: "Malformed JSON.",
    401: "No valid bearer token.",
    403: "The caller may see the session but not do this, or only the admin token may.",
    404: "No such session, task, schedule, delivery or restart request (or the caller may not "
    "read its session).",
    409: "The session is closed or quarantined (`error.code` says which and the message "
    "how to go on), the Idempotency-Key was used for another request, a task's output "
    "is on another host, schedules are off or at schedules.max_schedules, or a delivery "
    "was delivered already or its target is no longer configured, or the daemon refuses "
    "to restart (`restart_refused`: its configuration on disk does not load, or it is stopping "
    "for another reason).",
    413: "The body is over http.max_body.",
    422: "A field is invalid; `error.field` names it.",
    429: "The principal holds http.max_streams_per_principal attach streams already, or "
    "auth.max_open_sessions_per_principal open sessions (close one), or a restart was "
    "requested less than restart.min_interval ago; retry after Retry-After.",
    503: "The daemon is stopping (or takes no restart request yet), or the database takes no "
    "writes; retry after Retry-After.",
}
AUTH: list[dict[str, list[str]]] = [{"bearer": []}]
PUBLIC: list[dict[str, list[str]]] = []


def _query(name: str, low: int, high: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": low}
    if high is not None:
        schema["maximum"] = high
    return {"name": name, "in": "query", "schema": schema}


SESSION_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": SESSION_ID_PATTERN},
}
TASK_ID = {**SESSION_ID, "schema": {"type": "string", "pattern": TASK_ID_PATTERN}}
SCHEDULE_ID = {**SESSION_ID, "schema": {"type": "string", "pattern": schedules.SCHEDULE_ID_PATTERN}}
LIMIT = _query("limit", 1, 1000)
OFFSET = _query("offset", 0, 1_000_000)
_SESSION_STATES = "|".join(status.value for status in SessionStatus)
SESSION_QUERY = [
    LIMIT,
    OFFSET,
    {
        "name": "q",
        "in": "query",
        "schema": {"type": "string", "maxLength": 200},
        "description": "Only sessions whose title contains it (any case) or whose id starts "
        "with it.",
    },
    {
        "name": "status",
        "in": "query",
        "schema": {"type": "string", "pattern": f"^({_SESSION_STATES})(,({_SESSION_STATES}))*$"},
        "description": "Only sessions in these states (joined by commas).",
    },
    {
        "name": "order",
        "in": "query",
        "schema": {"type": "string", "enum": ["created", "activity"]},
        "description": "created (default): the newest first; activity: the last active first.",
    },
]
_STATUSES = "|".join(status.value for status in TaskStatus)
TASK_STATUS = {
    "name": "status",
    "in": "query",
    "schema": {"type": "string", "pattern": f"^({_STATUSES})(,({_STATUSES}))*$"},
}
AFTER = _query("after", 0)
DELIVERY_ID = {
    **SESSION_ID,
    "schema": {"type": "string", "pattern": deliveries.DELIVERY_ID_PATTERN},
}
RESTART_ID = {**SESSION_ID, "schema": {"type": "string", "pattern": restarts.RESTART_ID_PATTERN}}
ALL_HOSTS = {
    "name": "all",
    "in": "query",
    "schema": {"type": "string", "enum": list(restarts.FLAGS)},
    "description": "true: the requests of every host on the database, not only this daemon's.",
}
DELIVERY_STATUS = {
    "name": "status",
    "in": "query",
    "schema": {"type": "string", "enum": list(deliveries.STATUSES)},
}
OF_SESSION = {
    "name": "session",
    "in": "query",
    "schema": {"type": "string", "pattern": SESSION_ID_PATTERN},
    "description": "Only this session's deliveries; required of a principal that is not admin.",
}
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "schema": {"type": "string", "minLength": 1, "maxLength": 200},
    "description": "The caller's key for this message: sent again with the same body it "
    "appends nothing and answers as the first time, with Idempotent-Replayed: true; with "
    "another body it is a 409.",
}
LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}

CONSOLE_PAGE = {
    "name": "path",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[a-z0-9/]*$"},
    "description": "overview, sessions, sessions/{id}, deliveries, tasks, schedules, boots "
    "(or empty: the overview)",
}
CONSOLE_ASSET = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{console.ASSET_NAME}$"},
}

# The paths: (method, path, operationId, summary, parameters, request body model,
# {status: (answer model or media type, description)}, error statuses, security).
Answer = tuple[type[BaseModel] | str | tuple[str, ...], str]
PATHS: list[tuple[str, str, str, str, list[Any], str | None, dict[int, Answer], str, Any]] = [
    ("post", "/v1/sessions", "createSession", "Create a session; the caller gets admin on it.",
     [], "CreateSession", {201: (SessionDetail, "Created.")}, "400 401 413 422 429 503", AUTH),
    ("get", "/v1/sessions", "listSessions",
     "Sessions the caller may read, a page at a time (`next_offset`), each with the "
     "caller's permission and what it waits for.",
     SESSION_QUERY, None, {200: (SessionList, "Newest first.")}, "401 422", AUTH),
    ("get", "/v1/sessions/{id}", "getSession", "One session.",
     [SESSION_ID], None, {200: (SessionDetail, "The session.")}, "401 403 404", AUTH),
    ("put", "/v1/sessions/{id}", "updateSession",
     "Bind the session to a delivery target the operator configured, or unbind it (null); "
     "write access. Its events from the next commit on are delivered (or not).",
     [SESSION_ID], "SessionUpdate", {200: (SessionOut, "The session.")},
     "400 401 403 404 413 422 503", AUTH),
    ("delete", "/v1/sessions/{id}", "closeSession",
     "Close the session (admin): its turn in flight ends as an interrupt ends it, it runs "
     "no turn and takes no message any more, its history is kept. Idempotent.",
     [SESSION_ID], None, {200: (Closed, "The session is closed.")}, "401 403 404", AUTH),
    ("post", "/v1/sessions/{id}/inject", "inject", "A user message; 202 only once committed.",
     [SESSION_ID, IDEMPOTENCY_KEY], "Inject", {202: (Injected, "Committed as this seq.")},
     "400 401 403 404 409 413 422 503", AUTH),
    ("post", "/v1/sessions/{id}/wake", "wake", "Run a turn with no new message.",
     [SESSION_ID], None, {202: (Woken, "A turn will run.")}, "401 403 404 409 503", AUTH),
    ("post", "/v1/sessions/{id}/interrupt", "interrupt",
     "End the turn in flight; it is never continued.",
     [SESSION_ID], None, {200: (Interrupted, "Whether a turn was running.")}, "401 403 404",
     AUTH),
    ("post", "/v1/sessions/{id}/release", "releaseSession",
     "Lift a quarantine (write access): the turn that kept failing ends failed with a "
     "notice and is never retried; the next message starts a new turn.",
     [SESSION_ID], None, {200: (Released, "Whether it was quarantined, and its status now.")},
     "401 403 404", AUTH),
    ("get", "/v1/sessions/{id}/events", "events", "History, oldest first.",
     [SESSION_ID, AFTER, LIMIT], None, {200: (EventList, "Events with seq > after.")},
     "401 403 404 422", AUTH),
    ("get", "/v1/sessions/{id}/attach", "attach",
     "Server-Sent Events: replay after Last-Event-ID (or ?after=), then live. "
     "`id:` is the seq, `event:` the type. Between them, live: a turn's output as the "
     "model streams it, `event: delta` with `data: {\"turn\", \"text\", \"index\", "
     "\"tool_call\"}` (tool_call: the name of a tool it calls, else null) and no `id:`: "
     "never stored, never replayed, dropped for a client too slow to take it; the "
     "committed model_response carries the whole text.",
     [SESSION_ID, AFTER, LAST_EVENT_ID], None, {200: ("text/event-stream", "The stream.")},
     "401 403 404 422 429 503", AUTH),
    ("put", "/v1/sessions/{id}/acl", "setAcl", "Grant or revoke a principal's access.",
     [SESSION_ID], "AclChange", {200: (AclEntries, "Every principal's access now.")},
     "400 401 403 404 413 422", AUTH),
    ("get", "/v1/sessions/{id}/subagents", "listSubagents",
     "The subagents the session's turns spawned (its children; each child lists its own), "
     "with their status and, once they ended, the start of their result.",
     [SESSION_ID, LIMIT], None, {200: (SubagentList, "Oldest first.")}, "401 404 422",
     AUTH),
    ("get", "/v1/sessions/{id}/tasks", "listTasks",
     "The background tasks the session's turns started, with their status and outcome.",
     [SESSION_ID, LIMIT], None, {200: (TaskList, "Oldest first.")}, "401 404 422", AUTH),
    ("get", "/v1/tasks", "listAllTasks",
     "Background tasks of every session the caller may read (all for the admin token), "
     "newest first; `status` is a comma-separated list of task statuses.",
     [TASK_STATUS, LIMIT], None, {200: (TaskList, "Newest first.")}, "401 422", AUTH),
    ("get", "/v1/tasks/{id}", "getTask", "One background task (read access to its session).",
     [TASK_ID], None, {200: (TaskOut, "The task, with the link to its output.")}, "401 404",
     AUTH),
    ("get", "/v1/tasks/{id}/output", "taskOutput",
     "The task's output so far (its end, up to tasks.max_output), from the host that ran it.",
     [TASK_ID], None, {200: ("text/plain", "The output.")}, "401 404 409", AUTH),
    ("delete", "/v1/tasks/{id}", "cancelTask",
     "Cancel the task (write access to its session): a pending one is cancelled now, a "
     "running one is stopped (SIGTERM, grace, SIGKILL); its outcome `cancelled` is told to "
     "its session. An ended task is answered as it is.",
     [TASK_ID], None, {200: (TaskOut, "The task after the cancel.")}, "401 403 404", AUTH),
    ("post", "/v1/schedules", "createSchedule",
     "A schedule: `text` is injected at each time of `cron`, into `session` (write access) "
     "or, for null, a new session of kind scheduled each time; the caller owns it.",
     [], "CreateSchedule", {201: (ScheduleOut, "Created, with its next time.")},
     "400 401 403 409 413 422 503", AUTH),
    ("get", "/v1/schedules", "listSchedules",
     "The schedules the caller may read (read access to their session, or its own).",
     [LIMIT], None, {200: (ScheduleList, "Oldest first.")}, "401 422", AUTH),
    ("get", "/v1/schedules/{id}", "getSchedule", "One schedule, its next time and last fire.",
     [SCHEDULE_ID], None, {200: (ScheduleOut, "The schedule.")}, "401 404", AUTH),
    ("delete", "/v1/schedules/{id}", "deleteSchedule",
     "Delete a schedule (write access to its session, or its own): it fires no more.",
     [SCHEDULE_ID], None, {200: (ScheduleDeleted, "Deleted.")}, "401 403 404 503", AUTH),
    ("post", "/v1/schedules/{id}/pause", "pauseSchedule",
     "Hold a schedule (write access, as a delete): it does not fire until resumed. A "
     "schedule paused for its owner's revoked token, or ended, is a 409.",
     [SCHEDULE_ID], None, {200: (ScheduleOut, "The schedule, held.")},
     "401 403 404 409 503", AUTH),
    ("post", "/v1/schedules/{id}/resume", "resumeSchedule",
     "Let a held schedule fire again, from now on (no time it was held for is caught up). "
     "One whose owner is not in the tokens file, or ended, is a 409.",
     [SCHEDULE_ID], None, {200: (ScheduleOut, "The schedule, active.")},
     "401 403 404 409 503", AUTH),
    ("get", "/v1/deliveries", "listDeliveries",
     "The delivery outbox, newest first: every delivery for the admin token; any other "
     "principal names a session it may read.",
     [DELIVERY_STATUS, OF_SESSION, LIMIT], None, {200: (DeliveryList, "Newest first.")},
     "401 403 404 422", AUTH),
    ("get", "/v1/deliveries/{id}", "getDelivery",
     "One delivery (read access to its session).",
     [DELIVERY_ID], None, {200: (DeliveryOut, "The delivery.")}, "401 404", AUTH),
    ("post", "/v1/deliveries/{id}/retry", "retryDelivery",
     "Send a delivery again (admin): a dead one is pending again with its attempts "
     "counted from 0, a pending one is due now. A delivered one is a 409.",
     [DELIVERY_ID], None, {200: (DeliveryOut, "The delivery, pending.")},
     "401 403 404 409 503", AUTH),
    ("post", "/v1/deliveries/retry", "retryTargetDeliveries",
     "Send a target's deliveries again (admin): every dead one is pending again with its "
     "attempts counted from 0 and every pending one is due now (but those being sent), in "
     "one transaction; they go out as they were produced (each session's in seq order, the "
     "oldest first). A target not configured is a 409.",
     [], "RetryTarget", {200: (TargetRetried, "How many were dead, and pending.")},
     "400 401 403 409 413 422 503", AUTH),
    ("post", "/v1/restart", "restart",
     "Restart the daemon (admin): intake refuses (503), turns in flight finish within `drain` "
     "(null: shutdown.drain_budget), then it re-executes itself in place. A request while one "
     "is in progress is answered with that one (200, in_progress true).",
     [], "RestartBody",
     {202: (RestartAnswer, "Admitted; the daemon restarts."),
      200: (RestartAnswer, "A restart is in progress already: this is it.")},
     "400 401 403 409 413 422 429 503", AUTH),
    ("get", "/v1/restarts", "listRestarts",
     "Restart requests of this daemon's host (of every host with all=true), newest first "
     "(admin).",
     [ALL_HOSTS, LIMIT], None, {200: (RestartList, "Newest first.")}, "401 403 422", AUTH),
    ("get", "/v1/restarts/{id}", "getRestart",
     "One restart request, its outcome once the boot after it settled it (admin).",
     [RESTART_ID], None, {200: (RestartOut, "The request.")}, "401 403 404", AUTH),
    ("post", "/v1/reload", "reload",
     "Read the configuration again and apply it (admin), as SIGHUP does: what may change "
     "live is applied, the workers are replaced if a key they read changed, and a key that "
     "needs a restart is named and left as it was. A configuration a start would refuse "
     "changes nothing.",
     [], "ReloadBody",
     {200: (ReloadOut, "What changed: in force (wait true), or applied and under way."),
      422: (ReloadRefused, "`invalid_config`: the configuration does not load or a start's "
            "check refuses it (the one line, and the result); `invalid`: a malformed body.")},
     "400 401 403 413 503", AUTH),
    ("get", "/v1/boots", "listBoots",
     "Recent daemon starts of every host on the database, newest first, each with its "
     "state and how it found the breaker (admin).",
     [LIMIT], None, {200: (BootList, "Newest first.")}, "401 403 422", AUTH),
    ("post", "/v1/breaker/reset", "resetBreaker",
     "Clear this host's crash-loop breaker (admin): its boots until now stop counting; the "
     "daemon runs the boot scan it held back within seconds.",
     [], None, {200: (BreakerReset, "Reset.")}, "401 403 409", AUTH),
    ("get", "/v1/status", "status",
     "Boot, worker slots, sessions by state, the hosts on the database (admin only).",
     [], None, {200: (Status, "The daemon's state.")}, "401 403", AUTH),
    ("get", "/healthz", "healthz", "Liveness; needs no token.",
     [], None, {200: (Health, "Alive.")}, "", PUBLIC),
    ("get", "/readyz", "readyz", "Readiness; 503 while starting, stopping or storage fails.",
     [], None,
     {200: (Readiness, "Ready."),
      503: (Readiness, "Starting, stopping, or the database takes no writes.")},
     "", PUBLIC),
    ("get", "/metrics", "metrics", "Prometheus text format.",
     [], None, {200: ("text/plain", "Metrics.")}, "401", [{}, {"bearer": []}]),
    ("get", "/openapi.json", "openapi", "This document.",
     [], None, {200: ("application/json", "The document.")}, "", PUBLIC),
    ("get", "/ui", "consoleRoot", "The operator console (http.console): to /ui/.",
     [], None, {308: ("text/plain", "Moved to /ui/.")}, "", PUBLIC),
    ("get", "/ui/{path}", "consolePage",
     "A page of the operator console (http.console): its HTML, which reads everything "
     "through this API with the token the operator signs in with. Needs no token.",
     [CONSOLE_PAGE], None,
     {200: ("text/html", "The console's page."), 404: (ErrorBody, "No such console page.")},
     "", PUBLIC),
    ("get", "/ui/assets/{name}", "consoleAsset",
     "A script, style sheet or icon of the console, by a name carrying its content's hash "
     "(cached for a year).",
     [CONSOLE_ASSET], None,
     {200: (("text/javascript", "text/css", "image/svg+xml"), "The file."),
      404: (ErrorBody, "No such file of the console.")},
     "", PUBLIC),
]  # fmt: skip


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _content(answer: type[BaseModel] | str | tuple[str, ...]) -> dict[str, Any]:
    if isinstance(answer, tuple):  # one of several media types
        return {media: {"schema": {"type": "string"}} for media in answer}
    if isinstance(answer, str):
        schema = {"type": "object"} if answer == "application/json" else {"type": "string"}
        return {answer: {"schema": schema}}
    return {"application/json": {"schema": _ref(answer)}}


def _components() -> dict[str, Any]:
    """Every request and answer model's JSON schema, refs pointing into components."""
    requests = (
        *REQUESTS,
        *schedules.REQUESTS,
        *deliveries.REQUESTS,
        *restarts.REQUESTS,
        *reload_route.REQUESTS,
    )
    answers = (
        *ANSWERS,
        *schedules.ANSWERS,
        *deliveries.ANSWERS,
        *restarts.ANSWERS,
        *reload_route.ANSWERS,
        *operators.ANSWERS,
    )
    models = [(m, "validation") for m in requests] + [(m, "serialization") for m in answers]
    _, top = models_json_schema(models, ref_template="#/components/schemas/{model}")  # type: ignore[arg-type]
    schemas: dict[str, Any] = top["$defs"]
    return schemas


def _operation(row: tuple[Any, ...]) -> dict[str, Any]:
    _, _, operation_id, summary, parameters, body, answers, errors, security = row
    responses = {
        str(status): {"description": text, "content": _content(answer)}
        for status, (answer, text) in answers.items()
    }
    for status in map(int, errors.split()):
        responses[str(status)] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        }
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "security": security,
    }
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
        }
    operation["responses"] = responses
    return operation


@cache
def _document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for row in PATHS:
        paths.setdefault(row[1], {})[row[0]] = _operation(row)
    return {
        "openapi": "3.1.0",
        "info": {"title": "turnkeeper", "version": __version__},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _components(),
        },
        "paths": paths,
    }


def document() -> dict[str, Any]:
    """The whole document (a fresh copy: callers may change it)."""
    return copy.deepcopy(_document())
