"""The configuration's sections: one pydantic model per section, with its keys and defaults.

`supervisor.contract.config` loads them (defaults < file < environment) and turns a
mistake into a one-line `ConfigError`; `etc/turnkeeper.toml` shows every key here with
its default and a comment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from supervisor.contract.delivery_targets import DeliveryConfig
from supervisor.contract.limits import MAX_NAME, MAX_SERVERS, PRINTABLE
from supervisor.contract.named import unique_names
from supervisor.contract.paths import parse_listen
from supervisor.contract.task_kinds import SchedulesConfig, TasksConfig

AGENT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


_lower = BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value)
_upper = BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value)
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


class _Section(BaseModel):
    # `model` is both a section and a key; pydantic reserves the `model_` prefix otherwise.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


HOST_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")


class DaemonConfig(_Section):
    state_dir: str = ""
    runtime_dir: str = ""
    host_id: str = ""  # "": the machine id, else the hostname (`paths.host_id`)

    @field_validator("host_id")
    @classmethod
    def _check_host_id(cls, value: str) -> str:
        if value and not HOST_ID.fullmatch(value):
            raise PydanticCustomError(
                "host_id",
                "must be 1 to 40 lowercase letters, digits, '.', '_' or '-', starting with a "
                "letter or digit (it names this daemon to the others on the database)",
            )
        return value


class StoreConfig(_Section):
    url: str = ""
    synchronous: Annotated[Literal["full", "normal"], _lower] = "full"
    # One event's payload at most (JSON, bytes); above http.max_body, model.max_response_bytes
    # and tools.max_result_bytes (a start checks it), so what they admit can be stored.
    max_event_bytes: Annotated[int, Field(ge=65536)] = 8 << 20
    # How long `run` waits for a PostgreSQL or MySQL server that is not there yet (refused,
    # timed out, starting up) before it exits 1; 0: it does not wait.
    connect_timeout: Seconds = 120.0


class HttpConfig(_Section):
    listen: str = "127.0.0.1:8765"
    max_body: Annotated[int, Field(gt=0)] = 1048576
    read_timeout: PositiveSeconds = 30.0
    max_connections: Annotated[int, Field(ge=1)] = 1024
    max_streams_per_principal: Annotated[int, Field(ge=1)] = 32
    # A client that reads none of what it is sent (an answer, an attach stream) for this
    # long is disconnected.
    write_timeout: PositiveSeconds = 30.0
    # The operator console's pages at /ui/ (files only: it reads through the API).
    console: bool = True

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise PydanticCustomError("listen", "{reason}", {"reason": str(exc)}) from None
        return value


class AuthConfig(_Section):
    tokens_file: str = ""
    metrics_public: bool = True
    # Sessions one principal may have that are not closed (subagents not counted): 429 past it.
    max_open_sessions_per_principal: Annotated[int, Field(ge=1)] = 10000


class PoolConfig(_Section):
    workers: Annotated[int, Field(ge=1)] = 2
    spare: Annotated[int, Field(ge=0)] = 1
    heartbeat_interval: PositiveSeconds = 1.0
    hang_timeout: PositiveSeconds = Field(default=5.0, validate_default=True)
    history_cache_mb: Annotated[int, Field(ge=0)] = 64  # per worker: the session logs kept

    @field_validator("hang_timeout")
    @classmethod
    def _after_heartbeat(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise PydanticCustomError(
                "hang_timeout",
                "must be greater than pool.heartbeat_interval ({interval})",
                {"interval": interval},
            )
        return value


class LeaseConfig(_Section):
    stale_after: PositiveSeconds = 30.0


class AgentConfig(_Section):
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    # `class` is the key in the file; a Python attribute cannot be called that. Separate
    # validation and serialization aliases keep `AgentConfig(class_=...)` well typed.
    class_: str = Field(
        default="workers.agents.tool_loop:ToolLoopAgent",
        validation_alias="class",
        serialization_alias="class",
    )

    # The agent classes a session may name; empty means just `class`. A request can only
    # choose among these: an agent is code, and only the operator decides what runs.
    allowed: list[str] = Field(default_factory=list)

    @field_validator("class_")
    @classmethod
    def _check_class(cls, value: str) -> str:
        if not AGENT_SPEC.fullmatch(value):
            raise PydanticCustomError("agent_class", "expected 'package.module:Class'")
        return value

    @field_validator("allowed")
    @classmethod
    def _check_allowed(cls, values: list[str]) -> list[str]:
        for index, value in enumerate(values):
            if not AGENT_SPEC.fullmatch(value):
                raise PydanticCustomError(
                    "agent_class",
                    "expected 'package.module:Class' (got {got!r})",
                    {"got": value, "at": (index,)},
                )
        return values

    def allowed_classes(self) -> list[str]:
        """The agent classes a session may name: `class` and those listed in `allowed`."""
        return [self.class_, *(name for name in self.allowed if name != self.class_)]


COMPACTION_PROMPT = (
    "Summarize the conversation so far for your own later use; the summary replaces it. "
    "Keep the user's goals and requests, decisions made, facts learned, the results of "
    "tool calls that still matter, and the work left to do. Be brief."
)


class ModelConfig(_Section):
    provider: Annotated[Literal["echo", "openai"], _lower] = "echo"
    delay: Seconds = 0.0
    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = ""
    api_key_env: str = ""
    timeout: PositiveSeconds = 60.0
    max_tokens: Annotated[int, Field(ge=1)] = 1024
    # An answer's body past this many bytes fails the call for good, unread.
    max_response_bytes: Annotated[int, Field(ge=1024)] = 4 << 20
    # openai: ask for the answer as a stream, so attached clients watch it being written;
    # off: one whole answer a call (a server that counts no tokens in a stream counts them).
    stream: bool = True
    # Tokens the model reads at most (prompt and answer); 0: unknown, learned from the
    # server's first context-length error. A prompt past `context_window - max_tokens -
    # context_margin` has its older turns replaced by a summary first (compaction).
    # A server that is down, answers 5xx or 429, or times out is waited out for this long
    # (seconds from the outage's start), the turn calling again with backoff; then it fails.
    outage_budget: Seconds = 900.0
    context_window: Annotated[int, Field(ge=0)] = 0
    context_margin: Annotated[int, Field(ge=0)] = 128
    compaction_prompt: Annotated[str, Field(min_length=1, max_length=4096)] = COMPACTION_PROMPT


class McpServer(_Section):
    # Shown to operators and sent in every heartbeat: the control plane's limits.
    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME, pattern=PRINTABLE)]
    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = ""
    start_timeout: PositiveSeconds = 10.0
    call_timeout: PositiveSeconds = 60.0


class McpConfig(_Section):
    servers: list[McpServer] = Field(default_factory=list, max_length=MAX_SERVERS)

    @field_validator("servers")
    @classmethod
    def _unique_names(cls, servers: list[McpServer]) -> list[McpServer]:
        unique_names(servers, "server name", "mcp.servers")
        return servers


class BudgetConfig(_Section):
    # Tokens (prompt and answer, as the server counts them) a turn, or a session over its
    # whole life, may spend on the model; 0: no limit. A turn whose next call would pass
    # one ends `budget_exhausted`, with a notice saying what was spent.
    turn_tokens: Annotated[int, Field(ge=0)] = 0
    session_tokens: Annotated[int, Field(ge=0)] = 0


class ToolsConfig(_Section):
    # A tool's result past this many bytes of UTF-8 is cut, with a note, before the model
    # reads it and before it is stored.
    max_result_bytes: Annotated[int, Field(ge=1024)] = 256 * 1024


class ShutdownConfig(_Section):
    kill_grace: PositiveSeconds = 3.0
    drain_budget: Seconds = 0.0
    subagent_drain: Seconds = 5.0


class AttachConfig(_Section):
    shutdown_timeout: PositiveSeconds = 5.0


class RecoveryConfig(_Section):
    auto_continue: bool = True
    freshness: PositiveSeconds = 3600.0
    # At most max_per_pass interrupted sessions a pass, a pass every pass_interval while
    # some are left (`supervisor.core.pacing`): 100 are all continued 45 s after the boot scan.
    max_per_pass: Annotated[int, Field(ge=0)] = 10
    pass_interval: PositiveSeconds = 5.0
    retry_interval: PositiveSeconds = 300.0
    breaker_threshold: Annotated[int, Field(ge=1)] = 3
    breaker_window: PositiveSeconds = 300.0
    attempt_delays: Annotated[tuple[Seconds, ...], Field(min_length=1)] = (
        0.0,
        5.0,
        30.0,
    )


class SubagentsConfig(_Section):
    max_depth: Annotated[int, Field(ge=0, le=32)] = 2
    max_children: Annotated[int, Field(ge=0, le=1000)] = 8
    max_total_per_root: Annotated[int, Field(ge=1)] = 64  # running in one tree, at all depths
    freshness: PositiveSeconds = 7200.0
    max_recoveries: Annotated[int, Field(ge=1, le=100)] = 3
    max_per_boot: Annotated[int, Field(ge=0)] = 10
    reconcile_interval: PositiveSeconds = 30.0


MIN_AGENT_INTERVAL = 1.0  # restart.min_interval's floor while agents may ask


class RestartConfig(_Section):
    # Whether a turn may ask for a restart of the daemon (tool `request_restart`).
    agent_may_request: bool = False
    # The principals whose sessions' agents may ask (the session's creator; for a subagent
    # its tree's): the admin only by default.
    agent_principals: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=lambda: ["admin"]
    )
    min_interval: Seconds = Field(default=60.0, validate_default=True)  # since the last request
    turn_wait: Seconds = 60.0  # an agent's request waits this long for its turn to end
    # A restart lets turns and tasks in flight finish first, this long at most (a request
    # may say otherwise: `turnkeeper restart --drain SECONDS`).
    drain_budget: Seconds = 300.0

    @field_validator("min_interval")
    @classmethod
    def _bounded_for_agents(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("agent_may_request") and value < MIN_AGENT_INTERVAL:
            raise PydanticCustomError(
                "min_interval",
                "must be at least {least} s while restart.agent_may_request is true (an "
                "agent's every restart_result starts a turn that could ask again)",
                {"least": MIN_AGENT_INTERVAL},
            )
        return value


class LogConfig(_Section):
    format: Annotated[Literal["text", "json"], _lower] = "text"
    level: Annotated[
        Literal["TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"],
        _upper,
    ] = "INFO"


def check_endpoint(value: str) -> str | None:
    """Why `value` is not an OTLP/HTTP endpoint (an http or https URL with a host), or
    None when it is one."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL (OTLP over HTTP)"
    if not parts.hostname:
        return "must name a host"
    if parts.query or parts.fragment:
        return "must have no query or fragment"
    return None


class TelemetryConfig(_Section):
    # Traces over OTLP/HTTP: the collector's base URL ("": off, unless the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT is set); spans go to its /v1/traces.
    otlp_endpoint: str = ""
    # Messages, tool arguments and tool results in the spans; off: only their sizes.
    capture_content: bool = False
    service_name: Annotated[str, StringConstraints(min_length=1, max_length=100)] = "turnkeeper"
    # Spans a process queues for export at most; past it, spans are dropped and counted.
    queue_size: Annotated[int, Field(ge=1, le=1_000_000)] = 2048

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        problem = check_endpoint(value) if value else None
        if problem is not None:
            raise PydanticCustomError("otlp_endpoint", "{reason}", {"reason": problem})
        return value


class Config(_Section):
    """The whole configuration; sections in the order of the documentation."""

    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    lease: LeaseConfig = Field(default_factory=LeaseConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mcp: McpConfig = Field(default_factory=McpConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    attach: AttachConfig = Field(default_factory=AttachConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    subagents: SubagentsConfig = Field(default_factory=SubagentsConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    schedules: SchedulesConfig = Field(default_factory=SchedulesConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    # The file it was read from (None: built-in defaults), set by `load_config`.
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The configuration file this was read from; None for the built-in defaults."""
        return self._source
