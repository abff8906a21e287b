"""The routes of background tasks: list them, read one and its output, cancel one.

- `GET /v1/sessions/{id}/tasks` (read): the tasks the session's turns started, oldest first.
- `GET /v1/tasks?status=&limit=`: the tasks of every session the caller may read (all
  of them for the admin token), newest first; `status` a comma-separated list of them.
- `GET /v1/tasks/{id}` (read on its session): one task, with `output_url`.
- `GET /v1/tasks/{id}/output` (read on its session): its output so far, as text, from the
  file its runner writes under the state directory of the host that ran it (another
  host's daemon has it: 409 naming that host; none written yet: 404).
- `DELETE /v1/tasks/{id}` (write on its session): cancel it. A pending task is cancelled
  at once; a running one is asked to stop, and the pool signals its runner now (SIGTERM,
  grace, SIGKILL; outcome `cancelled`). An ended task is answered as it is.

A task is seen through its session's ACL: the task of a session the caller may not read
is a 404, as if it did not exist, as the session itself is.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Protocol

from aiohttp import web

from supervisor.contract.config import Config, resolve_paths
from supervisor.core.vocabulary import Permission, TaskStatus
from supervisor.http.answers import PRINCIPAL, ApiError, answer, whole
from supervisor.http.auth import ADMIN
from supervisor.http.lifecycle import Lookup
from supervisor.http.schemas import TASK_ID_PATTERN, TaskList, TaskOut
from supervisor.store import Store, TaskInfo
from supervisor.tasks.spec import output_path

TASK_ID = re.compile(TASK_ID_PATTERN)
MAX_LISTED = 1000  # tasks one answer lists (`limit`)
LISTED = 100  # ... unless told
READ_MARGIN = 65536  # bytes read past tasks.max_output: a runner's note that it cut there


def task_out(task: TaskInfo) -> TaskOut:
    """A task as the API answers it."""
    return TaskOut.model_validate({**task.as_dict(), "output_url": f"/v1/tasks/{task.id}/output"})


class Canceller(Protocol):
    """What the routes need of the task keeper (`supervisor.tasks.service.TaskKeeper`)."""

    def cancel(self, task_id: str) -> None:
        """A cancel of the task was committed: signal its runner now."""


class Routes:
    """The handlers, reading `store` for sessions that `session` lets through."""

    def __init__(
        self,
        store: Store,
        session: Lookup,
        keeper: Canceller | None,
        config: Config,
        host_id: str,
    ) -> None:
        self.store = store
        self.session = session
        self.keeper = keeper
        self.config = config  # a reload swaps it (daemon.state_dir needs a restart)
        self.state_dir = resolve_paths(config).state_dir
        self.host_id = host_id

    @property
    def max_read(self) -> int:
        """Bytes of a task's output read at most: what `tasks.max_output` keeps, and a margin."""
        return self.config.tasks.max_output + READ_MARGIN

    def add(self, router: web.UrlDispatcher) -> None:
        """Add the routes (the table in the module docstring) to `router`."""
        router.add_get("/v1/sessions/{id}/tasks", self.of_session)
        router.add_get("/v1/tasks", self.listed)
        router.add_get("/v1/tasks/{id}", self.get)
        router.add_get("/v1/tasks/{id}/output", self.output)
        router.add_delete("/v1/tasks/{id}", self.cancel)

    async def of_session(self, request: web.Request) -> web.Response:
        info = await self.session(request, Permission.READ)
        limit = whole(request.query.get("limit"), "limit", MAX_LISTED, 1, MAX_LISTED)
        tasks = await asyncio.to_thread(self.store.tasks.of_session, info.id, limit)
        return answer(TaskList(tasks=[task_out(task) for task in tasks]))

    async def listed(self, request: web.Request) -> web.Response:
        limit = whole(request.query.get("limit"), "limit", LISTED, 1, MAX_LISTED)
        statuses = [s for s in request.query.get("status", "").split(",") if s]
        known = {status.value for status in TaskStatus}
        for status in statuses:
            if status not in known:
                raise ApiError(
                    422,
                    "invalid",
                    f"status: {status[:40]!r} is not a task status ({', '.join(sorted(known))})",
                    field="status",
                )
        principal = request[PRINCIPAL]
        who = None if principal == ADMIN else principal
        tasks = await asyncio.to_thread(self.store.tasks.listed, statuses, limit, who)
        return answer(TaskList(tasks=[task_out(task) for task in tasks]))

    async def get(self, request: web.Request) -> web.Response:
        return answer(task_out(await self._task(request, Permission.READ)))

    async def output(self, request: web.Request) -> web.Response:
        task = await self._task(request, Permission.READ)
        if task.host is not None and task.host != self.host_id:
            raise ApiError(
                409,
                "elsewhere",
                f"task {task.id} ran on host {task.host!r}: its output is in that host's "
                "state directory; ask the daemon there",
            )
        path = output_path(self.state_dir, task.id)
        text = await asyncio.to_thread(_read_tail, path, self.max_read)
        if text is None:
            raise ApiError(404, "no_output", f"task {task.id} has written no output yet")
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def cancel(self, request: web.Request) -> web.Response:
        task = await self._task(request, Permission.WRITE)
        if TaskStatus(task.status).final:
            return answer(task_out(task))  # nothing to stop: as it ended
        cancelled = await asyncio.to_thread(self.store.tasks.cancel, task.id)
        if cancelled is None:
            raise self._missing(task.id)
        if self.keeper is not None:
            self.keeper.cancel(task.id)
        return answer(task_out(cancelled))

    async def _task(self, request: web.Request, need: Permission) -> TaskInfo:
        """The task the request names, if its principal holds `need` on its session."""
        task_id = request.match_info["id"]
        if not TASK_ID.match(task_id):
            raise self._missing(task_id)
        task = await asyncio.to_thread(self.store.tasks.get, task_id)
        if task is None:
            raise self._missing(task_id)
        principal = request[PRINCIPAL]
        if principal != ADMIN:
            held = await asyncio.to_thread(self.store.acl.permission, task.session, principal)
            if held is None:
                raise self._missing(task_id)
            if not Permission(held).includes(need):
                raise ApiError(
                    403, "forbidden", f"{principal} has {held} access; this needs {need}"
                )
        return task

    @staticmethod
    def _missing(task_id: str) -> ApiError:
        return ApiError(404, "not_found", f"no task {task_id!r}")


def _read_tail(path: Path, limit: int) -> str | None:
    """The file's text, its last `limit` bytes at most (a runner keeps it shorter); None if
    there is no such file. Bytes that are not UTF-8 are replaced."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - limit))
            data = file.read(limit)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return data.decode("utf-8", "replace")
