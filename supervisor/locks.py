"""Exclusive locks on files: one daemon per state directory, one binder per socket path.

`flock` locks vanish with the process that held them, however it died, so a crashed
daemon never leaves a stale lock behind. A lock file is opened with `O_NOFOLLOW` and judged
by `supervisor.trust` before our pid is written into it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from supervisor import trust

LEADER_LOCK = "turnkeeper.lock"  # in the state dir: one daemon per state dir; holds its pid
CONTROL_LOCK = "control.sock.lock"  # in the runtime dir: one binder of the control socket


class LockHeld(Exception):
    """Another live process holds the lock."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"{path} is held by {holder}: another turnkeeper is running there")
        self.path = path
        self.pid = pid


def acquire(path: Path) -> int:
    """Take the lock at `path` for this process's life and write our pid into it.

    Returns the open file descriptor (keep it open: closing it releases the lock).
    Raises LockHeld, naming the holder's pid, when another process has it, and
    trust.Untrusted when the file is a symbolic link, another user's or writable by others.
    """
    fd = trust.open_file(path, trust.LOCK_FILE, trust.effective_user(), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise LockHeld(path, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(path: Path) -> int | None:
    """The pid of the live process holding the lock at `path`, or None if nobody does."""
    try:
        # No daemon holds a lock through a symbolic link: it refuses to start on one.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None
