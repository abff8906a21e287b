"""Before the daemon starts anything: the configuration passes `supervisor.checks` (the
plug-ins load, the MCP commands resolve, ...), the files it will trust are judged, the
locks are taken and the tokens read, the storage that would not survive a stop or a
reboot is named, and a database server that is not there yet is waited for. Every
failure here is one line: a configuration error (exit 78) or a start that cannot happen
(exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from supervisor import checks, locks, trust
from supervisor.contract.background import first_of, spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config, Paths, make_private_dir, mask_url
from supervisor.contract.errors import PluginError, StartupError
from supervisor.contract.logs import log
from supervisor.core import mounts
from supervisor.core.backoff import Backoff
from supervisor.http.auth import (
    ADMIN,
    Tokens,
    TokensFileError,
    digest,
    ensure_admin_token,
    read_tokens_file,
)
from supervisor.notify import Notifier
from supervisor.stopping import READY_TIMEOUT
from supervisor.store import NotAnswering, probe, sqlite_path

MOUNT_TABLE = Path("/proc/self/mountinfo")
# The waits between tries of a database that is not there yet: 0.5 s doubling to 5 s.
DATABASE_BACKOFF = Backoff(initial=0.5, factor=2.0, cap=5.0)
WAIT_LOG_INTERVAL = 10.0  # seconds between the log lines of one wait for the database
# What systemd is told the rest of the start may take once the database answers: the
# workers' ready wait and a margin for the migrations.
AFTER_THE_WAIT = READY_TIMEOUT + 30.0


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


async def wait_for_database(
    url: str,
    timeout: float,
    notifier: Notifier,
    stopping: asyncio.Event,
    *,
    try_once: Callable[[str], None] = probe,
    clock: Clock = SYSTEM,
) -> bool:
    """Wait until the database server at `url` answers (`store.connect_timeout`): True
    once it does, False when `stopping` is set first (a SIGTERM: stop at once).

    A server that is not there yet (`supervisor.store.NotAnswering`: refused, timed out,
    starting up) is tried again after `DATABASE_BACKOFF`; the wait is logged once every
    `WAIT_LOG_INTERVAL`, not at each try, and each such line tells systemd what it waits
    for and extends its start timeout. Past `timeout` (0: no wait), StartupError (exit 1).
    What `try_once` raises otherwise (BadStoreURL: exit 78, StoreError) ends the start at
    once. SQLite is never waited for (`supervisor.store.probe` returns at once).
    """
    if url.startswith("sqlite:"):
        return True
    loop = asyncio.get_running_loop()
    masked = mask_url(url)
    started = clock.monotonic()
    deadline = started + timeout
    failures = 0
    said_at: float | None = None
    # A thread of its own, left behind by a stop: the default executor's threads are
    # waited for when the loop closes, and a try may hang up to its connect timeout.
    tries = ThreadPoolExecutor(1, "turnkeeper-db-wait")
    try:
        while True:
            attempt = loop.run_in_executor(tries, try_once, url)
            if attempt not in await first_of(attempt, spawn(stopping.wait())):
                return False
            try:
                attempt.result()
            except NotAnswering as exc:
                error = str(exc)
            else:
                if failures:
                    log("store").info(
                        "the database {} answered after {:.0f} s",
                        masked,
                        clock.monotonic() - started,
                    )
                return True
            failures += 1
            now = clock.monotonic()
            if now >= deadline:
                raise StartupError(
                    f"the database {masked} did not answer within store.connect_timeout "
                    f"({timeout:g} s): {error}"
                )
            if said_at is None or now - said_at >= WAIT_LOG_INTERVAL:
                said_at = now
                _say_waiting(notifier, masked, error, now - started, timeout, deadline - now)
            pause = min(DATABASE_BACKOFF.delay(failures), deadline - now)
            await first_of(spawn(stopping.wait()), spawn(clock.sleep(pause)))
            if stopping.is_set():
                return False
    finally:
        tries.shutdown(wait=False)


def _say_waiting(
    notifier: Notifier, masked: str, error: str, waited: float, timeout: float, left: float
) -> None:
    """One line of a wait for the database, in the log and to systemd."""
    log("store").warning(
        "waiting for the database {}: {} (waited {:.0f} s of store.connect_timeout {:g} s)",
        masked,
        error,
        waited,
        timeout,
    )
    notifier.waiting(
        f"waiting for the database ({masked}: {error}; {waited:.0f} s of {timeout:g} s)",
        left + AFTER_THE_WAIT,
    )
