"""The task registry on SQLite, PostgreSQL and MariaDB: a start written whole or not at
all and fenced by the turn's lease, the limit, one daemon per start, a runner's writes
guarded by its attempt, one report per outcome even when two daemons report at once, lost
and retried rows, and cancels."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from supervisor.core.vocabulary import TaskStatus
from supervisor.store import LeaseLost, Started, Store
from supervisor.tasks.rules import TaskRefused
from tests.conftest import BACKENDS
from tests.support import stored_events as events

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

ARGS = {"seconds": "5"}


class Turn:
    """A session's turn in flight on a lease, as a worker holds it."""

    def __init__(self, store: Store, session_id: str | None = None) -> None:
        self.store = store
        self.session_id = session_id or store.sessions.create("alice").id
        lease = store.leases.acquire(self.session_id, f"host-a/boot-1/w{uuid.uuid4().hex[:6]}", 30)
        assert lease is not None
        self.token, self.id = lease.token, uuid.uuid4().hex
        store.events.append(
            self.session_id, "turn_started", {}, token=self.token, turn_id=self.id, writer="worker"
        )

    def start(self, call_id: str | None = None, **options: Any) -> Started:
        return self.store.tasks.start(
            self.session_id,
            options.pop("kind", "sleep"),
            options.pop("args", ARGS),
            token=self.token,
            turn_id=self.id,
            max_running=options.pop("max_running", 8),
            call_id=call_id,
        )


def running(store: Store, turn: Turn) -> str:
    """A task of the turn, claimed by a daemon: its id."""
    task = turn.start().task
    assert store.tasks.claim(task.id, "host-a", "host-a/boot0001") is not None
    return task.id


def test_a_start_writes_the_event_and_the_row_together(store: Store) -> None:
    turn = Turn(store)
    started = turn.start("call-1")
    task = started.task
    assert started.new and (task.status, task.attempt, task.args) == ("pending", 1, ARGS)
    [event] = events(store, turn.session_id, "task_started")
    assert (event.seq, event.turn_id) == (started.seq, turn.id) == (task.started_seq, turn.id)
    assert event.payload == {"task": task.id, "kind": "sleep", "args": ARGS, "call_id": "call-1"}
    # The same tool call of the same turn, made again, gets the same task.
    again = turn.start("call-1")
    assert (again.new, again.task.id, again.seq) == (False, task.id, started.seq)
    assert len(events(store, turn.session_id, "task_started")) == 1
    # A hostile call id (NUL, overlong) is kept hashed, and still dedupes.
    odd = "x\x00" + "y" * 500
    first, second = turn.start(odd), turn.start(odd)
    assert first.new and not second.new and first.task.id == second.task.id
    assert first.task.call_id is not None and first.task.call_id.startswith("sha256:")


def test_a_start_with_a_lost_lease_writes_nothing(store: Store) -> None:
    turn = Turn(store)
    store.leases.acquire(turn.session_id, "host-b/boot-2/w1", 30, force=True)
    with pytest.raises(LeaseLost):
        turn.start()
    assert store.tasks.of_session(turn.session_id) == []
    assert events(store, turn.session_id, "task_started") == []


def test_the_limit_and_a_closed_session_refuse_with_a_reason(store: Store) -> None:
    turn = Turn(store)
    turn.start(max_running=2)
    turn.start(max_running=2)
    with pytest.raises(TaskRefused, match=r"at most 2 at once \(tasks.max_running\)"):
        turn.start(max_running=2)
    assert len(store.tasks.of_session(turn.session_id)) == 2
    # An outcome frees a place.
    first = store.tasks.of_session(turn.session_id)[0]
    store.tasks.cancel(first.id)
    turn.start(max_running=2)


def test_one_daemon_claims_a_pending_task(store: Store) -> None:
    task = Turn(store).start().task
    won: list[str] = []
    start = threading.Barrier(4)

    def claim(owner: str) -> None:  # each thread has its own connection
        start.wait()
        if store.tasks.claim(task.id, owner.split("/")[0], owner) is not None:
            won.append(owner)
        done.append(owner)

    done: list[str] = []
    threads = [threading.Thread(target=claim, args=(f"host-{i}/boot",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(done) == 4, "a claim failed"
    assert len(won) == 1
    row = store.tasks.get(task.id)
    assert row is not None and row.status == "running" and row.host == won[0].split("/")[0]
    assert row.heartbeat_at is not None and row.started_at is not None


def test_a_runners_writes_count_only_for_its_own_attempt(store: Store) -> None:
    turn = Turn(store)
    task_id = running(store, turn)
    assert store.tasks.set_runner(task_id, 1, 4242, 123.5)
    assert store.tasks.heartbeat(task_id, 1) is False
    assert store.tasks.heartbeat(task_id, 2) is None  # not its attempt
    assert not store.tasks.record(
        task_id, 2, TaskStatus.SUCCEEDED, exit_code=0, duration=1.0, output_tail=""
    )
    assert store.tasks.record(
        task_id, 1, TaskStatus.FAILED, exit_code=2, duration=1.5, output_tail="e" * 5000
    )
    row = store.tasks.get(task_id)
    assert row is not None and (row.status, row.exit_code, row.runner_pid) == ("failed", 2, 4242)
    assert len(row.output_tail) == 2000 and row.result_seq is None
    assert store.tasks.heartbeat(task_id, 1) is None  # over: its runner stops
    assert not store.tasks.record(  # a second outcome is refused
        task_id, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=1.0, output_tail=""
    )


def test_an_outcome_is_reported_once_even_by_two_daemons_at_once(store: Store) -> None:
    turn = Turn(store)
    task_id = running(store, turn)
    store.tasks.record(
        task_id, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=0.5, output_tail="ok"
    )
    seqs: list[int] = []
    finished: list[bool] = []
    start = threading.Barrier(4)

    def report() -> None:  # each thread has its own connection
        start.wait()
        done = store.tasks.report(task_id)
        if done is not None:
            seqs.append(done.seq)
        finished.append(True)

    threads = [threading.Thread(target=report) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(finished) == 4, "a report failed"
    [result] = events(store, turn.session_id, "task_result")
    assert seqs == [result.seq]
    assert result.payload["status"] == "succeeded" and "ok" in result.payload["text"]
    assert result.payload["output"] == f"/v1/tasks/{task_id}/output"
    row = store.tasks.get(task_id)
    assert row is not None and row.result_seq == result.seq and row.reported
    assert store.sessions.get(turn.session_id).pending  # a result is input: it wakes
    assert store.tasks.report(task_id) is None


def test_a_runner_not_heard_from_is_lost_once_or_retried_once(store: Store) -> None:
    turn = Turn(store)
    task_id = running(store, turn)
    assert store.tasks.lose(task_id, 1, 60.0, retry=True) is None  # heard from just now
    retried = store.tasks.lose(task_id, 1, 0.0, retry=True)
    assert retried is not None and (retried.status, retried.seq) == ("pending", 0)
    row = store.tasks.get(task_id)
    assert row is not None and (row.status, row.attempt, row.host) == ("pending", 2, None)
    assert events(store, turn.session_id, "task_result") == []
    [notice] = events(store, turn.session_id, "notice")
    assert notice.seq == retried.notice_seq and "started again" in notice.payload["text"]
    assert store.tasks.claim(task_id, "host-a", "host-a/boot0002") is not None
    # A daemon that judged the first attempt from an older read changes nothing now.
    assert store.tasks.lose(task_id, 1, 0.0, retry=True) is None
    assert store.tasks.get(task_id).attempt == 2  # type: ignore[union-attr]
    lost = store.tasks.lose(task_id, 2, 0.0, retry=False)
    assert lost is not None and lost.status == "lost"
    [result] = events(store, turn.session_id, "task_result")
    assert (result.seq, result.payload["status"]) == (lost.seq, "lost")
    notices = events(store, turn.session_id, "notice")
    assert notices[-1].seq == lost.notice_seq and "was lost" in notices[-1].payload["text"]
    assert store.tasks.lose(task_id, 2, 0.0, retry=False) is None


def test_a_pass_sees_every_kind_of_row_however_many_tasks_run(store: Store) -> None:
    turn = Turn(store)
    busy = [running(store, turn) for _ in range(3)]  # heard from: nothing to do
    stale = running(store, turn)
    done = running(store, turn)
    waiting = turn.start(max_running=100).task.id
    store.tasks.record(done, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=0.1, output_tail="")
    store.db.execute_sql(
        "UPDATE task SET heartbeat_at = heartbeat_at - 100 WHERE id = %s"
        if store.backend != "sqlite"
        else "UPDATE task SET heartbeat_at = heartbeat_at - 100 WHERE id = ?",
        (stale,),
    )
    # Each kind has a limit of its own: running tasks crowd out neither the others...
    seen = [row.id for row in store.tasks.to_reconcile(lost_grace=60.0, limit=1)]
    assert seen == [waiting, done, stale]
    assert not set(busy) & set(seen)
    assert store.tasks.live_ids() == {*busy, stale, waiting}


def test_when_each_runner_was_heard_and_a_pass_judged_at_a_given_time(store: Store) -> None:
    turn = Turn(store)
    task_id = running(store, turn)
    turn.start()  # pending: no runner to hear from
    [(found, heard_at)] = store.tasks.heard()
    assert found == task_id and heard_at is not None
    assert heard_at <= store.tasks.now()
    late = store.tasks.to_reconcile(60.0, now=heard_at + 60.5)
    assert [row.id for row in late if row.status == "running"] == [task_id]
    early = store.tasks.to_reconcile(60.0, now=heard_at + 59.5)
    assert [row.id for row in early if row.status == "running"] == []


def test_cancels_and_a_closed_session(store: Store) -> None:
    turn = Turn(store)
    pending = turn.start().task
    cancelled = store.tasks.cancel(pending.id)
    assert cancelled is not None and cancelled.status == "cancelled"
    report = store.tasks.report(pending.id)
    assert report is not None and report.status == "cancelled"
    task_id = running(store, turn)
    asked = store.tasks.cancel(task_id)
    assert asked is not None and (asked.status, asked.cancel_requested) == ("running", True)
    assert store.tasks.heartbeat(task_id, 1) is True
    # Its runner went before it acted: the outcome is `cancelled`, never retried.
    gone = store.tasks.lose(task_id, 1, 0.0, retry=True)
    assert gone is not None and gone.status == "cancelled" and gone.notice_seq is None
    assert store.tasks.cancel("t" + "0" * 32) is None
    # An outcome whose session was closed is settled without an event.
    other = running(store, turn)
    store.tasks.record(other, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=0.1, output_tail="")
    store.sessions.close(turn.session_id, "cli")
    settled = store.tasks.report(other)
    assert settled is not None and settled.seq == 0
    assert store.tasks.get(other).result_seq == 0  # type: ignore[union-attr]
    counts = store.tasks.counts()
    assert counts["cancelled"] == 2 and counts["succeeded"] == 1 and counts["running"] == 0


def test_a_claim_past_the_daemons_or_a_principals_share_leaves_the_task_pending(
    store: Store,
) -> None:
    alice, bob = Turn(store), Turn(store, store.sessions.create("bob").id)
    first, second = alice.start().task, alice.start().task
    other = bob.start().task

    def claim(task_id: str) -> bool:
        taken = store.tasks.claim(task_id, "host-a", "host-a/boot0001", 2, 1)
        return taken is not None

    assert claim(first.id)
    assert not claim(second.id)  # alice's share (1) is taken
    assert store.tasks.get(second.id).status == "pending"
    assert claim(other.id)  # bob's is not, and the daemon's (2) had room
    store.tasks.record(first.id, 1, TaskStatus.SUCCEEDED, exit_code=0, duration=1.0, output_tail="")
    assert claim(second.id)
