"""The task runner: one run of a background task's command, watched to its end, its
outcome committed to the database by the runner itself.

Started by `launch` (`supervisor.tasks.spec` says how and why), the spec on stdin:
- it checks its row (a heartbeat): not this attempt's run any more -> exits; a cancel
  asked -> `cancelled`, nothing started;
- it starts the command (no shell) in a process group of its own, stdin /dev/null, its
  output into the output file, with `child_environment` plus the kind's `env` only, and
  records it in the child registry (kind `task`) until its group is gone; a command that
  cannot start is `failed`, with the reason;
- it renews the heartbeat on a thread of its own (a slow database holds up neither the
  output, nor the timeout, nor a signal), every `heartbeat` seconds and at once on SIGUSR1.

To stop is SIGTERM (and SIGCONT) to the command's group and to every descendant that
left it, `kill_grace` seconds, SIGKILL. The first of these settles the outcome:

  event                                  it                   outcome recorded
  -------------------------------------  -------------------  ------------------------------
  the command exits by itself            stops what it left   succeeded or failed (exit code)
  the command runs past `timeout`        stops the group      timed_out
  the row asks for a cancel              stops the group      cancelled
  SIGTERM or SIGINT (teardown, a sweep)  stops the group      none: reconcile: lost or retry
  the row is no longer this attempt's    stops the group      none: the row moved on
  SIGTERM or SIGINT while stopping       SIGKILLs at once     unchanged

A subreaper, it gets back a grandchild that left the group (setsid) and lost its parent.
Recording is retried for a few seconds, then given up (the reconcile pass marks the task
lost). Signal handlers only enqueue (the wakeup fd). Its log is its stderr. Exit status 0,
or 1 for a bad spec or a database it could not use.
"""

from __future__ import annotations

import contextlib
import enum
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from supervisor.contract import fdlimit, reaper
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.paths import make_private_dir
from supervisor.core.backoff import Backoff
from supervisor.core.vocabulary import TaskStatus
from supervisor.store import Store
from supervisor.tasks import rules
from supervisor.tasks.pulse import (
    STOPPING,
    Pulse,
    catch_signals,
    logger,
    retrying,
    take_signals,
)
from supervisor.tasks.spec import Output, RunnerSpec, fence_of, heartbeat_of, launch

__all__ = ["Runner", "RunnerSpec", "heartbeat_of", "launch", "main"]

IDLE = 1.0  # seconds between two looks while the command runs (SIGCHLD wakes it sooner)
POLL = 0.05  # while stopping: members of the group that die send us no SIGCHLD
DRAIN = 1.0  # seconds the pipe is still read once every process is gone
REAP_BUDGET = 2.0  # seconds after SIGKILL before survivors are given up on
# Seconds between tries to open the database, to record: 0.5, 1, 2, 4.
BACKOFF = Backoff(initial=0.5, factor=2.0, cap=4.0).delays(4)


class Stop(enum.Enum):
    """Why the command's group is being stopped."""

    TIMEOUT = "its time limit passed"  # outcome timed_out
    CANCEL = "a cancel was asked"  # outcome cancelled
    SIGNAL = "the runner was told to stop"  # no outcome
    GONE = "its row is no longer this run's"  # no outcome
    LEFTOVERS = "it exited and left processes behind"  # the outcome is its exit's


class Runner:
    """One run of one task: the table in the module docstring."""

    def __init__(self, spec: RunnerSpec, store: Store, signals: int, clock: Clock = SYSTEM) -> None:
        self.spec, self.store, self.signals, self.clock = spec, store, signals, clock
        self.say = logger(spec.task)
        self.pulse = Pulse(store, spec, self.say, clock)
        self.fence = fence_of(spec.lost_grace, spec.heartbeat) if spec.lost_grace > 0 else None
        self.told_to_stop = False  # SIGTERM or SIGINT came, whenever
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop: Stop | None = None
        self.gone = False  # the row is not this run's any more
        self.exit_code: int | None = None
        self.pgid, self.started, self.ended, self.deadline = 0, 0.0, 0.0, 0.0
        self.kill_at: float | None = None  # SIGKILL then, ...
        self.give_up_at: float | None = None  # ... and no wait for survivors past this
        self.drain_until: float | None = None

    def run(self) -> int:
        """Run the command to its end; the runner's exit status."""
        me = self._record_self()
        try:
            return self._run()
        finally:
            if me is not None:
                retrying(lambda: self.store.children.forget([me]), (), self.say, "forgetting")

    def _record_self(self) -> int | None:
        """The runner in the child registry, before it starts anything: a daemon that
        dies now leaves it to the next boot's sweep (its command is recorded too)."""
        me = reaper.ProcessId.of(os.getpid())
        if me is None:
            return None
        try:
            row: int = self.store.children.record(
                self.spec.boot,
                me.pid,
                me.create_time,
                "task",
                pgid=os.getpgid(0),
                name=f"runner {self.spec.task}",
                host=self.spec.host,
            )
        except Exception as exc:  # whatever the driver raises: the run goes on
            self.say(f"the runner could not be recorded in the child registry: {exc}")
            return None
        return row

    def _first_heartbeat(self) -> bool | None:
        """The row checked before anything starts: None (do not start) if it is not this
        run's, or if no heartbeat went through before the fence (any daemon may judge the
        task lost by now); else whether a cancel was asked."""
        while True:
            before = self.clock.monotonic()
            try:
                verdict = self.store.tasks.heartbeat(self.spec.task, self.spec.attempt)
            except Exception as exc:
                if (
                    self.fence is not None
                    and self.clock.monotonic() - self.pulse.last_ok > self.fence
                ):
                    self.say(f"no heartbeat went through ({exc}): the command is not started")
                    return None
                self.say(f"the first heartbeat failed (again in {self.spec.heartbeat:g} s): {exc}")
                self.clock.sleep_blocking(self.spec.heartbeat)
                continue
            self.pulse.last_ok = before
            return verdict

    def _run(self) -> int:
        try:
            reaper.become_subreaper()
        except OSError as exc:  # then a daemonized grandchild may escape the stop
            self.say(f"cannot become a subreaper: {exc}")
        first = self._first_heartbeat()
        if first is None or any(sig in STOPPING for sig in take_signals(self.signals)):
            self.say("its row moved on, or it was told to stop: the command is not started")
            return 0
        if first:
            return self._record(TaskStatus.CANCELLED, None, None, "", "cancelled before it started")
        try:  # the file of a command that cannot start is left empty, closed at the exit
            output = Output(Path(self.spec.output), self.spec.max_output, self.say)
            proc = self._start()
        except OSError as exc:
            why = exc.strerror or str(exc)
            why += f": {exc.filename}" if exc.filename else ""
            return self._record(TaskStatus.FAILED, None, None, "", f"it could not start ({why})")
        self.say(f"started the command, pid {proc.pid}")
        self.pulse.start(proc.pid)
        try:
            self._watch(proc, output)
        finally:
            output.close()
            row = self.pulse.close()
            if row is not None:
                retrying(lambda: self.store.children.forget([row]), (), self.say, "forgetting")
        self.told_to_stop |= any(sig in STOPPING for sig in take_signals(self.signals))
        # Told to stop, and the command died of a signal: the stop killed it (the daemon's
        # teardown signals the whole tree at once), whatever the loop saw first.
        stopped = (
            self.told_to_stop
            and (self.exit_code or 0) < 0
            and self.stop not in (Stop.TIMEOUT, Stop.CANCEL)  # those settled it before
        )
        if self.gone or self.stop is Stop.SIGNAL or stopped:
            cause = Stop.GONE if self.gone else Stop.SIGNAL
            self.say(f"the command is stopped, no outcome recorded: {cause.value}")
            return 0
        stop = self.stop
        status = rules.outcome_of(self.exit_code, stop is Stop.TIMEOUT, stop is Stop.CANCEL)
        reasons = [f"Its time limit is {self.spec.timeout:g} s"] if stop is Stop.TIMEOUT else []
        if output.dropped:
            reasons.append(f"{output.dropped} bytes of its output were left out of its file")
        duration = self.ended - self.started
        return self._record(status, self.exit_code, duration, output.tail(), ". ".join(reasons))

    def _start(self) -> subprocess.Popen[bytes]:
        if self.spec.create_cwd:
            make_private_dir(Path(self.spec.cwd))
        proc = subprocess.Popen(
            list(self.spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=self.spec.cwd or None,
            env=child_environment(self.spec.env),
            process_group=0,
        )
        self.pgid, self.started, self.proc = proc.pid, self.clock.monotonic(), proc
        self.deadline = self.started + self.spec.timeout
        return proc

    def _record(
        self, status: TaskStatus, code: int | None, duration: float | None, tail: str, reason: str
    ) -> int:
        def record() -> bool:
            return self.store.tasks.record(
                self.spec.task,
                self.spec.attempt,
                status,
                exit_code=code,
                duration=duration,
                output_tail=tail,
                reason=reason,
            )

        recorded = retrying(
            record, BACKOFF, self.say, f"recording the outcome {status}", self.clock
        )
        if recorded is None:
            return 1
        done = "recorded" if recorded else "not recorded: the row is no longer this run's"
        self.say(f"outcome {status} (exit status {code}) {done}")
        return 0

    def _watch(self, proc: subprocess.Popen[bytes], output: Output) -> None:
        assert proc.stdout is not None
        pipe = proc.stdout.fileno()
        with selectors.DefaultSelector() as selector, proc.stdout:
            selector.register(pipe, selectors.EVENT_READ, "output")
            selector.register(self.signals, selectors.EVENT_READ, "signals")
            selector.register(self.pulse.fd, selectors.EVENT_READ, "pulse")
            reading = True
            while not self._finished(reading):
                for key, _ in selector.select(self._wait()):
                    if key.data == "output":
                        data = os.read(pipe, 65536)
                        output.write(data)
                        if not data:
                            selector.unregister(pipe)
                            reading = False
                    elif key.data == "signals":
                        for sig in take_signals(self.signals):
                            self._on_signal(sig)
                    else:
                        self._on_verdicts()
                reaper.reap_orphans(keep=(proc.pid,))
                self._poll()
                self._advance()

    def _on_signal(self, sig: int) -> None:
        if sig in STOPPING:
            self.told_to_stop = True
            self._poll()  # a command that exited by itself first keeps its outcome
            self._begin_stop(Stop.SIGNAL)
        elif sig == signal.SIGUSR1:
            self.pulse.check_now()  # SIGCHLD only wakes the loop, which reaps

    def _on_verdicts(self) -> None:
        for verdict in take_signals(self.pulse.fd):
            self.gone = self.gone or verdict == Pulse.GONE
            self._begin_stop(Stop.GONE if verdict == Pulse.GONE else Stop.CANCEL)

    def _poll(self) -> None:
        if self.exit_code is None and self.proc is not None and self.proc.poll() is not None:
            self.exit_code, self.ended = self.proc.returncode, self.clock.monotonic()

    def _advance(self) -> None:
        now = self.clock.monotonic()
        fenced = self.fence is not None and now - self.pulse.last_ok > self.fence
        if fenced and self.stop is None and self.exit_code is None:
            self.say(f"no heartbeat went through for {self.fence:g} s: SIGKILL, no outcome")
            self.gone = True  # any daemon may judge the task lost soon: it must not run on
            self._begin_stop(Stop.GONE)
            self.kill_at = now  # nothing is recorded: no grace to wait for
        if self.exit_code is None and self.stop is None and now >= self.deadline:
            self._begin_stop(Stop.TIMEOUT)
        if self.exit_code is not None and self.stop is None and self._alive():
            self._begin_stop(Stop.LEFTOVERS)
        if self.kill_at is not None and self.give_up_at is None and now >= self.kill_at:
            self.say("SIGKILL to what is left of the command's group")
            self._signal_all(signal.SIGKILL)
            self.give_up_at = now + REAP_BUDGET

    def _begin_stop(self, reason: Stop) -> None:
        now = self.clock.monotonic()
        if self.stop is not None:
            if reason is Stop.SIGNAL and self.kill_at is not None:
                self.kill_at = min(self.kill_at, now)  # told to stop while stopping: no grace
            return
        if self.exit_code is not None:
            reason = Stop.LEFTOVERS  # it exited by itself: that settled its outcome
        self.stop, self.kill_at = reason, now + self.spec.kill_grace
        self.say(f"stopping the command's group: {reason.value}")
        self._signal_all(signal.SIGTERM)
        self._signal_all(signal.SIGCONT)  # a stopped process acts on SIGTERM once continued

    def _finished(self, reading: bool) -> bool:
        if self.exit_code is None:
            return False
        now = self.clock.monotonic()
        if self._alive():
            if self.give_up_at is None or now < self.give_up_at:
                return False
            self.say("processes of the command survived SIGKILL; giving up on them")
            return True
        if not reading:
            return True
        self.drain_until = self.drain_until or now + DRAIN  # an fd we cannot see holds the pipe
        return now >= self.drain_until

    def _wait(self) -> float:
        if self.exit_code is None and self.stop is None:
            return max(0.0, min(self.deadline - self.clock.monotonic(), IDLE))
        return POLL

    def _alive(self) -> bool:
        """Whether a process of the command's group, or a descendant of ours, is left."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return bool(reaper.own_children())
        except PermissionError:
            return True

    def _signal_all(self, sig: int) -> None:
        """`sig` to the command's group and to each descendant that left it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    if os.getpgid(proc.pid) != self.pgid:
                        proc.send_signal(sig)


def main() -> int:
    """Read the spec on stdin, run it; the exit status."""
    signals = catch_signals()  # first: a SIGUSR1 or SIGTERM must not kill the runner
    try:
        spec = RunnerSpec.from_json(sys.stdin.buffer.read())
    except ValueError as exc:
        print(f"task_runner: {exc}", file=sys.stderr)
        return 1
    say = logger(spec.task)
    # The command gets the soft limit the daemon started with, not the one it raised.
    fdlimit.remember(spec.nofile_soft or None)
    fdlimit.give_back()
    store = retrying(lambda: Store(spec.store_url, migrate=False), BACKOFF, say, "opening")
    if store is None:
        say("the database cannot be opened: the command is not started")
        return 1
    try:
        return Runner(spec, store, signals).run()
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
