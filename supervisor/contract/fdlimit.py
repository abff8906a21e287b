"""The process's file descriptor limit (RLIMIT_NOFILE): raised for the daemon, given back
to the programs it runs.

systemd's advice (and its own practice since v240, which sets a soft limit of 1024 under
a hard one of 524288) is that a program that needs many descriptors raises its own soft
limit to the hard one at start, and gives every program it executes the original soft
limit back: a program that uses select() breaks on a descriptor number above 1024.

Who gets which:
- the daemon: the hard limit (HTTP connections, its workers, database connections);
- a worker: the daemon's raised limit, inherited. It is turnkeeper's own code (epoll
  through asyncio, poll() through ZeroMQ, never select()), and holds three pipes per MCP
  server besides its database connection;
- an MCP server and a task's command: the original soft limit. They are any program an
  operator configures; the worker starts MCP servers with `give_back` in their
  `preexec_fn`, and a task's runner gives the limit back to itself at its start (it needs
  a few descriptors), so its command inherits it;
- the daemon re-executed for a restart in place: the original, so the new start raises
  it again from the same point and says so.

The original travels to a worker and a task runner in their spawn specs (`remember`).
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from pathlib import Path

from supervisor.contract.config import Config
from supervisor.contract.limits import DB_THREADS
from supervisor.core.descriptors import Needs

NR_OPEN = Path("/proc/sys/fs/nr_open")  # the kernel's ceiling for a hard limit of infinity

_original: int | None = None  # the soft limit this process started with, once raised


@dataclass(frozen=True)
class Raised:
    """The soft limit before and after `raise_soft_limit`, and the hard limit."""

    before: int
    soft: int
    hard: int
    error: str = ""  # why the soft limit could not be raised, if it could not

    def describe(self) -> str:
        """One line for the start's log."""
        if self.error:
            return (
                f"file descriptors: soft limit {self.before} (hard {self.hard}) left as it "
                f"was: {self.error}"
            )
        if self.soft > self.before:
            return (
                f"file descriptors: soft limit raised from {self.before} to {self.soft} "
                f"(hard {self.hard})"
            )
        return f"file descriptors: soft limit {self.soft} (hard {self.hard}), nothing to raise"


def _finite(limit: int) -> int:
    """A hard limit as a number of descriptors: infinity is the kernel's nr_open."""
    if limit != resource.RLIM_INFINITY:
        return limit
    try:
        return int(NR_OPEN.read_text())
    except (OSError, ValueError):
        return 1 << 20  # Linux's default nr_open


def current() -> tuple[int, int]:
    """The soft and hard limits of this process now (infinity as a number)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _finite(soft), _finite(hard)


def needs(config: Config) -> Needs:
    """What the daemon opens besides HTTP connections under `config` (see
    `supervisor.core.descriptors`)."""
    return Needs(
        workers=config.pool.workers + config.pool.spare,
        db_connections=DB_THREADS,
        tasks=config.tasks.max_running_total,
        deliveries=config.delivery.concurrency * len(config.delivery.targets),
    )


def raise_soft_limit() -> Raised:
    """Raise this process's soft limit to its hard limit, remembering the original for the
    programs it runs (`for_children`). Never raises: a refusal is in the result."""
    global _original
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _original is None:
        _original = soft
    target = _finite(hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return Raised(_finite(soft), _finite(soft), target)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return Raised(_finite(soft), _finite(soft), target, str(exc))
    return Raised(_finite(soft), target, target)


def for_children() -> int | None:
    """The soft limit the programs this process runs should get back; None: as it is."""
    return _original


def remember(original: int | None) -> None:
    """Take `original` as this process's original soft limit (a worker's or a task
    runner's, from its spec: the daemon raised the limit it inherited)."""
    global _original
    _original = original


def give_back() -> None:
    """Lower this process's soft limit to the original, if one is known and lower.

    Safe as a `preexec_fn` (between fork and exec: two system calls, no allocation worth
    a lock), and in a process of few descriptors. Failures are ignored: a child with the
    higher limit still runs.
    """
    original = _original
    if original is None or original == resource.RLIM_INFINITY:
        return
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft > original:
            resource.setrlimit(resource.RLIMIT_NOFILE, (original, hard))
