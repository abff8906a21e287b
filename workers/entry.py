"""The worker process's entry point, light enough for the supervisor to import.

The supervisor names `run_worker` as the spawn target and builds a `WorkerSpec`
(`supervisor.contract.spawn`); the worker's own modules (models, MCP, agents) are imported
only in the worker process.
"""

from __future__ import annotations

from supervisor.contract.spawn import WorkerSpec


def run_worker(spec: WorkerSpec) -> None:
    """The spawn target: run the worker in this (new) process, named for `ps` and `top`."""
    from setproctitle import setproctitle

    from supervisor.contract.titles import worker_title

    setproctitle(worker_title(spec.identity, spec.parent_pid))
    from workers.main import main

    main(spec)
