"""The configuration: built-in defaults < file < environment, checked once at start.

One pydantic model per section holds its keys and defaults; `etc/turnkeeper.toml` shows
every key with its default, and `turnkeeper config show` prints the effective values with
secrets masked (`supervisor.contract.origins`). Variables are read by
`supervisor.contract.envvars`, which also warns of those that look like configuration but
are ignored. A mistake is a `ConfigError` whose one-line message names the key, what is
wrong and where the value came from; the command line turns it into exit code 78.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from supervisor.contract import paths
from supervisor.contract.envvars import Sections, env_warnings, from_environ, variable

# Re-exported: most callers take the paths with the configuration.
from supervisor.contract.paths import Paths as Paths
from supervisor.contract.paths import make_private_dir as make_private_dir
from supervisor.contract.paths import parse_listen as parse_listen
from supervisor.contract.paths import resolve_paths as _resolve_paths
from supervisor.contract.secrets import MASK as MASK
from supervisor.contract.secrets import is_secret, mask_keys
from supervisor.contract.secrets import mask_url as mask_url
from supervisor.contract.secrets import mask_urls as mask_urls

# Re-exported: the sections are imported from here.
from supervisor.contract.sections import AgentConfig as AgentConfig
from supervisor.contract.sections import Config as Config
from supervisor.contract.sections import HttpConfig as HttpConfig
from supervisor.contract.sections import McpServer as McpServer
from supervisor.contract.sections import ModelConfig as ModelConfig
from supervisor.contract.sections import PoolConfig as PoolConfig
from supervisor.contract.sections import RecoveryConfig as RecoveryConfig
from supervisor.contract.sections import ShutdownConfig as ShutdownConfig

DEFAULT_PATH = Path("/etc/turnkeeper/turnkeeper.toml")

# Keys of earlier versions whose meaning changed, and what replaced each: a file or a
# variable that still names one is refused saying so (exit 78), so that no setting is
# read with a meaning its author did not give it.
REPLACED = {
    "recovery.max_per_boot": (
        "recovery.max_per_pass (the most one recovery pass continues; passes come every "
        "recovery.pass_interval while interrupted sessions are left)"
    ),
}


class ConfigError(Exception):
    """A configuration mistake; the message is one line naming the key and its source."""


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
    for key, replacement in REPLACED.items():
        name = variable(*key.split("."))
        if name in env:
            raise ConfigError(f"{name}: {key} was replaced by {replacement}")
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
        replaced = REPLACED.get(key)
        return f"{key}: unknown key" + (f"; replaced by {replaced}" if replaced else "")
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

    Secrets are the values of secret-sounding keys, the environments of MCP servers and of
    task kinds, and the password and secret query parameters of any URL (`store.url`,
    `model.base_url`, ...).
    """
    data = cfg.model_dump(mode="json", by_alias=True)
    if resolved is not None:
        data["daemon"]["state_dir"] = str(resolved.state_dir)
        data["daemon"]["runtime_dir"] = str(resolved.runtime_dir)
        data["store"]["url"] = resolved.db_url
        data["daemon"]["host_id"] = resolved_host_id(cfg)
    for entry in [*data["mcp"]["servers"], *data["tasks"]["kinds"]]:
        entry["env"] = dict.fromkeys(entry["env"], MASK)
    masked: dict[str, Any] = mask_keys(data)
    return masked


def config_version(cfg: Config) -> str:
    """The configuration's version: 12 hex digits of a SHA-256 of its effective values.

    Equal configurations have equal versions, whatever file or variables they came from;
    `/v1/status`, `reload` and a restart's notice show it.
    """
    data = cfg.model_dump(mode="json", by_alias=True)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def resolved_host_id(cfg: Config) -> str:
    """`daemon.host_id`, or the default it stands for (the machine id, else the hostname)."""
    return paths.host_id(
        cfg.daemon.host_id, machine=paths.machine_id(), hostname=socket.gethostname()
    )


def render_config(cfg: Config) -> str:
    """The configuration as TOML, loadable again, with every secret shown as `***`."""
    data = masked_data(cfg)
    if not data["mcp"]["servers"]:
        del data["mcp"]
    return tomli_w.dumps(data)
