"""The bodies of the HTTP API: what a request may send and what every answer holds.

Pydantic models, so that one definition both validates a request and describes it: the
OpenAPI document (`openapi.py`) builds its component schemas from these, and the handlers
(`app.py`) build their answers with them, so the document cannot drift from the code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from supervisor.core.vocabulary import (
    MCP_REPORTED,
    McpState,
    Permission,
    SessionKind,
    SessionStatus,
    SlotState,
    SubagentStatus,
    TaskStatus,
)

MAX_TEXT = 100_000  # characters of a message, a goal or a prompt
SESSION_ID_PATTERN = r"^[0-9a-f]{32}$"
TASK_ID_PATTERN = r"^t[0-9a-f]{32}$"
AGENT_PATTERN = r"^$|^[\w.]+:\w+$"
PRINCIPAL_PATTERN = r"^[A-Za-z0-9_.@-]{1,100}$"
MAX_TARGET = 100  # characters of a delivery target's name as a request may send it


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests ---------------------------------------------------------------------------


class RunBody(_Request):
    """An autonomous run: what to achieve, how to go on, and what it may spend."""

    goal: str = Field(min_length=1, max_length=MAX_TEXT)
    prompt: str = Field(
        default="Continue working towards the goal. Say [goal met] when it is achieved.",
        min_length=1,
        max_length=MAX_TEXT,
        description="sent as the user message of each next turn",
    )
    max_turns: int = Field(ge=1, le=100_000)
    max_tokens: int | None = Field(default=None, ge=1)
    deadline_seconds: float | None = Field(default=None, gt=0)


class CreateSession(_Request):
    """A new session; `run` goes with kind autonomous, and only there."""

    kind: SessionKind = SessionKind.ATTACHED
    title: str = Field(default="", max_length=200)
    agent: str = Field(
        default="",
        max_length=200,
        pattern=AGENT_PATTERN,
        description="package.module:Class, or empty for the default",
    )
    run: RunBody | None = Field(
        default=None, description="required for kind autonomous, and only there"
    )
    deliver_to: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TARGET,
        description="the name of a delivery target the operator configured "
        "([[delivery.targets]]): the session's events are pushed there from its first on",
    )

    @model_validator(mode="after")
    def _run_for_autonomous(self) -> CreateSession:
        if (self.kind == SessionKind.AUTONOMOUS) != (self.run is not None):
            raise ValueError("run (goal, max_turns, ...) goes with kind autonomous, and only there")
        return self


class SessionUpdate(_Request):
    """Bind the session to a delivery target, or unbind it (null)."""

    deliver_to: str | None = Field(
        min_length=1,
        max_length=MAX_TARGET,
        description="a target's name ([[delivery.targets]]); null: no more deliveries",
    )


class Inject(_Request):
    """A user message."""

    text: str = Field(min_length=1, max_length=MAX_TEXT)


class AclChange(_Request):
    """Grant a principal a permission on the session, or revoke it (null)."""

    principal: str = Field(pattern=PRINCIPAL_PATTERN)
    permission: Permission | None = Field(description="null revokes the principal's access")


# --- answers ----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong: a stable code and a message naming what to fix."""

    code: str
    message: str
    field: str | None = Field(default=None, description="the invalid field, for a 422")
    seq: int | None = Field(default=None, description="the seq the Idempotency-Key made, for a 409")


class ErrorBody(BaseModel):
    """Every error answer."""

    error: ErrorDetail


class Compaction(BaseModel):
    """A session's newest compaction: its older turns replaced by a summary."""

    seq: int
    at: float
    method: str | None = Field(description="summary, or dropped when none could be made")
    to_seq: int | None = Field(description="the last event it stands for")
    tokens_before: int | None
    tokens_after: int | None


class ContextUse(BaseModel):
    """A session's use of the model's context window."""

    last_prompt_tokens: int | None = Field(description="tokens of its last prompt")
    window: int | None = Field(description="the model's window: configured, or learned")
    used: float | None = Field(description="last_prompt_tokens / window")
    compactions: int = Field(ge=0)
    last_compaction: Compaction | None


class SessionOut(BaseModel):
    """A session."""

    id: str = Field(pattern=SESSION_ID_PATTERN)
    kind: SessionKind
    parent: str | None
    title: str
    agent: str
    status: SessionStatus
    created_at: float
    updated_at: float
    last_seq: int = Field(ge=0)
    pending: bool
    active_turn_id: str | None
    resend_requested_at: float | None = Field(
        description="recovery ended a turn it could not continue and asked the user to "
        "resend; cleared by the next message"
    )
    deliver_to: str | None = Field(description="the delivery target it is bound to, if any")
    owner: str | None = Field(
        default=None,
        description="the worker that holds its lease (host, boot, slot), if any; shown to "
        "the admin token only (null for every other caller)",
    )
    quarantined_at: float | None = Field(
        default=None, description="when recovery quarantined it (its turns kept killing workers)"
    )
    quarantine_reason: str | None = None
    waiting: str | None = Field(
        default=None,
        description="what an interrupted turn of it waits for: `continuation attempt 2 of 3 "
        "at 12:01:07` (the daemon's local time); null when it waits for nothing",
    )
    permission: Permission | None = Field(
        default=None,
        description="the caller's permission on it (the admin token: admin); what a client "
        "may offer to do, which the API decides again on each request",
    )


class SessionDetail(SessionOut):
    """A session, with its use of the model's context window."""

    context: ContextUse


class SessionList(BaseModel):
    """Sessions the caller may read, newest first."""

    sessions: list[SessionOut]
    next_offset: int | None = Field(
        default=None, description="the `offset` of the next page; null: this is the last"
    )


class EventOut(BaseModel):
    """One committed event of a session's log."""

    seq: int = Field(ge=1)
    type: str = Field(description="an event type (user_message, turn_started, ...)")
    turn_id: str | None
    payload: dict[str, Any]
    created_at: float


class EventList(BaseModel):
    """Events with seq > after, oldest first."""

    events: list[EventOut]


class Injected(BaseModel):
    """The seq the user message was committed as."""

    seq: int = Field(ge=1)


class Woken(BaseModel):
    """The session is pending: a turn will run."""

    pending: bool


class Interrupted(BaseModel):
    """Whether a turn was running, and the seq of its `turn_ended`."""

    interrupted: bool
    seq: int | None


class Closed(BaseModel):
    """The session is closed (it was already, or is now): no more turns, history kept."""

    id: str = Field(pattern=SESSION_ID_PATTERN)
    status: Literal[SessionStatus.CLOSED] = SessionStatus.CLOSED


class Released(BaseModel):
    """Whether a quarantine was lifted (false: the session was not quarantined)."""

    id: str = Field(pattern=SESSION_ID_PATTERN)
    released: bool
    status: SessionStatus


class AclEntries(BaseModel):
    """Every principal's permission on the session now."""

    acl: dict[str, Permission]


class SubagentOut(BaseModel):
    """A subagent: a child session one of the parent's turns spawned for a task."""

    id: str = Field(pattern=SESSION_ID_PATTERN, description="the child session's id")
    parent: str = Field(pattern=SESSION_ID_PATTERN)
    depth: int = Field(ge=1, description="1 for a child of a top session, 2 for its child, ...")
    task: str
    title: str
    agent: str
    status: SubagentStatus = Field(
        description="running until its result was reported to the parent, then final"
    )
    created_at: float
    ended_at: float | None
    result: str | None = Field(
        description="the start of its answer or of why it ended; null while running"
    )


class SubagentList(BaseModel):
    """The session's subagents (its children, not theirs), oldest first."""

    subagents: list[SubagentOut]


class TaskOut(BaseModel):
    """A background task one of the session's turns started (a kind the operator defined)."""

    id: str = Field(pattern=TASK_ID_PATTERN)
    session: str = Field(pattern=SESSION_ID_PATTERN)
    kind: str
    args: dict[str, str] = Field(description="its arguments, as checked against the kind")
    status: TaskStatus = Field(description="pending or running, then its outcome")
    attempt: int = Field(ge=1, description="2 once a kind with retry_on_restart was retried")
    cancel_requested: bool
    host: str | None = Field(description="the host whose daemon ran it; its output is there")
    exit_code: int | None = Field(description="negative: killed by that signal")
    duration: float | None = Field(description="seconds the command ran")
    reason: str = Field(description="why it ended so, when the exit status does not say")
    output_tail: str = Field(description="the end of its output, once it ended")
    started_seq: int = Field(ge=1, description="its session's `task_started`")
    result_seq: int | None = Field(description="its session's `task_result`, once reported")
    created_at: float
    started_at: float | None
    heartbeat_at: float | None
    ended_at: float | None
    output_url: str = Field(description="GET it for the output so far (text/plain)")


class TaskList(BaseModel):
    """The session's background tasks, oldest first."""

    tasks: list[TaskOut]


class BootState(BaseModel):
    """This boot of the daemon."""

    id: str
    ready: bool
    stopping: bool
    started_at: float | None = Field(
        default=None, description="when this boot started (Unix time, the daemon's clock)"
    )
    version: str = Field(default="", description="the daemon's turnkeeper version")


class McpServerOut(BaseModel):
    """One MCP server of a worker, as the worker's last heartbeat reported it."""

    name: str
    state: McpState = Field(description="one of " + ", ".join(MCP_REPORTED))


class SlotOut(BaseModel):
    """A worker slot and the worker in it now (null fields: no worker)."""

    slot: int = Field(ge=0)
    state: SlotState
    worker: str | None
    pid: int | None
    ready: bool
    spare: bool
    sessions: int = Field(ge=0, description="sessions the worker owns")
    turns: int = Field(ge=0, description="turns in flight")
    turns_served: int = Field(ge=0, description="turns the worker ended since it started")
    mcp: list[McpServerOut] = Field(description="its MCP servers, in configuration order")


class HostSelf(BaseModel):
    """This daemon on the database."""

    id: str = Field(description="its daemon.host_id (default: the machine id, else the hostname)")


class HostOut(BaseModel):
    """A daemon on the database, as its row in the host registry says (database clock)."""

    id: str
    hostname: str
    state: Literal["live", "left", "lost"] = Field(
        description="live: renewing its row; left: stopped cleanly; lost: stopped renewing "
        "(the others adopt its sessions once their leases run out)"
    )
    last_seen: float = Field(description="its last renewal, database epoch seconds")
    seen_ago: float = Field(ge=0, description="seconds since then, by the database clock")
    sessions: int = Field(ge=0, description="sessions its workers hold a live lease on")
    pid: int
    version: str
    boot: str = Field(description="the boot id of the daemon holding the row")


class ConfigState(BaseModel):
    """The configuration in force (`turnkeeper reload` replaces it)."""

    version: str = Field(description="12 hex digits of a hash of its effective values")
    loaded_at: float = Field(
        description="when it was loaded (epoch seconds): the start, or the last reload that "
        "changed it"
    )
    source: str | None = Field(description="the file it was read from; null: built-in defaults")


class ModelState(BaseModel):
    """The model as the workers find it."""

    state: Literal["ok", "unavailable"]
    since: float | None = Field(description="when the outage began, while unavailable")


class Status(BaseModel):
    """The daemon's state, for the operator."""

    boot: BootState
    config: ConfigState
    breaker: dict[str, Any] | None
    slots: list[SlotOut]
    worker_restarts: int = Field(ge=0)
    model: ModelState
    sessions: dict[str, int] = Field(description="by state: open, running, pending, ...")
    attach_streams: int = Field(ge=0)
    host: HostSelf
    hosts: list[HostOut] = Field(description="every daemon on this database, by id")
    hosts_error: str | None = Field(
        description="why the hosts could not be read (then `hosts` is empty), else null"
    )


class Health(BaseModel):
    """Alive."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """Ready, or why not (with a 503)."""

    status: Literal["ready", "starting", "stopping", "storage_unavailable"]
    error: str | None = Field(default=None, description="why the database takes no writes")


REQUESTS: tuple[type[BaseModel], ...] = (CreateSession, SessionUpdate, Inject, AclChange)
ANSWERS: tuple[type[BaseModel], ...] = (
    ErrorBody,
    SessionDetail,
    SessionOut,
    SessionList,
    EventList,
    Injected,
    Woken,
    Interrupted,
    Closed,
    Released,
    AclEntries,
    SubagentList,
    TaskOut,
    TaskList,
    Status,
    Health,
    Readiness,
)
