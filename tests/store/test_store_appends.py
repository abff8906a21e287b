"""Appends from a known session row, and blocking appends committed on the caller's thread,
run alike on SQLite, PostgreSQL and MariaDB.

The event log remembers each session's `last_seq` and lease token as its last commit left
them; anything else that moves either must send the next append back to the row read
under the lock.
"""

from __future__ import annotations

import peewee
import pytest

from supervisor.store import LeaseLost, StorageUnavailable, Store
from supervisor.store.models import Event
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)


def leased(store: Store) -> tuple[str, int]:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w0.1", ttl=60)
    assert lease is not None
    return sid, lease.token


def seqs_of(store: Store, sid: str) -> list[int]:
    return [e.seq for e in store.events.read(sid, limit=1000)]


def test_appends_by_another_store_move_the_known_row(store: Store, db_url: str) -> None:
    sid, token = leased(store)
    assert store.events.append(sid, "checkpoint", {"by": "a"}, token=token) == 1
    assert store.events.append(sid, "checkpoint", {"by": "a"}, token=token) == 2
    with Store(db_url) as other:  # another process, as far as the database can tell
        assert other.events.append(sid, "checkpoint", {"by": "b"}, token=token) == 3
        assert other.events.append(sid, "checkpoint", {"by": "b"}, token=token) == 4
    assert store.events.append(sid, "checkpoint", {"by": "a"}, token=token) == 5
    assert seqs_of(store, sid) == [1, 2, 3, 4, 5]
    assert store.sessions.get(sid).last_seq == 5


def test_events_of_other_transactions_move_the_known_row(store: Store) -> None:
    sid, token = leased(store)
    assert store.events.append(sid, "checkpoint", {}, token=token) == 1
    assert store.acl.grant(sid, "bob", "read", by="alice") == 2  # its own transaction
    assert store.events.append(sid, "checkpoint", {}, token=token) == 3
    assert seqs_of(store, sid) == [1, 2, 3]


def test_a_lease_moved_since_the_known_row_fences_the_old_token(store: Store) -> None:
    sid, old = leased(store)
    assert store.events.append(sid, "model_response", {"n": 1}, token=old, turn_id="t1") == 1
    new = store.leases.acquire(sid, "w1.1", ttl=60, force=True)
    assert new is not None
    with pytest.raises(LeaseLost) as caught:
        store.events.append(sid, "model_response", {"n": 2}, token=old, turn_id="t1")
    assert (caught.value.token, caught.value.current) == (old, new.token)
    assert store.sessions.get(sid).last_seq == 1
    # Lease-less writes still append, and the new holder's after them.
    assert store.events.append(sid, "checkpoint", {}, writer="intake") == 2
    assert store.events.append(sid, "checkpoint", {}, token=new.token) == 3
    with pytest.raises(LeaseLost):
        store.events.append(sid, "checkpoint", {}, token=old)
    assert seqs_of(store, sid) == [1, 2, 3]


def test_a_refused_commit_leaves_the_row_and_the_log_as_they_were(store: Store) -> None:
    sid, token = leased(store)
    assert store.events.append(sid, "checkpoint", {}, token=token) == 1
    # A row at seq 2 that the session row does not account for: the next insert clashes.
    Event.insert(
        session_id=sid, seq=2, type="checkpoint", payload="{}", created_at=0.0, writer="worker"
    ).execute()
    with pytest.raises(StorageUnavailable):
        store.events.append(sid, "checkpoint", {"lost": True}, token=token)
    assert store.sessions.get(sid).last_seq == 1  # the bump was rolled back with the insert
    Event.delete().where((Event.session_id == sid) & (Event.seq == 2)).execute()
    assert store.events.append(sid, "checkpoint", {}, token=token) == 2
    assert [e.payload for e in store.events.read(sid)] == [{}, {}]


def test_write_events_raises_the_drivers_errors_as_peewees(store: Store) -> None:
    from supervisor.store.db import run_write
    from supervisor.store.eventlog import make_request, write_events

    sid, token = leased(store)
    Event.insert(
        session_id=sid, seq=1, type="checkpoint", payload="{}", created_at=0.0, writer="worker"
    ).execute()
    request = make_request(sid, "checkpoint", {}, token=token)
    with pytest.raises(peewee.IntegrityError):
        run_write(store.db, lambda: write_events(store.db, [request]))
    assert store.sessions.get(sid).last_seq == 0


def test_a_blocking_append_queues_behind_the_ones_in_flight(store: Store) -> None:
    sid, token = leased(store)
    futures = [store.events.submit(sid, "checkpoint", {"n": n}, token=token) for n in range(50)]
    last = store.events.append(sid, "checkpoint", {"n": 50}, token=token)
    assert [f.result() for f in futures] == list(range(1, 51))
    assert last == 51
    assert [e.payload["n"] for e in store.events.read(sid, limit=100)] == list(range(51))


def test_a_blocking_append_inside_a_transaction_of_its_thread_is_not_part_of_it(
    store: Store,
) -> None:
    sid, token = leased(store)
    assert store.events.append(sid, "checkpoint", {}, token=token) == 1
    # A read transaction (SQLite: one that takes no write lock, which the append needs).
    options = {"lock_type": "DEFERRED"} if store.backend == "sqlite" else {}
    with store.db.atomic(**options) as outer:
        assert Event.select().where(Event.session_id == sid).count() == 1
        assert store.events.append(sid, "checkpoint", {}, token=token) == 2
        outer.rollback()
    assert seqs_of(store, sid) == [1, 2]  # durable when it returned, whatever came after


def test_a_payload_that_is_not_json_is_refused_before_the_database(store: Store) -> None:
    sid, token = leased(store)
    cycle: dict[str, object] = {}
    cycle["self"] = cycle
    for bad in (cycle, {"x": float("nan")}, {"x": object()}, {(1, 2): "key"}):
        with pytest.raises(ValueError, match="not JSON-serializable"):
            store.events.append(sid, "checkpoint", bad, token=token)
    assert store.events.append(sid, "checkpoint", {"ü": "✓", "n": [1, 2.5, None]}, token=token) == 1
    assert store.events.read(sid)[0].payload == {"ü": "✓", "n": [1, 2.5, None]}


@pytest.mark.parametrize("size", [1, 3])
def test_a_stale_known_row_is_dropped_and_the_locked_row_decides(store: Store, size: int) -> None:
    from supervisor.store.appends import write_batch
    from supervisor.store.db import run_append
    from supervisor.store.eventlog import make_request
    from supervisor.store.statements import sql_for

    sid, token = leased(store)
    for _ in range(3):
        store.events.append(sid, "checkpoint", {}, token=token)
    sql = sql_for(store.db)
    batch = [make_request(sid, "checkpoint", {"n": n}, token=token) for n in range(size)]
    # Behind the log (dropped once its bump matched nothing); a token since replaced.
    for stale, kept in (((1, token), {}), ((3, token - 1), {sid: (3, token - 1)})):
        known = {sid: stale}
        outcomes, learned = run_append(
            store.db, sql.begin, lambda cursor, k=known: write_batch(cursor, sql, batch, k)
        )
        last = store.sessions.get(sid).last_seq
        assert outcomes == list(range(last - size + 1, last + 1))
        assert known == kept and learned == {sid: (last, token)}
    fresh = {sid: (last, token)}
    outcomes, learned = run_append(
        store.db, sql.begin, lambda cursor: write_batch(cursor, sql, batch, fresh)
    )
    assert outcomes == list(range(last + 1, last + size + 1))
    assert learned == {sid: (last + size, token)}
    assert seqs_of(store, sid) == list(range(1, last + size + 1))
