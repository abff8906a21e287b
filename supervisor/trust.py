"""Is a file or directory safe to trust? The rules the daemon applies at start and
`turnkeeper doctor` reports, in one place so the two agree.

A path is trusted when

- its owner is the user turnkeeper runs as, or root (who could change anything anyway);
- neither its group nor others can write it;
- where a file is expected, it is a regular file: not a symbolic link (judged by `lstat`,
  and opened with `O_NOFOLLOW`), so nobody who once could write a directory can point the
  daemon at another file;
- a secret (the admin token, the tokens file) is readable by its owner only; a root-owned
  one may be group-readable (`root:turnkeeper 0640`, the way /etc shares a secret with a
  service; PostgreSQL applies the same rule to its key file).

A directory may be a symbolic link (a state directory moved to a bigger disk) and readable
by others: only writability counts, since whoever can write a directory can replace any
file in it. Once the directories pass, nobody else can create or swap a file in them, so
the checks of the files inside cannot be raced.

Every problem is one line naming the path and the fix. The daemon refuses to start on one
(exit 78); `doctor` reports it as FAIL.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Kind(Enum):
    """What the daemon expects at a path."""

    DIRECTORY = "directory"  # the state and runtime directories
    FILE = "file"  # lock files, the database and its -wal and -shm
    SECRET = "secret"  # the admin token, the tokens file


@dataclass(frozen=True)
class Expect:
    """A path the daemon trusts: what to call it, what it must be, whether it is rewritten."""

    what: str
    kind: Kind
    recreated: bool = False  # turnkeeper writes it anew when it is removed


STATE_DIR = Expect("state directory", Kind.DIRECTORY)
RUNTIME_DIR = Expect("runtime directory", Kind.DIRECTORY)
DATABASE_DIR = Expect("database directory", Kind.DIRECTORY)
ADMIN_TOKEN = Expect("admin token", Kind.SECRET, recreated=True)
TOKENS_FILE = Expect("tokens file", Kind.SECRET)
LOCK_FILE = Expect("lock file", Kind.FILE, recreated=True)
DATABASE = Expect("database file", Kind.FILE)


@dataclass(frozen=True)
class Problem:
    """Why a path cannot be trusted, and how to fix it."""

    expect: Expect
    path: Path
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.expect.what} {self.path} {self.reason}: {self.fix}"


class Untrusted(Exception):
    """A path the daemon would trust is not safe; the message is one line with the fix."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def judge(st: os.stat_result, path: Path, expect: Expect, user: int) -> Problem | None:
    """The problem with `path`, whose (l)stat is `st`, for a daemon running as uid `user`."""
    mode = stat.S_IMODE(st.st_mode)

    def problem(reason: str, fix: str) -> Problem:
        return Problem(expect, path, reason, fix)

    if stat.S_ISLNK(st.st_mode):
        return problem("is a symbolic link", _link_fix(path, expect))
    if expect.kind is Kind.DIRECTORY and not stat.S_ISDIR(st.st_mode):
        return problem("is not a directory", f"move it away (mv {path} {path}.old)")
    if expect.kind is not Kind.DIRECTORY and not stat.S_ISREG(st.st_mode):
        return problem("is not a regular file", f"move it away (mv {path} {path}.old)")
    if st.st_uid not in (user, 0):
        return problem(
            f"is owned by {user_name(st.st_uid)}, not by {user_name(user)}, "
            "the user turnkeeper runs as",
            f"chown {_login(user)} {path}",
        )
    group_may_read = expect.kind is Kind.SECRET and st.st_uid == 0 and user != 0
    private = "640" if group_may_read else "600"
    if mode & 0o022:
        if expect.kind is not Kind.DIRECTORY:
            fix = f"chmod {private} {path}"
        elif mode & stat.S_ISVTX:  # /tmp and the like: shared by design, never chmod it
            fix = f"give turnkeeper a directory of its own instead of the shared {path}"
        else:
            fix = f"chmod 700 {path}"
        return problem(f"is writable by group or others ({mode:04o})", fix)
    if expect.kind is Kind.SECRET and mode & (0o037 if group_may_read else 0o077):
        return problem(f"is readable by group or others ({mode:04o})", f"chmod {private} {path}")
    return None


def check(path: Path, expect: Expect, user: int) -> Problem | None:
    """The problem with `path`, or None if it is missing or can be trusted.

    A directory is judged by what a symbolic link names; a file by the path itself.
    """
    try:
        st = os.stat(path) if expect.kind is Kind.DIRECTORY else os.lstat(path)
    except FileNotFoundError:
        return None
    return judge(st, path, expect, user)


def require(path: Path, expect: Expect, user: int) -> None:
    """Raise Untrusted if `path` exists and cannot be trusted."""
    problem = check(path, expect, user)
    if problem is not None:
        raise Untrusted(problem)


def open_file(path: Path, expect: Expect, user: int, flags: int) -> int:
    """`os.open` with `O_NOFOLLOW`, judging the file actually opened (`fstat`).

    New files are created 0600. Raises Untrusted for a symbolic link or a file that
    cannot be trusted (closing it), and FileNotFoundError and other OSErrors as `os.open`.
    """
    extra = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang us
    try:
        fd = os.open(path, flags | extra, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            link = Problem(expect, path, "is a symbolic link", _link_fix(path, expect))
            raise Untrusted(link) from None
        raise
    problem = judge(os.fstat(fd), path, expect, user)
    if problem is not None:
        os.close(fd)
        raise Untrusted(problem)
    return fd


def database_files(db_path: Path) -> list[Path]:
    """An SQLite database and the write-ahead log and shared-memory files beside it."""
    return [
        db_path,
        db_path.with_name(db_path.name + "-wal"),
        db_path.with_name(db_path.name + "-shm"),
    ]


def effective_user() -> int:
    """The uid the checks are made for: this process's."""
    return os.geteuid()


def _link_fix(path: Path, expect: Expect) -> str:
    if expect.recreated:
        return f"rm {path} (turnkeeper writes a new one)"
    return f"replace the link with the file it points to ({os.path.realpath(path)})"


def _login(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def user_name(uid: int) -> str:
    """`turnkeeper (uid 999)`, or `uid 999` for a uid without an account."""
    login = _login(uid)
    return f"uid {uid}" if login == str(uid) else f"{login} (uid {uid})"
