"""What a task runner does besides watching its command: the row's heartbeat on a thread
of its own (`Pulse`), retries of database work, its log lines, and signal handlers that
only enqueue (Python's wakeup fd), so that the runner's loop (`supervisor.tasks.runner`)
reads signals, heartbeat verdicts and output from one selector.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from supervisor.contract import reaper
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.store import Store
from supervisor.tasks.spec import RunnerSpec

STOPPING = (signal.SIGTERM, signal.SIGINT)
CAUGHT = (*STOPPING, signal.SIGUSR1, signal.SIGCHLD)

Say = Callable[[str], None]
T = TypeVar("T")


def logger(task: str) -> Say:
    """Lines to stderr (the runner's log file), each naming the task."""

    def say(message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(SYSTEM.time()))
        print(f"{stamp} task_runner[{os.getpid()}] task {task}: {message}", file=sys.stderr)

    return say


def retrying(
    work: Callable[[], T],
    backoff: tuple[float, ...],
    say: Say,
    what: str,
    clock: Clock = SYSTEM,
) -> T | None:
    """`work()`, tried again after each delay of `backoff` while it raises; None if the
    last try raised too (whatever the database driver raises: each is logged)."""
    for delay in (*backoff, None):
        try:
            return work()
        except Exception as exc:
            then = "giving up" if delay is None else f"again in {delay:g} s"
            say(f"{what} failed ({then}): {exc}")
            if delay is not None:
                clock.sleep_blocking(delay)
    return None


class Pulse:
    """The row's heartbeat, on a thread of its own; it first records the command in the
    child registry. What the loop must act on arrives as a byte on `fd`: GONE (the row is
    not this run's any more) or CANCEL (a cancel was asked)."""

    GONE, CANCEL = ord("g"), ord("c")

    def __init__(self, store: Store, spec: RunnerSpec, say: Say, clock: Clock) -> None:
        self.fd, self._wake = os.pipe()
        self._clock = clock
        os.set_blocking(self.fd, False)
        self.child_row: int | None = None
        self._store, self._spec, self._say = store, spec, say
        self._asked, self._closing = threading.Event(), False
        self.last_ok = clock.monotonic()  # the last heartbeat that went through
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        identity = reaper.ProcessId.of(pid)
        args = (pid, None if identity is None else identity.create_time)
        self._thread = threading.Thread(target=self._run, args=args, name="pulse", daemon=True)
        self._thread.start()

    def check_now(self) -> None:
        """Renew the heartbeat (and so read the cancel flag) at once."""
        self._asked.set()

    def close(self) -> int | None:
        """Stop the thread; returns the command's registry row, if it was recorded."""
        self._closing = True
        self._asked.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # time to end a database call in flight
        return self.child_row

    def _run(self, pid: int, create_time: float | None) -> None:
        spec, children = self._spec, self._store.children
        try:
            if create_time is not None:
                self.child_row = children.record(
                    spec.boot,
                    pid,
                    create_time,
                    "task",
                    pgid=pid,
                    name=f"task {spec.task}",
                    host=spec.host,
                )
        except Exception as exc:  # whatever the driver raises: the run goes on
            self._say(f"the command could not be recorded in the child registry: {exc}")
        while True:
            self._asked.wait(spec.heartbeat)
            self._asked.clear()
            if self._closing:
                return
            before = self._clock.monotonic()  # the row's heartbeat_at is no older than this
            try:
                verdict = self._store.tasks.heartbeat(spec.task, spec.attempt)
            except Exception as exc:
                self._say(f"the heartbeat failed (again in {spec.heartbeat:g} s): {exc}")
                continue
            self.last_ok = before
            if verdict is None or verdict:
                os.write(self._wake, bytes([self.GONE if verdict is None else self.CANCEL]))


def take_signals(fd: int) -> bytes:
    """The bytes waiting on a non-blocking pipe (signal numbers, on the wakeup fd)."""
    found = b""
    with contextlib.suppress(BlockingIOError):
        while data := os.read(fd, 512):
            found += data
    return found


def catch_signals() -> int:
    """Handlers that only enqueue: each signal's number arrives as a byte on the returned
    fd (Python's wakeup fd), for the loop to read."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for sig in CAUGHT:
        signal.signal(sig, _enqueued)
    # `launch` starts the runner with SIGUSR1 blocked (its default would kill a runner not
    # ready for it); one sent meanwhile is pending, and arrives now, to the handler.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return read


def _enqueued(signum: int, frame: object) -> None:
    """The wakeup fd carries the signal; nothing to do here."""
