"""Where the daemon's files live, and the listen address: resolved from the configuration
and the environment (systemd's directories, XDG), checked, never read from disk."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_HOST_PORT = re.compile(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})")


def parse_listen(value: str) -> tuple[str, int] | Path:
    """`http.listen` as (host, port), or as the socket path for `unix:/path`.

    Raises ValueError saying what is expected.
    """
    if value.startswith("unix:"):
        path = value.removeprefix("unix:")
        if not path.startswith("/"):
            raise ValueError("a unix socket path must be absolute, as in unix:/run/tk.sock")
        return Path(path)
    match = _HOST_PORT.fullmatch(value)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ValueError("expected HOST:PORT (port 1-65535), [IPv6]:PORT or unix:/absolute/path")
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(match["v6"])
        except ValueError:
            raise ValueError(f"{match['v6']!r} is not an IPv6 address") from None
        return match["v6"], int(match["port"])
    return match["host"], int(match["port"])


# Where the shipped systemd unit has the daemon keep its files (StateDirectory= and
# RuntimeDirectory=); the supervisord program's state directory is the same.
SERVICE_STATE_DIR = Path("/var/lib/turnkeeper")
SERVICE_RUNTIME_DIR = Path("/run/turnkeeper")


@dataclass(frozen=True)
class Paths:
    """Where the daemon keeps its files, resolved from the configuration and environment."""

    state_dir: Path
    runtime_dir: Path
    db_url: str
    admin_token_file: Path


def resolve_paths(
    state_dir: str, runtime_dir: str, store_url: str, environ: Mapping[str, str] | None = None
) -> Paths:
    """The absolute state and runtime directories, database URL and admin token file.

    Reads no files: systemd's $STATE_DIRECTORY and $RUNTIME_DIRECTORY, then
    $XDG_RUNTIME_DIR and ~/.local/state fill in what the configuration leaves empty.
    """
    env = os.environ if environ is None else environ
    state = _absolute(
        state_dir or _first(env.get("STATE_DIRECTORY", "")) or "~/.local/state/turnkeeper", env
    )
    runtime = runtime_dir or _first(env.get("RUNTIME_DIRECTORY", ""))
    if runtime:
        run = _absolute(runtime, env)
    elif env.get("XDG_RUNTIME_DIR"):
        run = _absolute(env["XDG_RUNTIME_DIR"], env) / "turnkeeper"
    else:
        run = state / "run"
    db_url = store_url or f"sqlite:///{state / 'turnkeeper.db'}"
    return Paths(state, run, db_url, state / "admin.token")


def task_work_dir(
    configured: str, state_dir: Path, environ: Mapping[str, str] | None = None
) -> Path:
    """Where background tasks run (`tasks.work_dir`), one directory each: the configured
    directory, else systemd's $CACHE_DIRECTORY/tasks, else `<state_dir>-tasks` beside the
    state directory. Never inside it: see `inside`."""
    env = os.environ if environ is None else environ
    if configured:
        return _absolute(configured, env)
    cache = _first(env.get("CACHE_DIRECTORY", ""))
    if cache:
        return _absolute(cache, env) / "tasks"
    return state_dir.with_name(state_dir.name + "-tasks")


def inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or below it, once both are resolved (links followed)."""
    resolved, top = path.resolve(), directory.resolve()
    return resolved == top or top in resolved.parents


def _first(paths: str) -> str:
    # systemd joins several configured directories with colons.
    return paths.split(":")[0]


def _absolute(path: str, env: Mapping[str, str]) -> Path:
    if path == "~" or path.startswith("~/"):
        path = (env.get("HOME") or str(Path.home())) + path[1:]
    return Path(os.path.abspath(os.path.expanduser(path)))


def make_private_dir(path: Path) -> None:
    """Create `path` and its missing parents as 0700.

    A directory that exists already is left as it is: the operator made it, and
    `supervisor.trust` judges it instead of changing it.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)


MACHINE_ID = Path("/etc/machine-id")
_NOT_IN_HOST_ID = re.compile(r"[^a-z0-9._-]+")


def machine_id(path: Path = MACHINE_ID) -> str:
    """This machine's id (systemd's /etc/machine-id), or "" where there is none."""
    try:
        value = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return value if re.fullmatch(r"[0-9a-f]{32}", value) else ""


def host_id(configured: str, *, machine: str, hostname: str) -> str:
    """The daemon's host id: `daemon.host_id` if set, else the machine id, else the
    hostname made fit (lowercase letters, digits, '.', '_', '-'; at most 40)."""
    if configured:
        return configured
    if machine:
        return machine
    name = _NOT_IN_HOST_ID.sub("-", hostname.lower()).strip("-._")[:40]
    return name or "localhost"
