"""The task keeper: starts admitted background tasks, reports their outcomes once, and
moves on a task whose runner went away.

The rules are `supervisor.core.tasks`'s. A pass runs at boot, when a turn admitted a task
(`task_started`), when a runner of ours exits, when a cancel is asked, and every
`tasks.reconcile_interval`; each row gets `core.tasks.decide`'s action:

- START: claim the pending row (compare and set: one daemon wins) and start its runner
  (`supervisor.task_runner`), a child of this process in a session of its own, recorded in
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from supervisor.contract.clock import SYSTEM, Clock, sleep_unless
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.task_spec import output_path
from supervisor.core import tasks as rules
from supervisor.core.vocabulary import EventType, TaskAction, TaskStatus
from supervisor.http.metrics import Metrics
from supervisor.store import Store, TaskInfo, TaskReported
from supervisor.task_runner import RunnerSpec, launch

BATCH = 500  # rows looked at in one pass; the next pass takes the rest
PRUNE_EVERY = 3600.0  # seconds between sweeps of old output files


class TaskKeeper:
    """Starts, reports and reconciles the background tasks (see the module docstring)."""

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
        clock: Clock = SYSTEM,
    ) -> None:
        self.config = config
        self.store = store
        self.committed = committed  # the pool's: signals an event (and wakes for input)
        self.metrics = metrics
        self.host = host
        self.boot_id = boot_id
        self.owner = owner  # "<host>/<boot8>"
        self.directory = (state_dir / "tasks") if state_dir is not None else None
        self.clock = clock
        self.stirred = asyncio.Event()
        self.runners: dict[str, int] = {}  # task id -> its runner's pid, while it runs
        self._watched: dict[int, str] = {}  # pidfd -> task id
        self._pruned_at = 0.0
        self.log = log("tasks")

    # --- signals from the rest of the daemon ---------------------------------------

    def stir(self) -> None:
        """Look again now: a task was admitted, a runner exited, a cancel was asked."""
        self.stirred.set()

    def admitted(self, session_id: str, payload: dict[str, Any]) -> None:
        """The pool's event hook: a `task_started` means a pending task to start."""
        if payload.get("type") == EventType.TASK_STARTED:
            self.stir()

    def cancel(self, task_id: str) -> None:
        """A cancel was committed (`DELETE /v1/tasks/{id}`): tell its runner at once if it
        is ours (SIGUSR1: it reads the row); a pending one is reported by the next pass."""
        pid = self.runners.get(task_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        self.stir()

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Pass at once, then on every stir and every `tasks.reconcile_interval`."""
        try:
            while True:
                self.stirred.clear()
                try:
                    await self.reconcile()
                except Exception:
                    self.log.exception("the task pass failed; the next one tries again")
                await sleep_unless(self.clock, self.config.tasks.reconcile_interval, self.stirred)
        finally:
            self._unwatch_all()

    async def reconcile(self) -> None:
        """One pass over the live and unreported tasks (see the module docstring)."""
        rows = await asyncio.to_thread(self.store.tasks.to_reconcile, BATCH)
        now = await asyncio.to_thread(self.store.tasks.now) if rows else 0.0
        grace = self.config.tasks.lost_grace
        for row in rows:
            kind = self.config.tasks.kind(row.kind)
            action = rules.decide(
                row.status,
                reported=row.reported,
                heard_ago=None if row.heartbeat_at is None else now - row.heartbeat_at,
                lost_grace=grace,
                retry_on_restart=kind is not None and kind.retry_on_restart,
                attempt=row.attempt,
                cancel_requested=row.cancel_requested,
            )
            if action is None or (action is TaskAction.LOST and row.id in self.runners):
                continue  # a runner of ours that is alive is not lost, however slow
            try:
                await self._carry_out(action, row)
            except Exception as exc:  # one bad row must not hold up the others
                self.log.bind(session=row.session).error(
                    "task {}: {} failed: {}", row.id, action, exc
                )
        await self._prune()

    async def _carry_out(self, action: TaskAction, row: TaskInfo) -> None:
        if action is TaskAction.START:
            await self._start(row)
        elif action is TaskAction.REPORT:
            reported = await asyncio.to_thread(self.store.tasks.report, row.id)
            if reported is not None:
                self._told(reported, action, f"outcome {row.status}")
        else:
            retry = action is TaskAction.RETRY
            grace = self.config.tasks.lost_grace
            reported = await asyncio.to_thread(self.store.tasks.lose, row.id, grace, retry)
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
        claimed = await asyncio.to_thread(self.store.tasks.claim, row.id, self.host, self.owner)
        if claimed is None:
            return  # another daemon took it, or it was cancelled meanwhile
        kind = self.config.tasks.kind(claimed.kind)
        if kind is None or self.directory is None:
            why = (
                f"task kind {claimed.kind!r} is not configured any more (tasks.kinds)"
                if kind is None
                else "this daemon has no state directory for task output"
            )
            await self._fail(claimed, why)
            return
        output = output_path(self.directory.parent, claimed.id)
        spec = RunnerSpec(
            task=claimed.id,
            attempt=claimed.attempt,
            argv=rules.render(kind.command, claimed.args),
            env=child_environment(kind.env),
            cwd=kind.cwd or str(self.directory / claimed.id),
            timeout=kind.timeout,
            kill_grace=self.config.tasks.kill_grace,
            max_output=self.config.tasks.max_output,
            output=str(output),
            store_url=self.store.url,
            heartbeat=min(5.0, self.config.tasks.lost_grace / 3),
            boot=self.boot_id,
            host=self.host,
            create_cwd=not kind.cwd,
        )
        try:
            process = await asyncio.to_thread(launch, spec)
        except OSError as exc:
            await self._fail(claimed, f"its runner could not start: {exc}")
            return
        pid = process.pid
        self.runners[claimed.id] = pid
        self._watch(claimed.id, pid)
        await asyncio.to_thread(self._record_runner, claimed, pid)
        self._count(TaskAction.START)
        self.log.bind(session=claimed.session).info(
            "task {} ({}) started: runner pid {}, attempt {}",
            claimed.id,
            claimed.kind,
            pid,
            claimed.attempt,
        )

    def _record_runner(self, task: TaskInfo, pid: int) -> None:
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # it ended already: its exit is watched
        self.store.children.record(
            self.boot_id, pid, started, "task", pgid=pid, name=f"runner {task.id}", host=self.host
        )
        self.store.tasks.set_runner(task.id, task.attempt, pid, started)

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
            self.runners.pop(task_id, None)
            self.stir()
            return
        self._watched[fd] = task_id
        asyncio.get_running_loop().add_reader(fd, self._exited, fd)

    def _exited(self, fd: int) -> None:
        task_id = self._watched.pop(fd, None)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        if task_id is not None:
            self.runners.pop(task_id, None)
        self.stir()

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
        """Remove output files older than `tasks.keep`, at most once an hour."""
        if self.directory is None or time.monotonic() - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = time.monotonic()
        removed = await asyncio.to_thread(_prune, self.directory, self.config.tasks.keep)
        if removed:
            self.log.info("removed {} task output files older than tasks.keep", removed)


def _prune(directory: Path, keep: float) -> int:
    """Remove what tasks left in `directory` (output files, working directories) that was
    last changed more than `keep` seconds ago; a live task's output keeps changing."""
    cutoff = time.time() - keep
    removed = 0
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime >= cutoff:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
                removed += 1
    return removed
