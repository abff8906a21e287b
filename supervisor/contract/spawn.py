"""The spawn spec: what the supervisor hands a new worker process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, passed to the spawned process (plain data).

    It travels in the spawn arguments (a pipe to the child), never in the environment or
    on the command line, where other processes could read the route and the secret.
    """

    identity: str  # w<slot>.<generation>, for logs and status
    owner: str  # the lease owner it writes as
    address: str  # the supervisor's ROUTER
    parent_pid: int
    boot_id: str  # MCP children are recorded under it, for the next boot's sweep
    host_id: str  # ... and under its daemon's host id: only that host sweeps them
    db_url: str
    config: dict[str, Any]
    route: str = field(repr=False)  # the DEALER's routing identity, fresh and random
    secret: str = field(repr=False)  # fresh and random; the worker's hello proves it
    # The soft RLIMIT_NOFILE the daemon started with, for the worker's MCP servers (0: the
    # worker's own, inherited; `supervisor.contract.fdlimit`).
    nofile_soft: int = 0
