"""Exclusive locks on files: one daemon per state directory, one binder per socket path.

`flock` locks vanish with the process that held them, however it died, so a crashed
daemon never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LEADER_LOCK = "turnkeeper.lock"  # in the state dir: one daemon per state dir; holds its pid


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
    Raises LockHeld, naming the holder's pid, when another process has it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
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
