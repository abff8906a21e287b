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

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config
from supervisor.core.engine import Budget
from supervisor.core.slots import Slot
from supervisor.metrics import Metrics
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.ownership import Ownership
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
    """What was sent, one entry per session of an `assign`; `messages` as sent."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, worker: WorkerHandle, type: str, **fields: Any) -> bool:
        self.messages.append((worker.identity, type, fields))
        for each in fields["sessions"] if type == "assign" else [fields]:
            self.append((worker.identity, type, each))
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
        SYSTEM,
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


def dead_worker_with(store: Store, pool: Any, dead: WorkerHandle, k: int) -> list[str]:
    """`k` sessions mid-turn on `dead`, which has just exited."""
    sids = [
        session(
            store,
            active_turn_id=f"t{i}",
            owner=f"host/{BOOT[:8]}/{dead.identity}",
            lease_token=1,
            lease_expires_at=store.now() + 30,
            attempt_turn_id=f"t{i}",
            attempt_count=1,
        )
        for i in range(k)
    ]
    for sid in sids:
        dead.sessions.add(sid)
        pool.assigned[sid] = dead
    dead.exited = True
    del pool.workers[dead.identity]
    pool.orphaned(dead)
    return sids


def count_write_transactions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every write transaction the store's sessions and leases open, by caller."""
    from supervisor.store import db, leases, sessions

    opened: list[str] = []

    def counting(database: Any, work: Any, **options: Any) -> Any:
        opened.append(getattr(work, "__qualname__", "?"))
        return db.run_write(database, work, **options)

    monkeypatch.setattr(leases, "run_write", counting)
    monkeypatch.setattr(sessions, "run_write", counting)
    return opened


def test_k_sessions_of_a_dead_worker_are_adopted_in_one_transaction_and_one_message(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = 60
    dead, other, spare = handle(0), handle(1), handle(2, spare=True)
    pool, sent = ownership(store, dead, other, spare)
    sids = dead_worker_with(store, pool, dead, k)
    opened = count_write_transactions(monkeypatch)
    asyncio.run(pool.dispatch())
    assert len(opened) == 1  # every charge and every lease in one commit
    assigns = [m for m in sent.messages if m[1] == "assign"]
    assert len(assigns) == 1 and assigns[0][0] == "w2.1"  # one message, to the spare
    assert [a["session"] for a in assigns[0][2]["sessions"]] == sids
    assert {a["reason"] for a in assigns[0][2]["sessions"]} == {"adopt"}
    for sid, a in zip(sids, assigns[0][2]["sessions"], strict=True):
        row = store.sessions.get(sid)
        assert row.attempt_count == 2  # charged
        assert row.owner == f"host/{BOOT[:8]}/w2.1" and row.lease_token == a["token"] == 2
    assert pool.recovery.attention_now() == set()  # nothing left owed


def test_a_turn_that_moved_on_is_neither_charged_nor_leased(store: Store) -> None:
    dead, spare = handle(0), handle(1, spare=True)
    pool, sent = ownership(store, dead, spare)
    sid, moved = dead_worker_with(store, pool, dead, 2)
    real_tail = pool.recovery.store.events.tail

    def tail_then_end(session_id: str, count: int) -> Any:
        # The turn ends (its worker committed `turn_ended` late) between judging and leasing.
        if session_id == moved:
            Session.update(active_turn_id=None).where(Session.id == moved).execute()
        return real_tail(session_id, count)

    pool.recovery.store.events.tail = tail_then_end
    asyncio.run(pool.dispatch())
    assert [f["session"] for _, _, f in sent] == [sid]
    row = store.sessions.get(moved)
    assert row.attempt_count == 1 and row.lease_token == 1  # untouched


def test_a_pass_reads_pending_and_owed_sessions_only_until_the_full_pass(store: Store) -> None:
    """Between full passes a backlog nobody asked about costs nothing: an interrupted
    session of an earlier boot is not read until the full pass (or a touch)."""
    pool, sent = ownership(store, handle(0))
    asyncio.run(pool.dispatch())  # the first pass is a full one
    old = session(store, active_turn_id="t1", owner="host/oldboot1/w0.1", lease_token=1)
    new = session(store, pending=True)
    read: list[list[str]] = []
    real_some = store.sessions.some
    store.sessions.some = lambda ids: read.append(sorted(ids)) or real_some(ids)  # type: ignore[method-assign]
    asyncio.run(pool.dispatch())
    assert [f["session"] for _, _, f in sent] == [new] and read == []
    pool.touch(old)  # a first touch: owed a judgement, read by id
    asyncio.run(pool.dispatch())
    assert read == [[old]]
    assert [f["session"] for _, _, f in sent][1:] == [old]
