"""The configuration in effect, and where each value came from, for `turnkeeper config show`.

"In effect" means as the daemon uses it: the state and runtime directories and the
database URL resolved (systemd's directories, XDG, the home directory) where the
configuration leaves them empty, and every secret masked. An origin is `default`,
`file:PATH:LINE` or `env:VARIABLE`; tomllib gives no line numbers, so the line is found by
a scan of the file for the key in its table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from supervisor.contract.config import (
    Config,
    ConfigError,
    config_keys,
    masked_data,
    read_file,
    resolve_paths,
)
from supervisor.contract.envvars import from_environ

_HEADER = re.compile(r"\s*\[\[?\s*(?P<table>[^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""\s*(?P<key>"[^"]*"|'[^']*'|[A-Za-z0-9_-]+)\s*=""")
_RENDERED_KEY = re.compile(r"(?P<key>[A-Za-z0-9_-]+|\"[^\"]*\") = ")

# Keys left empty in the configuration and filled in from the environment, by variable.
_RESOLVED_FROM = {
    ("daemon", "state_dir"): ("STATE_DIRECTORY",),
    ("daemon", "runtime_dir"): ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"),
}


def effective(cfg: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The configuration as plain data, paths and URL resolved, secrets masked."""
    return masked_data(cfg, resolve_paths(cfg, environ))


def key_lines(text: str) -> dict[tuple[str, str], int]:
    """The line (from 1) of each `key` in its `[section]`, and of the first [[mcp.servers]]."""
    table = ""
    found: dict[tuple[str, str], int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if header := _HEADER.match(line):
            table = header["table"].replace(" ", "")
            if table == "mcp.servers":
                found.setdefault(("mcp", "servers"), number)
            continue
        key = _KEY.match(line)
        if key and table and "." not in table:
            found.setdefault((table, key["key"].strip("\"'")), number)
    return found


def origins(cfg: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Where each key's value came from, by `section.key`."""
    env = os.environ if environ is None else environ
    file = cfg.source
    from_file: dict[str, Any] = {}
    lines: dict[tuple[str, str], int] = {}
    if file is not None:
        try:
            from_file = read_file(file)
            lines = key_lines(file.read_text(encoding="utf-8"))
        except (ConfigError, OSError, UnicodeDecodeError):
            pass  # changed since it was loaded: the values stand, their lines are unknown
    try:
        _, variables = from_environ(env, config_keys())
    except ValueError:
        variables = {}
    found = {}
    for section, keys in config_keys().items():
        table = from_file.get(section)
        for key in keys:
            if (section, key) in variables:
                origin = f"env:{variables[section, key]}"
            elif isinstance(table, dict) and key in table:
                line = lines.get((section, key))
                origin = f"file:{file}" + (f":{line}" if line else "")
            else:
                origin = _resolved(section, key, env)
            found[f"{section}.{key}"] = origin
    return found


def _resolved(section: str, key: str, env: Mapping[str, str]) -> str:
    """`default`, or the variable a path left empty was resolved from."""
    for name in _RESOLVED_FROM.get((section, key), ()):
        if env.get(name):
            return f"env:{name}"
    return "default"


def render_effective(
    cfg: Config, environ: Mapping[str, str] | None = None, *, with_origins: bool = False
) -> str:
    """The effective configuration as TOML (loadable again), each key's origin as a comment."""
    text = tomli_w.dumps(effective(cfg, environ))
    if not with_origins:
        return text
    return annotate(text, origins(cfg, environ))


def annotate(text: str, found: dict[str, str]) -> str:
    """`text` (as rendered) with `# ORIGIN` after each key of a section, and after the
    header of each MCP server (whose keys all come from where the list does)."""
    table = ""
    out = []
    for line in text.splitlines():
        origin = None
        if header := _HEADER.match(line):
            table = header["table"]
            origin = found.get(table) if line.startswith("[[") else None
        elif (key := _RENDERED_KEY.match(line)) and "." not in table:
            origin = found.get(f"{table}.{key['key'].strip(chr(34))}")
        out.append(f"{line}  # {origin}" if origin else line)
    return "\n".join(out) + "\n"


def source_name(file: Path | None) -> str:
    """The configuration file for a log line, or what stands in for one."""
    return str(file) if file is not None else "built-in defaults"
