"""The configuration: built-in defaults < file < environment, checked once at start.

One pydantic model per section holds its keys and defaults; `etc/turnkeeper.toml` shows
every key with its default, and `turnkeeper config show` prints the effective values with
secrets masked (`supervisor.contract.origins`). Variables are read by
`supervisor.contract.envvars`, which also warns of those that look like configuration but
are ignored. A mistake is a `ConfigError` whose one-line message names the key, what is
wrong and where the value came from; the command line turns it into exit code 78.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from supervisor.contract.envvars import Sections, env_warnings, from_environ
from supervisor.contract.limits import MAX_NAME, MAX_SERVERS, PRINTABLE

# Re-exported: most callers take the paths with the configuration.
from supervisor.contract.paths import Paths as Paths
from supervisor.contract.paths import make_private_dir as make_private_dir
from supervisor.contract.paths import parse_listen as parse_listen
from supervisor.contract.paths import resolve_paths as _resolve_paths
from supervisor.contract.secrets import MASK as MASK
from supervisor.contract.secrets import is_secret, mask_keys
from supervisor.contract.secrets import mask_url as mask_url
from supervisor.contract.secrets import mask_urls as mask_urls

DEFAULT_PATH = Path("/etc/turnkeeper/turnkeeper.toml")


AGENT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class ConfigError(Exception):
    """A configuration mistake; the message is one line naming the key and its source."""


_lower = BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value)
_upper = BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value)
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


class _Section(BaseModel):
    # `model` is both a section and a key; pydantic reserves the `model_` prefix otherwise.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class DaemonConfig(_Section):
    state_dir: str = ""
    runtime_dir: str = ""


class StoreConfig(_Section):
    url: str = ""
    synchronous: Annotated[Literal["full", "normal"], _lower] = "full"


class HttpConfig(_Section):
    listen: str = "127.0.0.1:8765"
    max_body: Annotated[int, Field(gt=0)] = 1048576
    read_timeout: PositiveSeconds = 30.0
    max_connections: Annotated[int, Field(ge=1)] = 1024
    max_streams_per_principal: Annotated[int, Field(ge=1)] = 32

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


class PoolConfig(_Section):
    workers: Annotated[int, Field(ge=1)] = 2
    spare: Annotated[int, Field(ge=0)] = 1
    heartbeat_interval: PositiveSeconds = 1.0
    hang_timeout: PositiveSeconds = Field(default=5.0, validate_default=True)

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


class ModelConfig(_Section):
    provider: Annotated[Literal["echo", "openai"], _lower] = "echo"
    delay: Seconds = 0.0
    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = ""
    api_key_env: str = ""
    timeout: PositiveSeconds = 60.0
    max_tokens: Annotated[int, Field(ge=1)] = 1024


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
        first: dict[str, int] = {}
        for index, server in enumerate(servers):
            if server.name in first:
                raise PydanticCustomError(
                    "duplicate_name",
                    "duplicate server name '{name}', already used by mcp.servers[{first}]",
                    {"name": server.name, "first": first[server.name], "at": (index, "name")},
                )
            first[server.name] = index
        return servers


class ShutdownConfig(_Section):
    kill_grace: PositiveSeconds = 3.0
    drain_budget: Seconds = 0.0


class AttachConfig(_Section):
    shutdown_timeout: PositiveSeconds = 5.0


class RecoveryConfig(_Section):
    auto_continue: bool = True
    freshness: PositiveSeconds = 3600.0
    max_per_boot: Annotated[int, Field(ge=0)] = 10
    retry_interval: PositiveSeconds = 300.0
    breaker_threshold: Annotated[int, Field(ge=1)] = 3
    breaker_window: PositiveSeconds = 300.0
    attempt_delays: Annotated[tuple[Seconds, ...], Field(min_length=1)] = (
        0.0,
        5.0,
        30.0,
    )


class LogConfig(_Section):
    format: Annotated[Literal["text", "json"], _lower] = "text"
    level: Annotated[
        Literal["TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"],
        _upper,
    ] = "INFO"


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
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    attach: AttachConfig = Field(default_factory=AttachConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    # The file it was read from (None: built-in defaults), set by `load_config`.
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The configuration file this was read from; None for the built-in defaults."""
        return self._source


def resolve_paths(cfg: Config, environ: Mapping[str, str] | None = None) -> Paths:
    """The absolute state and runtime directories, database URL and admin token file."""
    return _resolve_paths(cfg.daemon.state_dir, cfg.daemon.runtime_dir, cfg.store.url, environ)


def config_keys() -> Sections:
    """Every section's fields by the key that names them in the file."""
    return {name: _keys(model) for name, model in _section_models().items()}


def ignored_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for `TURNKEEPER_*` variables that look like configuration but are not read."""
    return env_warnings(os.environ if environ is None else environ, config_keys())


def _section_models() -> dict[str, type[BaseModel]]:
    models: dict[str, type[BaseModel]] = {}
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            models[name] = field.annotation
    return models


def _keys(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The fields of a section model by the key that names them in the file."""
    return {field.serialization_alias or name: field for name, field in model.model_fields.items()}


def load_config(path: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """The effective configuration: built-in defaults < file < `TURNKEEPER_*` variables.

    The file is `path`, else `$TURNKEEPER_CONFIG`, else /etc/turnkeeper/turnkeeper.toml if it
    exists, else none. Raises ConfigError with a one-line message.
    """
    env = os.environ if environ is None else environ
    file = config_file(path, env)
    from_file = read_file(file) if file is not None else {}
    merged = {name: dict(v) if isinstance(v, dict) else v for name, v in from_file.items()}
    try:
        from_env, variables = from_environ(env, config_keys())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for section, values in from_env.items():
        target = merged.setdefault(section, {})
        if isinstance(target, dict):  # else the file's own error is reported below
            target.update(values)
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        origin = _origin(error["loc"], file, from_file, variables)
        raise ConfigError(f"{_describe(error)} [{origin}]") from None
    config._source = file
    return config


def config_file(path: str | None, env: Mapping[str, str]) -> Path | None:
    """The file to read: `path`, else $TURNKEEPER_CONFIG, else the system file if present."""
    if path is not None:
        return Path(path)
    if env.get("TURNKEEPER_CONFIG"):
        return Path(env["TURNKEEPER_CONFIG"])
    return DEFAULT_PATH if DEFAULT_PATH.exists() else None


def read_file(file: Path) -> dict[str, Any]:
    """The parsed TOML of `file`; raises ConfigError with a one-line message."""
    try:
        with file.open("rb") as stream:
            return tomllib.load(stream)
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{file}: is a directory, not a configuration file") from None
    except tomllib.TOMLDecodeError as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{file}: invalid TOML: {reason}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None


def _origin(
    loc: tuple[int | str, ...],
    file: Path | None,
    from_file: dict[str, Any],
    variables: dict[tuple[str, str], str],
) -> str:
    """Where the value at `loc` came from, for the error message."""
    section, key = str(loc[0]), str(loc[1]) if len(loc) > 1 else ""
    if (section, key) in variables:
        return f"env {variables[section, key]}"
    table = from_file.get(section)
    if section in from_file and (not key or not isinstance(table, dict) or key in table):
        return f"file {file}"
    # A default made invalid by another key (hang_timeout by heartbeat_interval).
    others = [var for (name, _), var in variables.items() if name == section]
    if others:
        return f"env {others[0]}"
    return f"file {file}" if file is not None else "defaults"


def _describe(error: ErrorDetails) -> str:
    at = error.get("ctx", {}).get("at", ())
    loc = (*error["loc"], *at)
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)[1:]
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    names = [part for part in loc if isinstance(part, str)]
    hidden = is_secret(names[-1]) or "env" in names[:-1]
    if error["type"] == "missing" or hidden:
        return f"{key}: {error['msg']}"
    shown = repr(error["input"])
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{key}: {error['msg']} (got {shown})"


def masked_data(cfg: Config, resolved: Paths | None = None) -> dict[str, Any]:
    """The configuration as plain data with every secret shown as `***`; with `resolved`,
    the directories and database URL the daemon resolved in place of empty ones.

    Secrets are the values of secret-sounding keys, MCP servers' environments, and the
    password and secret query parameters of any URL (`store.url`, `model.base_url`, ...).
    """
    data = cfg.model_dump(mode="json", by_alias=True)
    if resolved is not None:
        data["daemon"]["state_dir"] = str(resolved.state_dir)
        data["daemon"]["runtime_dir"] = str(resolved.runtime_dir)
        data["store"]["url"] = resolved.db_url
    for server in data["mcp"]["servers"]:
        server["env"] = dict.fromkeys(server["env"], MASK)
    masked: dict[str, Any] = mask_keys(data)
    return masked


def render_config(cfg: Config) -> str:
    """The configuration as TOML, loadable again, with every secret shown as `***`."""
    data = masked_data(cfg)
    if not data["mcp"]["servers"]:
        del data["mcp"]
    return tomli_w.dumps(data)
