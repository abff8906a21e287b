"""File descriptors: what the daemon holds back for itself, what is left for HTTP
connections, and how often running out of them is told.

Rules (docs/architecture.md, "File descriptors"):
- The daemon runs with its soft RLIMIT_NOFILE raised to the hard one. Of that, `reserve`
  descriptors are held back for what the daemon opens besides HTTP connections: its own
  files and sockets, its workers' pipes and control-plane connections (twice the pool:
  a rolling reload starts the replacements before it retires the old), the database
  connections of its threads, the running tasks' pidfds, the deliveries' connections, and
  a margin for what is not counted.
- `http.max_connections` is served as configured when it fits under the limit less the
  reserve; otherwise the connections are capped there (never under `MIN_CONNECTIONS`,
  or the admin could be locked out), and the start says so once.
- Running out at `accept` anyway (a limit lowered under a running daemon, another process
  holding the host's table) is told on the first time, then at most once a `every`
  seconds, with how many times it happened since the line before (`Tally`).

Pure: the limit, the configuration's figures and the time are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

BASE = 64  # the daemon's own: stdio, the event loop, locks, logs, listeners, control plane
PER_WORKER = 4  # a worker's sentinel, its spawn pipe, its control-plane connection, one more
PER_CONNECTION = 3  # a database connection: SQLite's file, -wal and -shm (a server's: 1)
MARGIN = 64  # what is not counted: a reload's agent probe, a runner starting, a DNS lookup
MIN_CONNECTIONS = 8  # a cap under this would lock the admin out; the limit is then too low
LOG_EVERY = 60.0  # seconds between two lines about running out at accept


@dataclass(frozen=True)
class Needs:
    """What the daemon opens besides HTTP connections, from its configuration."""

    workers: int  # pool.workers + pool.spare
    db_connections: int  # the supervisor's threads that each keep a database connection
    tasks: int  # tasks.max_running_total: a pidfd each while it runs
    deliveries: int  # delivery.concurrency times the number of targets

    def reserve(self) -> int:
        """Descriptors held back from HTTP connections."""
        pool = 2 * self.workers * PER_WORKER  # the old pool and its replacements, in a reload
        database = (self.db_connections + 2) * PER_CONNECTION  # the loop's and the listener's
        return BASE + pool + database + self.tasks + self.deliveries + MARGIN


@dataclass(frozen=True)
class Cap:
    """The connections the daemon serves at most, and why."""

    configured: int  # http.max_connections
    effective: int
    soft_limit: int
    reserve: int

    @property
    def clamped(self) -> bool:
        """Whether fewer connections are served than configured."""
        return self.effective < self.configured

    @property
    def starved(self) -> bool:
        """Whether even the floor does not fit: the limit is too low for the daemon."""
        return self.soft_limit - self.reserve < MIN_CONNECTIONS

    def explain(self) -> str:
        """One line for the log: the configured and effective values, and why."""
        left = self.soft_limit - self.reserve
        why = (
            f"the file descriptor limit is {self.soft_limit} and {self.reserve} are held back "
            f"for the pool, the database, tasks, deliveries and the daemon's own files"
        )
        if self.starved:
            return (
                f"http.max_connections {self.configured}: serving at most {self.effective}, "
                f"and even that may not fit: {why}, which leaves {max(left, 0)}; raise the "
                f"limit (LimitNOFILE= in the unit, ulimit -n)"
            )
        return (
            f"http.max_connections {self.configured} does not fit: {why}, which leaves "
            f"{left}; serving at most {self.effective} connections (raise the limit: "
            f"LimitNOFILE= in the unit, ulimit -n; or lower http.max_connections)"
        )


def cap(configured: int, soft_limit: int, reserve: int) -> Cap:
    """The connections to serve at most under `soft_limit` with `reserve` held back."""
    room = max(soft_limit - reserve, MIN_CONNECTIONS)
    return Cap(configured, min(configured, room), soft_limit, reserve)


def needed(max_connections: int, reserve: int) -> int:
    """The limit under which `max_connections` is served as configured."""
    return max_connections + reserve


class Tally:
    """Counts a recurring trouble and says when to tell it: the first time at once, then
    at most once every `every` seconds, each line with the count since the line before.

    `note(now)` returns that count when a line is due, else None (the time is kept only
    by the caller's clock; a count not told yet waits for the next occurrence)."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self.every = every
        self._told_at: float | None = None
        self.pending = 0  # occurrences since the last line

    def note(self, now: float) -> int | None:
        """One more occurrence at `now`; the count to tell, if a line is due."""
        self.pending += 1
        if self._told_at is not None and now - self._told_at < self.every:
            return None
        count, self.pending, self._told_at = self.pending, 0, now
        return count
