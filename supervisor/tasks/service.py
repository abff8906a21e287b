"""The task keeper: starts admitted background tasks, reports their outcomes once, and
moves on a task whose runner went away.

The rules are `supervisor.tasks.rules`'s. A pass runs at boot, when a turn admitted a task
(`task_started`), when a runner of ours exits, when a cancel is asked, when the first
running task falls due (its runner unheard for `tasks.lost_grace`, by the database clock:
`rules.look_at`, `supervisor.core.timers`), and at the latest every
`tasks.reconcile_interval`; each row gets `rules.decide`'s action:

- START: claim the pending row (compare and set: one daemon wins) and start its runner
  (`supervisor.tasks.runner`), a child of this process in a session of its own, recorded in
  the child registry so that a later boot's sweep kills it if this daemon dies first;
- REPORT: the outcome a runner recorded goes to the session as `task_result`, once,
  which wakes it;
- LOST / RETRY: a runner not heard from for `tasks.lost_grace` (a restart killed it, its
  host went away): `lost` with a `notice`, or, for a kind with `retry_on_restart`, started
  again once, the session told.

A task of a kind no longer configured fails at its start, saying so. Each decision is
logged under subsystem `tasks` and counted in `turnkeeper_task_reconcile_total{action}`;
output files older than `tasks.keep` are removed by the pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import psutil

from supervisor.contract import fdlimit
from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.paths import inside, task_work_dir
from supervisor.contract.reaper import own_tasks
from supervisor.contract.task_kinds import TaskKind
from supervisor.core import timers
from supervisor.core.vocabulary import EventType, TaskAction, TaskStatus
from supervisor.metrics import Metrics
from supervisor.runtime.bus import Bus, Published
from supervisor.runtime.loops import Wake, reconcile
from supervisor.runtime.service import Service, Steps
from supervisor.store import Store, TaskInfo, TaskReported
from supervisor.tasks import rules
from supervisor.tasks.runner import RunnerSpec, heartbeat_of, launch
from supervisor.tasks.spec import output_path

BATCH = 500  # rows of each kind looked at in one pass; the next pass takes the rest
SETTLE = 5.0  # seconds a stop waits at most for starts in flight
DRAIN_POLL = 0.1  # seconds between two looks at the runners still running, in a drain
PRUNE_EVERY = 3600.0  # seconds between sweeps of old output files


class TaskKeeper(Service):
    """Starts, reports and reconciles the background tasks (see the module docstring)."""

    name = "tasks"
    needs = ("store",)
    after = ("pool",)  # the pool's stop ends the runners this one started
    takes = ("tasks",)

    def __init__(
        self,
        config: Config,
        store: Store,
        committed: Callable[[str, int, str, bool], None],
        metrics: Metrics,
        *,
        host: str,
        boot_id: str,
        owner: str,
        state_dir: Path | None,
        bus: Bus | None = None,
        runners: dict[str, int] | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.config = config
        self.store = store
        self.committed = committed  # the bus's: signals an event (and wakes for input)
        self.metrics = metrics
        self.host = host
        self.boot_id = boot_id
        self.owner = owner  # "<host>/<boot8>"
        self.directory = (state_dir / "tasks") if state_dir is not None else None
        # Where the commands run: outside the state directory (`checks.work_dir_verdicts`).
        self.work_dir = (
            task_work_dir(config.tasks.work_dir, state_dir) if state_dir is not None else None
        )
        self.clock = clock
        self.wake = Wake()
        # Task id -> its runner's pid, while it runs; the pool's orphan reaper skips them.
        self.runners: dict[str, int] = runners if runners is not None else {}
        self._watched: dict[int, tuple[str, int]] = {}  # pidfd -> (task id, runner pid)
        self._starting: set[asyncio.Task[None]] = set()
        self._processes: dict[int, subprocess.Popen[bytes]] = {}  # runner pid -> process
        self._pruned_at: float | None = None  # None: not yet in this boot (the first pass does)
        self.holding = False  # the daemon drains: no task starts (the next boot starts them)
        self.log = log("tasks")
        if bus is not None:
            bus.subscribe(Published, self._published)

    # --- signals from the rest of the daemon ---------------------------------------

    def stir(self) -> None:
        """Look again now: a task was admitted, a runner exited, a cancel was asked."""
        self.wake.wake()

    def admitted(self, session_id: str, payload: dict[str, Any]) -> None:
        """The pool's event hook: a `task_started` means a pending task to start."""
        if payload.get("type") == EventType.TASK_STARTED:
            self.stir()

    def _published(self, event: Published) -> None:
        self.admitted(event.session, event.event)

    def cancel(self, task_id: str) -> None:
        """A cancel was committed (`DELETE /v1/tasks/{id}`): tell its runner at once if it
        is ours (SIGUSR1: it reads the row); a pending one is reported by the next pass."""
        pid = self.runners.get(task_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        self.stir()

    # --- the loop -------------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """A pass at once, then on every stir, when a running task falls due, and at the
        latest every `tasks.reconcile_interval`."""
        return {"tasks": self._loop()}

    async def _loop(self) -> None:
        try:
            await reconcile(
                "tasks",
                self.reconcile,
                interval=lambda: self.config.tasks.reconcile_interval,
                wake=self.wake,
                clock=self.clock,
                observer=self.metrics,
            )
        finally:
            self._unwatch_all()

    async def start(self) -> None:
        """Adopt the runners a restart in place left running: still this very process's
        children (the same pid, re-executed), watched and reaped as if this boot had
        started them; their outcomes are reported as any other's."""
        rows = await asyncio.to_thread(self.store.tasks.running_on, self.host)
        left = [(r.runner_pid, r.runner_started or 0.0) for r in rows if r.runner_pid]
        mine = own_tasks(left)
        for row in rows:
            if row.runner_pid in mine and row.id not in self.runners:
                self.runners[row.id] = row.runner_pid
                self._watch(row.id, row.runner_pid)
                self.log.bind(session=row.session).info(
                    "task {} ({}) adopted: its runner (pid {}) ran on through the restart",
                    row.id,
                    row.kind,
                    row.runner_pid,
                )

    async def drain(self, deadline: float) -> None:
        """The drain: no task starts from now on (the next boot starts the pending ones at
        once); it ends once every runner of ours has ended (the root caps it)."""
        self.holding = True
        if self.runners:
            self.log.info("draining: {} tasks running may finish", len(self.runners))
        while self.runners or self._starting:
            await self.clock.sleep(DRAIN_POLL)

    async def stop(self, steps: Steps) -> None:
        await self.settle()  # a runner being started is ended with the others

    async def reconcile(self) -> float:
        """One pass over the tasks to act on (see the module docstring); the seconds until
        the next is due."""
        grace = self.config.tasks.lost_grace
        judged = await asyncio.to_thread(self.store.tasks.now)
        rows = await asyncio.to_thread(self.store.tasks.to_reconcile, grace, BATCH, judged)
        for row in rows:
            try:  # one bad row must not hold up the others
                heard_ago = None if row.heartbeat_at is None else judged - row.heartbeat_at
                kind = self.config.tasks.kind(row.kind)
                action = rules.decide(
                    row.status,
                    reported=row.reported,
                    heard_ago=heard_ago,
                    lost_grace=grace,
                    retry_on_restart=kind is not None and kind.retry_on_restart,
                    attempt=row.attempt,
                    cancel_requested=row.cancel_requested,
                )
                if action in (TaskAction.LOST, TaskAction.RETRY) and self._ours(row, heard_ago):
                    continue  # its runner is alive and fences itself (see `_ours`)
                if action in (TaskAction.START, TaskAction.RETRY) and self.holding:
                    continue  # a drain: started by the next boot, at once
                if action is not None:
                    await self._carry_out(action, row)
            except Exception as exc:
                self.log.bind(session=row.session).error("task {}: {}", row.id, exc)
        await self._prune()
        return await self._rest(judged)

    async def _rest(self, judged: float) -> float:
        """Seconds until the first running task falls due from `judged` on (the clock this
        pass judged by), at most `tasks.reconcile_interval` (`supervisor.core.timers`)."""
        tasks = self.config.tasks
        heard = await asyncio.to_thread(self.store.tasks.heard)
        now = await asyncio.to_thread(self.store.tasks.now) if heard else judged
        due = [
            rules.look_at(
                heard_at,
                ours=task_id in self.runners,
                lost_grace=tasks.lost_grace,
                kill_grace=tasks.kill_grace,
            )
            for task_id, heard_at in heard
        ]
        return timers.rest(due, judged=judged, now=now, longest=tasks.reconcile_interval)

    def _ours(self, row: TaskInfo, heard_ago: float | None) -> bool:
        """Whether a task not heard from is run by a live runner of ours. Such a runner
        stops its command by itself once it could not renew the heartbeat for most of
        `tasks.lost_grace` (the database is away); one that did not within a margin is
        hung: it is killed, and the task judged as any other."""
        pid = self.runners.get(row.id)
        if pid is None:
            return False
        tasks = self.config.tasks
        if heard_ago is None or heard_ago < rules.hung_after(tasks.lost_grace, tasks.kill_grace):
            return True
        self.log.bind(session=row.session).error(
            "task {}: its runner (pid {}) was not heard from for {:.0f} s: killed",
            row.id,
            pid,
            heard_ago,
        )
        _kill_runner(pid)
        self.runners.pop(row.id, None)
        return False

    async def _carry_out(self, action: TaskAction, row: TaskInfo) -> None:
        if action is TaskAction.START:
            # The start is a unit a stop lets finish (`settle`): a claim committed with no
            # runner started would be reported lost though it never ran.
            starting = spawn(self._start(row), name=f"task-start-{row.id}")
            self._starting.add(starting)
            starting.add_done_callback(self._starting.discard)
            await asyncio.shield(starting)
        elif action is TaskAction.REPORT:
            reported = await asyncio.to_thread(self.store.tasks.report, row.id)
            if reported is not None:
                self._told(reported, action, f"outcome {row.status}")
        else:
            retry = action is TaskAction.RETRY
            grace = self.config.tasks.lost_grace
            reported = await asyncio.to_thread(
                self.store.tasks.lose, row.id, row.attempt, grace, retry
            )
            if reported is None:
                return
            if reported.notice_seq is not None:
                self.committed(reported.session, reported.notice_seq, EventType.NOTICE, False)
            if retry:
                self._count(action)
                self.log.bind(session=row.session).warning(
                    "task {} ({}) lost its runner: started again (attempt {})",
                    row.id,
                    row.kind,
                    row.attempt + 1,
                )
                self.stir()
            else:
                self._told(reported, action, "its runner went away with no outcome")

    # --- START ----------------------------------------------------------------------

    async def _start(self, row: TaskInfo) -> None:
        tasks = self.config.tasks
        claimed = await asyncio.to_thread(
            self.store.tasks.claim,
            row.id,
            self.host,
            self.owner,
            tasks.max_running_total,
            tasks.max_running_per_principal,
        )
        if claimed is None:
            return  # another daemon took it, it was cancelled, or it waits for a free slot
        kind = self.config.tasks.kind(claimed.kind)
        if kind is None or self.directory is None:
            why = (
                f"task kind {claimed.kind!r} is not configured any more (tasks.kinds)"
                if kind is None
                else "this daemon has no state directory for task output"
            )
            await self._fail(claimed, why)
            return
        try:
            spec = self._spec(claimed, kind)
        except Exception as exc:  # e.g. an argument the kind's command no longer has
            await self._fail(claimed, f"its command cannot be made: {exc}")
            return
        try:
            process = await asyncio.to_thread(launch, spec)
        except OSError as exc:
            await self._fail(claimed, f"its runner could not start: {exc}")
            return
        pid = process.pid
        self.runners[claimed.id] = pid
        self._processes[pid] = process  # reaped when it exits (`_exited`)
        self._watch(claimed.id, pid)
        await asyncio.to_thread(self._note_runner, claimed, pid)
        self._count(TaskAction.START)
        self.log.bind(session=claimed.session).info(
            "task {} ({}) started: runner pid {}, attempt {}",
            claimed.id,
            claimed.kind,
            pid,
            claimed.attempt,
        )

    def _spec(self, task: TaskInfo, kind: TaskKind) -> RunnerSpec:
        assert self.directory is not None and self.work_dir is not None
        # The kind may have changed since the task was admitted.
        rules.check_args(kind.rules(), task.args)
        cwd = kind.cwd or str(self.work_dir / task.id)
        return RunnerSpec(
            task=task.id,
            attempt=task.attempt,
            argv=rules.render(kind.command, task.args, kind.end_of_options),
            env=task_environment(kind.env, self.directory.parent, cwd),
            cwd=cwd,
            timeout=kind.timeout,
            kill_grace=self.config.tasks.kill_grace,
            max_output=self.config.tasks.max_output,
            output=str(output_path(self.directory.parent, task.id)),
            store_url=self.store.url,
            heartbeat=heartbeat_of(self.config.tasks.lost_grace),
            boot=self.boot_id,
            host=self.host,
            create_cwd=not kind.cwd,
            lost_grace=self.config.tasks.lost_grace,
            nofile_soft=fdlimit.for_children() or 0,
        )

    def _note_runner(self, task: TaskInfo, pid: int) -> None:
        """The runner's pid in the task's row, for the API (the runner records itself in
        the child registry, and forgets itself there when it ends)."""
        with contextlib.suppress(psutil.Error):
            started = psutil.Process(pid).create_time()
            self.store.tasks.set_runner(task.id, task.attempt, pid, started)

    async def settle(self, timeout: float = SETTLE) -> None:
        """Wait (a while) for the starts in flight: a stop ends their runners with the
        other descendants, and their claims are not left without a runner."""
        if self._starting:
            await asyncio.wait(set(self._starting), timeout=timeout)

    async def _fail(self, task: TaskInfo, why: str) -> None:
        self.log.bind(session=task.session).error("task {} ({}): {}", task.id, task.kind, why)
        await asyncio.to_thread(
            self.store.tasks.record,
            task.id,
            task.attempt,
            TaskStatus.FAILED,
            exit_code=None,
            duration=0.0,
            output_tail="",
            reason=why,
        )
        self.stir()

    # --- runner exits ---------------------------------------------------------------

    def _watch(self, task_id: str, pid: int) -> None:
        """Stir when the runner exits (its pidfd turns readable); its exit status is the
        pool's orphan reaper's: the outcome is in the database, not in the status."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already (reaped): look now
            self._forget(task_id, pid)
            self.stir()
            return
        self._watched[fd] = (task_id, pid)
        asyncio.get_running_loop().add_reader(fd, self._exited, fd)

    def _exited(self, fd: int) -> None:
        watched = self._watched.pop(fd, None)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        if watched is not None:
            self._forget(*watched)
        self.stir()

    def _forget(self, task_id: str, pid: int) -> None:
        if self.runners.get(task_id) == pid:  # not a later runner of the same task
            del self.runners[task_id]
        process = self._processes.pop(pid, None)
        if process is not None:
            process.poll()  # reaped here: the pool's orphan reaper leaves runners to us
        else:  # adopted after a restart in place: ours to reap all the same
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def _unwatch_all(self) -> None:
        for fd in list(self._watched):
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watched.clear()

    # --- telling --------------------------------------------------------------------

    def _told(self, reported: TaskReported, action: TaskAction, why: str) -> None:
        """An outcome was committed to its session: wake it, log, count."""
        if reported.seq:
            self.committed(reported.session, reported.seq, EventType.TASK_RESULT, True)
        if reported.notice_seq is not None:
            self.committed(reported.session, reported.notice_seq, EventType.NOTICE, False)
        self._count(action)
        level = "INFO" if reported.status == TaskStatus.SUCCEEDED else "WARNING"
        self.log.bind(session=reported.session).log(
            level,
            "task {} {} ({}): {}",
            reported.task,
            reported.status,
            why,
            "reported" if reported.seq else "its session is closed: not reported",
        )

    def _count(self, action: TaskAction) -> None:
        self.metrics.task_reconcile.labels(action.value).inc()

    async def _prune(self) -> None:
        """Remove output files and task directories older than `tasks.keep`: at the first
        pass of a boot, then at most once an hour."""
        if self.directory is None:
            return
        if self._pruned_at is not None and self.clock.monotonic() - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = self.clock.monotonic()
        live = await asyncio.to_thread(self.store.tasks.live_ids)
        removed = 0
        for directory in (self.directory, self.work_dir):
            if directory is not None:
                keep = self.config.tasks.keep
                removed += await asyncio.to_thread(_prune, directory, keep, live)
        if removed:
            self.log.info("removed {} task output files older than tasks.keep", removed)


def task_environment(extra: Mapping[str, str], state_dir: Path, cwd: str) -> dict[str, str]:
    """A command's environment: an MCP server's (`child_environment`: a few variables of
    the daemon's, none of its secrets) and the kind's `env`. A HOME inside the state
    directory (the service user's home often is) becomes the task's own directory."""
    env = child_environment(extra)
    if "HOME" not in extra and "HOME" in env and inside(Path(env["HOME"]), state_dir):
        env["HOME"] = cwd
    return env


def _kill_runner(pid: int) -> None:
    """SIGKILL a hung runner and its command: the command leads a group of its own."""
    groups = {pid}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(child.pid))
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def _prune(directory: Path, keep: float, live: set[str]) -> int:
    """Remove what tasks left in `directory` (output files, working directories, runner
    logs) that was last changed more than `keep` seconds ago, but none of a `live` task."""
    cutoff = SYSTEM.time() - keep
    removed = 0
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            with contextlib.suppress(OSError):
                if path.name.split(".", 1)[0] in live or path.lstat().st_mtime >= cutoff:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
                removed += 1
    return removed
