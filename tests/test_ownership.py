"""`Ownership` carrying out the engine's plans, with no process and no socket.

A real store (SQLite in a temporary directory) and a real `Recoverer`; the workers are
handles over stand-in processes, and what the pool would send is recorded (in the manner
of supervisord's `DummyOptions`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from supervisor.contract.config import Config
from supervisor.core.engine import Budget
from supervisor.core.slots import Slot
from supervisor.http.metrics import Metrics
from supervisor.pool.ownership import Ownership, WorkerHandle
from supervisor.pool.recoverer import Recoverer
from supervisor.store import Store
from supervisor.store.models import Session

BOOT = "b" * 32


@dataclass
class StandIn:
    """What the pool reads of a `multiprocess.Process`."""

    pid: int
    exitcode: int | None = None


class Sent(list[tuple[str, str, dict[str, Any]]]):
    def __call__(self, worker: WorkerHandle, type: str, **fields: Any) -> bool:
        self.append((worker.identity, type, fields))
        return worker.alive


@pytest.fixture
def store(tmp_path: Any) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}") as s:
        yield s


def handle(index: int, *, spare: bool = False) -> WorkerHandle:
    return WorkerHandle(
        Slot(index),
        f"w{index}.1",
        StandIn(1000 + index),
        spare=spare,
        started=0.0,
        ready=True,
        last_heartbeat=time.monotonic(),
    )


def ownership(store: Store, *workers: WorkerHandle, budget: Budget | None = None) -> Any:
    recoverer = Recoverer(Config(), store, BOOT, "host", Metrics())
    sent = Sent()
    pool = Ownership(
        Config(),
        store,
        recoverer,
        {w.identity: w for w in workers},
        sent,
        time.monotonic,
        budget,
    )
    return pool, sent


def session(store: Store, **row: Any) -> str:
    session_id = store.sessions.create("alice").id
    Session.update(**row).where(Session.id == session_id).execute()
    return session_id


def test_new_input_is_leased_to_the_least_loaded_worker_and_assigned(store: Store) -> None:
    busy, idle = handle(0), handle(1)
    busy.sessions.add("other")
    pool, sent = ownership(store, busy, idle)
    sid = session(store, pending=True)
    asyncio.run(pool.dispatch())
    [(to, type, fields)] = sent
    assert (to, type, fields["reason"], fields["cause"]) == ("w1.1", "assign", "new", None)
    row = store.sessions.get(sid)
    assert row.owner == f"host/{BOOT[:8]}/w1.1" and row.lease_token == fields["token"]
    assert pool.assigned[sid] is idle and sid in idle.sessions


def test_a_dead_workers_turn_is_charged_and_adopted_by_the_spare(store: Store) -> None:
    dead, other, spare = handle(0), handle(1), handle(2, spare=True)
    pool, sent = ownership(store, dead, other, spare)
    sid = session(
        store,
        active_turn_id="t1",
        owner=f"host/{BOOT[:8]}/w0.1",
        lease_token=1,
        lease_expires_at=store.now() + 30,
        attempt_turn_id="t1",
        attempt_count=1,
    )
    dead.sessions.add(sid)
    pool.assigned[sid] = dead
    dead.exited = True
    del pool.workers[dead.identity]
    pool.orphaned(dead)
    assert pool.wanted.is_set() and sid not in pool.assigned
    asyncio.run(pool.dispatch())
    [(to, type, fields)] = sent
    assert (to, type, fields["reason"], fields["cause"]) == (
        "w2.1",
        "assign",
        "adopt",
        "worker_crash",
    )
    assert store.sessions.get(sid).attempt_count == 2  # charged before the lease


def test_user_input_is_assigned_first_while_a_backlog_waits(store: Store) -> None:
    pool, sent = ownership(store, handle(0), budget=Budget(assign=5, judge=3))
    old = [
        session(store, active_turn_id=f"t{i}", owner=f"host/{BOOT[:8]}/w9.1", lease_token=1)
        for i in range(30)
    ]
    new = session(store, pending=True)
    asyncio.run(pool.dispatch())
    assert (sent[0][1], sent[0][2]["session"], sent[0][2]["reason"]) == ("assign", new, "new")
    assert len(sent) == 1 + 3  # the judgement budget: the rest waits for the next passes
    assert {f["session"] for _, _, f in sent[1:]} <= set(old)


def test_nothing_is_charged_when_no_worker_is_ready(store: Store) -> None:
    starting = handle(0)
    starting.ready = False
    pool, sent = ownership(store, starting)
    sid = session(store, active_turn_id="t1", owner=f"host/{BOOT[:8]}/w9.1", lease_token=1)
    asyncio.run(pool.dispatch())
    assert sent == [] and store.sessions.get(sid).attempt_count == 0
