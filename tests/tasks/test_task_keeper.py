"""The task keeper's pass in-process, on a real store: it rests until the first running
task falls due (its runner unheard for `tasks.lost_grace`; a live runner of its own, until
it would be hung), not until its next sweep, and loses a task whose time has come."""

from __future__ import annotations

import asyncio

from supervisor.contract.config import Config
from supervisor.core.vocabulary import TaskStatus
from supervisor.metrics import Metrics
from supervisor.store import Store
from supervisor.tasks.rules import hung_after
from supervisor.tasks.service import TaskKeeper
from tests.clock import FakeClock
from tests.tasks.test_tasks_store import Turn, running

GRACE, KILL_GRACE, SWEEP = 30.0, 5.0, 600.0


def keeper(store: Store) -> TaskKeeper:
    tasks = {"lost_grace": GRACE, "kill_grace": KILL_GRACE, "reconcile_interval": SWEEP}
    return TaskKeeper(
        Config.model_validate({"tasks": tasks}),
        store,
        lambda *signal: None,
        Metrics(),
        host="host-b",
        boot_id="boot0001",
        owner="host-b/boot0001",
        state_dir=None,
        clock=FakeClock(),
    )


def unheard_for(store: Store, task_id: str, seconds: float) -> None:
    mark = "?" if store.backend == "sqlite" else "%s"
    store.db.execute_sql(
        f"UPDATE task SET heartbeat_at = heartbeat_at - {seconds} WHERE id = {mark}", (task_id,)
    )


def test_a_pass_rests_until_the_first_running_task_falls_due(store: Store) -> None:
    turn = Turn(store)
    theirs, ours = running(store, turn), running(store, turn)
    unheard_for(store, theirs, 10.0)  # lost in 20 s
    keeping = keeper(store)
    keeping.runners[ours] = 1  # a live runner of this daemon's: it fences itself
    waits = asyncio.run(keeping.reconcile())
    assert GRACE - 10.0 - 1.0 < waits <= GRACE - 10.0

    unheard_for(store, theirs, 20.0)  # its time has come: lost by this pass
    waits = asyncio.run(keeping.reconcile())
    row = store.tasks.get(theirs)
    assert row is not None and row.status == "lost"
    due = hung_after(GRACE, KILL_GRACE)  # then only ours runs: looked at once it is hung
    assert due - 1.0 < waits <= due

    store.tasks.record(ours, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=1.0, output_tail="")
    assert asyncio.run(keeping.reconcile()) == SWEEP  # nothing runs: the sweep
