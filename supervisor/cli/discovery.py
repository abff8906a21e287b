"""Finding the running daemon: the one place every command that talks to it looks.

The places, in order (docs/reference/command-line.md, "How the command line finds the daemon"):

1. the state directory the configuration names: `--state-dir`, $TURNKEEPER_STATE_DIR,
   `daemon.state_dir` or `daemon.runtime_dir` (file or variable), or systemd's
   $STATE_DIRECTORY/$RUNTIME_DIRECTORY. A place named so is the only one looked at;
2. else the service's directories, /var/lib/turnkeeper and /run/turnkeeper (the shipped
   unit's StateDirectory= and RuntimeDirectory=; supervisord's program has the same
   state directory);
3. then the user's, ~/.local/state/turnkeeper and $XDG_RUNTIME_DIR/turnkeeper.

A daemon runs in a place when a process holds its state directory's leader lock; where it
listens is what it published (`supervisor.contract.published`), if the file is that
process's, else `http.listen`. A place this user may not look into (the unit makes its
directories 0700) is not taken for "no daemon": when no other place has one, the answer is
"cannot tell", with the file that could not be read.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from supervisor import locks
from supervisor.contract import published
from supervisor.contract.config import Config, resolve_paths
from supervisor.contract.paths import SERVICE_RUNTIME_DIR, SERVICE_STATE_DIR

TOKEN_VARIABLE = "TURNKEEPER_TOKEN"
ADMIN_TOKEN = "admin.token"
SUPERVISORD_PROGRAM = Path("/etc/supervisor/conf.d/turnkeeper.conf")


@dataclass(frozen=True)
class Place:
    """A state and runtime directory a daemon may run in, and the address to try when it
    published none (one started before it listens, or by an older version)."""

    state_dir: Path
    runtime_dir: Path
    listen: str
    service: bool = False  # the service's directories, as the unit or supervisord makes them


@dataclass(frozen=True)
class Running:
    """A daemon that runs: its pid, where it listens, its directories, what it published."""

    pid: int
    listen: str
    state_dir: Path
    runtime_dir: Path
    published: published.Published | None = None

    @property
    def token_file(self) -> Path:
        return self.state_dir / ADMIN_TOKEN


@dataclass(frozen=True)
class Search:
    """What a search found: a running daemon, or none, or why it cannot tell."""

    places: list[Place]
    running: Running | None = None
    denied: list[Path] = field(default_factory=list)  # files this user may not read
    service: bool = False  # the service's directories exist on this host

    @property
    def unknown(self) -> str | None:
        """Why it cannot tell whether a daemon runs, when none was found; else None."""
        if self.running is not None or not self.denied:
            return None
        return f"permission denied reading {self.denied[0]}"

    def start_advice(self) -> str:
        """The command that starts the daemon here: the service's when it is installed."""
        if self.service:
            if SUPERVISORD_PROGRAM.exists():
                return "`supervisorctl start turnkeeper`"
            return "`systemctl start turnkeeper`"
        return "`turnkeeper run`"

    def not_running(self) -> str:
        """One line saying that no daemon runs, where it looked, and how to start one."""
        where = ", ".join(str(p.state_dir) for p in self.places)
        return f"the daemon is not running (none in {where}); start it with {self.start_advice()}"


def places(cfg: Config, environ: Mapping[str, str] | None = None) -> list[Place]:
    """The places to look in, in order (see the module's docstring)."""
    env = os.environ if environ is None else environ
    own = resolve_paths(cfg, env)
    listen = cfg.http.listen
    named = cfg.daemon.state_dir or cfg.daemon.runtime_dir
    if named or env.get("STATE_DIRECTORY") or env.get("RUNTIME_DIRECTORY"):
        return [Place(own.state_dir, own.runtime_dir, listen)]
    service = Place(SERVICE_STATE_DIR, SERVICE_RUNTIME_DIR, listen, service=True)
    return [service, Place(own.state_dir, own.runtime_dir, listen)]


def search(found_places: list[Place]) -> Search:
    """Look in each place in turn; the first daemon that runs is the answer."""
    denied: list[Path] = []
    service = False
    for place in found_places:
        service = service or (place.service and _exists(place.state_dir))
        lock = place.state_dir / locks.LEADER_LOCK
        try:
            pid = locks.holder(lock)
        except PermissionError:
            denied.append(lock)
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ENOENT):
                continue
            raise
        if pid is not None:
            running = _running(place, pid)
            return Search(found_places, running, denied, service)
    return Search(found_places, None, denied, service)


def find(cfg: Config, environ: Mapping[str, str] | None = None) -> Search:
    """Search the places of `cfg` (see `places`)."""
    return search(places(cfg, environ))


def _running(place: Place, pid: int) -> Running:
    """The daemon `pid` that holds the lock of `place`, with what it published if the file
    is its own (a file left by an earlier daemon, or of a reused pid, is ignored)."""
    for path in published.places(place.state_dir, place.runtime_dir):
        try:
            said = published.read(path)
        except (OSError, ValueError):
            continue
        if said.pid == pid and _same(Path(said.state_dir), place.state_dir):
            return Running(pid, said.listen, place.state_dir, Path(said.runtime_dir), said)
    return Running(pid, place.listen, place.state_dir, place.runtime_dir)


def read_token(token_file: Path, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The bearer token and where it came from: $TURNKEEPER_TOKEN, else `token_file`.

    Raises TokenMissing (never written: the daemon never started there), TokenDenied
    (this user may not read it) or TokenUnusable (a link, empty, unreadable), each with
    one line naming the file and what to do. An empty token counts as none:
    `Authorization: Bearer` is never sent bare.
    """
    env = os.environ if environ is None else environ
    if env.get(TOKEN_VARIABLE, "").strip():
        return env[TOKEN_VARIABLE].strip(), f"${TOKEN_VARIABLE}"
    try:
        # O_NOFOLLOW: a link would send another file's contents to whatever listens.
        fd = os.open(token_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as stream:
            token = stream.read().decode(errors="replace").strip()
    except FileNotFoundError:
        raise TokenMissing(
            f"no admin token at {token_file}; the daemon writes it on first start "
            f"(`turnkeeper run` with this configuration), or set ${TOKEN_VARIABLE}"
        ) from None
    except PermissionError:
        raise TokenDenied(
            f"permission denied reading {token_file}: run as the service user or set "
            f"${TOKEN_VARIABLE}"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TokenUnusable(
                f"the admin token {token_file} is a symbolic link; remove it and restart the "
                f"daemon (it writes a new one), or set ${TOKEN_VARIABLE}"
            ) from None
        raise TokenUnusable(
            f"cannot read the admin token {token_file}: {exc.strerror or exc}"
        ) from None
    if not token:
        raise TokenUnusable(
            f"the admin token file {token_file} is empty; the daemon writes a fresh one when "
            f"it starts, or set ${TOKEN_VARIABLE}"
        )
    return token, str(token_file)


class TokenError(Exception):
    """The admin token cannot be used; the message is one line naming the file."""


class TokenMissing(TokenError):
    """No admin token was ever written there."""


class TokenDenied(TokenError):
    """This user may not read the admin token."""


class TokenUnusable(TokenError):
    """The admin token file is there but cannot be used."""


def _exists(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
