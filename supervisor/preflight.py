"""Before the daemon starts anything: the configuration passes `supervisor.checks` (the
plug-ins load, the MCP commands resolve, ...), the files it will trust are judged, the
locks are taken and the tokens read, and the storage that would not survive a stop or a
reboot is named. Every failure here is one line: a configuration error (exit 78) or a
start that cannot happen (exit 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from supervisor import checks, locks, trust
from supervisor.contract.config import Config, Paths, make_private_dir
from supervisor.contract.errors import PluginError, StartupError
from supervisor.core import mounts
from supervisor.http.auth import (
    ADMIN,
    Tokens,
    TokensFileError,
    digest,
    ensure_admin_token,
    read_tokens_file,
)
from supervisor.store import sqlite_path

MOUNT_TABLE = Path("/proc/self/mountinfo")


def check_plugins(config: Config) -> None:
    """Fail before anything starts on the first of `supervisor.checks`' verdicts that is
    not ok: the agent classes (loaded in a child process), the model, each MCP server's
    command and working directory, the tokens file. `turnkeeper doctor` shows them all.
    """
    with contextlib.closing(checks.verdicts(config)) as verdicts:  # closing: ends its child
        for verdict in verdicts:
            if not verdict.ok:
                raise PluginError(verdict.detail)


def take_files(config: Config, paths: Paths) -> Tokens:
    """Judge and take the daemon's files; the tokens it will accept.

    Raises PluginError (a configuration error) or StartupError (another daemon holds the
    lock).
    """
    try:
        _take_files(paths)
        return _tokens(config, paths)
    except locks.LockHeld as exc:
        raise StartupError(str(exc)) from exc
    except trust.Untrusted as exc:
        raise PluginError(str(exc)) from exc


def read_tokens(config: Config, paths: Paths) -> Tokens:
    """The tokens the API accepts, judged and read as at a start (a reload reads them
    again); raises PluginError."""
    try:
        return _tokens(config, paths)
    except trust.Untrusted as exc:
        raise PluginError(str(exc)) from exc


def _take_files(paths: Paths) -> None:
    """Make or judge the directories, take the locks, judge the database files.

    Nothing is trusted before `supervisor.trust` has judged it, and a directory that
    exists already is never changed. Raises trust.Untrusted and locks.LockHeld.
    """
    user = trust.effective_user()
    for directory, expect in (
        (paths.state_dir, trust.STATE_DIR),
        (paths.runtime_dir, trust.RUNTIME_DIR),
    ):
        make_private_dir(directory)
        trust.require(directory, expect, user)
    locks.acquire(paths.state_dir / locks.LEADER_LOCK)
    locks.acquire(paths.runtime_dir / locks.CONTROL_LOCK)
    database = sqlite_path(paths.db_url)
    if database is not None:
        if database.parent != paths.state_dir:
            trust.require(database.parent, trust.DATABASE_DIR, user)
        for path in trust.database_files(database):
            trust.require(path, trust.DATABASE, user)


def _tokens(config: Config, paths: Paths) -> Tokens:
    """The admin token and the tokens file's principals; raises trust.Untrusted."""
    user = trust.effective_user()
    admin = digest(ensure_admin_token(paths.admin_token_file, user))
    hashes = {ADMIN: admin}
    if config.auth.tokens_file:
        # check_plugins read it already: only the admin token's hash or an edit since fail here
        try:
            hashes |= read_tokens_file(Path(config.auth.tokens_file), user, admin)
        except TokensFileError as exc:
            raise PluginError(str(exc)) from exc
    return Tokens(hashes)


@dataclass(frozen=True)
class Volatile:
    """A file or directory of the daemon's whose contents would not survive."""

    what: str  # "state directory", "database"
    path: Path
    reason: str  # `supervisor.core.mounts.volatile`'s
    key: str  # the configuration key that moves it

    def __str__(self) -> str:
        return f"{self.what} {self.path} {self.reason}; {self.fix}"

    @property
    def fix(self) -> str:
        return f"set {self.key} to a place on disk"


def volatile_storage(
    paths: Paths, private_tmp: bool = False, mount_table: Path = MOUNT_TABLE
) -> list[Volatile]:
    """The state directory, and the SQLite database file if it lies elsewhere, when on
    memory or in a `PrivateTmp=yes` /tmp (`supervisor.core.mounts`): what the daemon
    commits there would not survive. `private_tmp`: the service is known to run with it.
    Nothing when the mount table cannot be read (not Linux)."""
    try:
        table = mounts.parse_mountinfo(mount_table.read_text())
    except OSError:
        return []
    state_dir = paths.state_dir.resolve()
    candidates = [("state directory", paths.state_dir, "daemon.state_dir")]
    database = sqlite_path(paths.db_url)
    if database is not None and not database.resolve().is_relative_to(state_dir):
        candidates.append(("database", database, "store.url"))
    found = []
    for what, path, key in candidates:
        reason = mounts.volatile(PurePosixPath(path.resolve()), table, private_tmp)
        if reason:
            found.append(Volatile(what, path, reason, key))
    return found
