"""The delivery outbox on SQLite, PostgreSQL and MariaDB: a row written by the append of
its event, in its transaction, only for a bound session and a kind its target wants; the
claim of the oldest pending row of each (session, target), by one owner at a time, free
again when it ran out or was an earlier boot's; attempts fenced by the claim; retry (of
one row, and of a target's every row, in the order they were made), counts, prune and the
kinds of bound sessions."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from supervisor.core.vocabulary import DeliveryStatus
from supervisor.store import (
    DeliveryInfo,
    LeaseLost,
    SessionClosed,
    SessionNotFound,
    Store,
    StoreError,
)
from supervisor.store.db import run_write
from supervisor.store.eventlog import make_request, write_events
from supervisor.store.models import Delivery, Event, Session
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

HOOK, OTHER = "hook", "other"
LEASE = {HOOK: 60.0}
A1, A2, B1 = "host-a/boot0001", "host-a/boot0002", "host-b/boot0001"


def bound(store: Store, kinds: tuple[str, ...] = ("answer", "notice"), target: str = HOOK) -> str:
    """A new session bound to `target`: its id."""
    session_id = store.sessions.create("alice").id
    info = store.deliveries.bind(session_id, target, kinds)
    assert info.deliver_to == target
    return session_id


def notice(store: Store, session_id: str, text: str = "hello") -> int:
    return store.events.append(session_id, "notice", {"text": text}, writer="supervisor")


def notice_with_key(store: Store, session_id: str) -> int:
    options: dict[str, Any] = {"writer": "intake", "idempotency_key": "k1"}
    return store.events.append(session_id, "notice", {"text": "once"}, **options)


def rows(store: Store, session_id: str) -> list[DeliveryInfo]:
    return sorted(store.deliveries.list(session=session_id), key=lambda d: d.seq)


def claim(store: Store, owner: str, limit: int = 10, **options: Any) -> list[tuple[str, int]]:
    """(session, seq) of each delivery `owner` claims."""
    lease = options.pop("lease", LEASE)
    return sorted(
        (o.delivery.session, o.delivery.seq)
        for o in store.deliveries.claim(owner, lease, limit, **options)
    )


def by_seq(store: Store, session_id: str, seq: int) -> DeliveryInfo:
    [found] = [d for d in rows(store, session_id) if d.seq == seq]
    return found


def test_the_row_is_written_with_its_event_for_a_kind_its_target_wants(store: Store) -> None:
    sid = bound(store)
    append = store.events.append
    answer = append(sid, "model_response", {"text": "the answer", "tool_calls": []})
    append(sid, "model_response", {"text": "let me look", "tool_calls": [{"id": "c1"}]})
    cut = append(sid, "model_response", {"text": "cut", "finish_reason": "length"})
    append(sid, "tool_call", {"name": "x"})  # no kind: the fast path of a known row
    told = notice(store, sid)
    append(sid, "turn_ended", {"outcome": "completed"}, turn_id="t1")  # not wanted
    got = rows(store, sid)
    # A cut answer is an answer too: its continuation follows as the next one.
    assert [(d.seq, d.kind, d.target) for d in got] == [
        (answer, "answer", HOOK),
        (cut, "answer", HOOK),
        (told, "notice", HOOK),
    ]
    created = {e.seq: e.created_at for e in store.events.read(sid)}
    for d in got:
        assert (d.status, d.attempts, d.next_at, d.claimed_by) == ("pending", 0, 0.0, None)
        assert d.created_at == pytest.approx(created[d.seq]) and d.delivered_at is None
    # An unbound session gets none, whatever it appends.
    free = store.sessions.create("alice").id
    append(free, "model_response", {"text": "the answer"})
    notice(store, free)
    assert rows(store, free) == []
    # A bind made after the committer learned the row counts from the next append on;
    # so do another target, its kinds, and an unbind.
    other = store.sessions.create("alice").id
    append(other, "tool_call", {"name": "x"})
    append(other, "tool_call", {"name": "y"})  # from the known row
    store.deliveries.bind(other, OTHER, ["turn_ended", "notice"])
    store.deliveries.bind(other, OTHER, ["turn_ended", "notice"])  # the same again: fine
    told = notice(store, other)
    ended = append(other, "turn_ended", {"outcome": "completed"}, turn_id="t1")
    append(other, "model_response", {"text": "the answer"})  # not a kind OTHER wants
    assert [(d.seq, d.kind, d.target) for d in rows(store, other)] == [
        (told, "notice", OTHER),
        (ended, "turn_ended", OTHER),
    ]
    store.deliveries.bind(other, None, [])
    notice(store, other)
    assert len(rows(store, other)) == 2
    # A session created bound gets its first events' rows in its creating transaction.
    born = store.sessions.create(
        "alice", events=[("notice", {"text": "hi"})], deliver=(HOOK, "notice")
    )
    assert [(d.seq, d.kind) for d in rows(store, born.id)] == [(1, "notice")]


def test_a_batch_writes_the_rows_of_its_accepted_appends_only(store: Store) -> None:
    sid, other = bound(store), bound(store)
    lease = store.leases.acquire(sid, A1, 60)
    assert lease is not None
    assert store.leases.acquire(sid, A2, 60, force=True) is not None  # A1's token is stale
    batch = [
        make_request(sid, "model_response", {"text": "late"}, token=lease.token),
        make_request(other, "notice", {"text": "one"}, writer="supervisor"),
        make_request(sid, "notice", {"text": "no lease needed"}, writer="supervisor"),
        make_request(other, "model_response", {"text": "two"}),
    ]
    outcomes = run_write(store.db, lambda: write_events(store.db, batch))
    assert isinstance(outcomes[0], LeaseLost)
    assert [(d.seq, d.kind) for d in rows(store, sid)] == [(outcomes[2], "notice")]
    assert [(d.seq, d.kind) for d in rows(store, other)] == [
        (outcomes[1], "notice"),
        (outcomes[3], "answer"),
    ]
    # Refused on its own: a fenced answer, a message to a closed session.
    with pytest.raises(LeaseLost):
        store.events.append(sid, "model_response", {"text": "late"}, token=lease.token)
    assert len(rows(store, sid)) == 1
    store.sessions.close(other, "alice")  # its notice is sent too
    assert [d.kind for d in rows(store, other)] == ["notice", "answer", "notice"]
    with pytest.raises(SessionClosed):
        store.events.append(other, "user_message", {"text": "hi"}, writer="intake")
    assert len(rows(store, other)) == 3
    # An append its idempotency key replays writes no second row.
    keyed = [notice_with_key(store, sid) for _ in range(2)]
    assert keyed[0] == keyed[1] and [d.seq for d in rows(store, sid)][-1] == keyed[0]
    assert len(rows(store, sid)) == 2


def test_a_batch_rolled_back_writes_neither_its_events_nor_their_rows(store: Store) -> None:
    sid = bound(store)
    notice(store, sid)

    def work() -> None:
        assert write_events(store.db, [make_request(sid, "notice", {"text": "x"})]) == [2]
        raise RuntimeError("the caller changed its mind")

    with pytest.raises(RuntimeError):
        run_write(store.db, work)
    assert [e.seq for e in store.events.read(sid)] == [1] and len(rows(store, sid)) == 1
    # The row of the next event exists already: its insert fails, and the event with it.
    now = time.time()
    Delivery.insert(
        id="d" + uuid.uuid4().hex, target=HOOK, session=sid, seq=2, kind="notice",
        status="pending", created_at=now, updated_at=now,
    ).execute()  # fmt: skip
    with pytest.raises(StoreError):
        notice(store, sid)
    assert [e.seq for e in store.events.read(sid)] == [1]
    assert Session.get(Session.id == sid).last_seq == 1
    # The event's insert fails (seq 3 is taken behind the row's back): no row is left.
    Delivery.delete().where((Delivery.session == sid) & (Delivery.seq == 2)).execute()
    notice(store, sid)
    Event.insert(
        session_id=sid, seq=3, type="tool_call", payload={}, created_at=now, writer="worker"
    ).execute()
    with pytest.raises(StoreError):
        notice(store, sid)
    assert [d.seq for d in rows(store, sid)] == [1, 2]


def test_a_claim_takes_only_the_oldest_pending_row_of_each_session(store: Store) -> None:
    a, b = bound(store), bound(store)
    for n in range(3):
        notice(store, a, f"a{n}")
    for n in range(2):
        notice(store, b, f"b{n}")
    elsewhere = bound(store, target=OTHER)
    notice(store, elsewhere)
    assert claim(store, A1) == sorted([(a, 1), (b, 1)])  # not OTHER's: not asked for
    assert claim(store, B1) == []  # the rest wait for the rows before them
    ids = {(d.session, d.seq): d.id for d in store.deliveries.list()}
    finish = store.deliveries.finish
    assert finish(ids[a, 1], A1, DeliveryStatus.DELIVERED, code=204)
    assert claim(store, B1) == [(a, 2)]
    # In backoff, a row still holds back the next of its session.
    assert finish(ids[a, 2], B1, DeliveryStatus.PENDING, next_in=300, code=503)
    assert claim(store, B1) == []
    # A dead row is done: the next goes.
    assert finish(ids[b, 1], A1, DeliveryStatus.DEAD, code=404)
    assert claim(store, B1) == [(b, 2)]
    assert store.deliveries.retry(ids[a, 2]) is not None  # due at once again
    assert claim(store, B1) == [(a, 2)]
    # Per (session, target): rebound, the session's rows to the new target are not held
    # back by those still pending to the old one.
    store.deliveries.bind(a, OTHER, ["notice"])
    seq = notice(store, a)
    both = {HOOK: 60.0, OTHER: 60.0}
    assert claim(store, B1, lease=both) == sorted([(a, seq), (elsewhere, 1)])
    assert claim(store, A1, limit=0) == [] and claim(store, A1, lease={}) == []


def test_owners_claiming_at_once_never_take_the_same_row(store: Store) -> None:
    sessions = [bound(store) for _ in range(16)]
    for sid in sessions:
        notice(store, sid, "first")
        notice(store, sid, "second")
    owners = [f"host-{n}/boot{n}" for n in range(4)]
    for _ in range(3):
        claimed: dict[str, list[tuple[str, int]]] = {}
        start = threading.Barrier(len(owners))

        def take(owner: str, start: threading.Barrier, claimed: dict[str, Any]) -> None:
            start.wait()  # each thread on a connection, and in a transaction, of its own
            claimed[owner] = claim(store, owner, limit=6)

        threads = [threading.Thread(target=take, args=(o, start, claimed)) for o in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert set(claimed) == set(owners), "a claim failed"
        every = [row for got in claimed.values() for row in got]
        assert len(every) == len(set(every)), f"a row claimed twice: {claimed}"
        assert {seq for _, seq in every} <= {1}  # never a session's second
        rest = claim(store, "host-z/boot9", limit=100)
        assert sorted(every + rest) == [(sid, 1) for sid in sorted(sessions)]
        for owner in [*owners, "host-z/boot9"]:
            store.deliveries.release(owner)
    assert all(d.claimed_by is None for d in store.deliveries.list())


def test_a_claim_run_out_or_of_an_earlier_boot_is_free_again(store: Store) -> None:
    sid = bound(store)
    notice(store, sid)
    assert claim(store, A1, lease={HOOK: -1.0}) == [(sid, 1)]  # runs out at once
    assert claim(store, B1) == [(sid, 1)]
    assert claim(store, A1) == [] and claim(store, A2, mine="host-a/") == []
    # B1's host started again: its earlier boot's claims are its own to take.
    assert claim(store, "host-b/boot0002") == []
    assert claim(store, "host-b/boot0002", mine="host-b/") == [(sid, 1)]
    assert claim(store, "host-b/boot0002", mine="host-b/") == []  # not its own, live one
    assert by_seq(store, sid, 1).claimed_by == "host-b/boot0002"
    # A release hands them back, for whoever claims next.
    assert store.deliveries.release("host-b/boot0002") == 1
    assert claim(store, A1) == [(sid, 1)]


def test_the_next_due_is_the_soonest_try_a_claim_could_take(store: Store) -> None:
    a, b, elsewhere = bound(store), bound(store), bound(store, target=OTHER)
    for sid in (a, a, b, elsewhere):
        notice(store, sid)
    due, now = store.deliveries.next_due, store.deliveries.now()
    assert due([HOOK], now) is None  # every one due already: the pass's to take
    ids = {(d.session, d.seq): d.id for d in store.deliveries.list()}
    both = {HOOK: 60.0, OTHER: 60.0}
    assert claim(store, A1, lease=both) == sorted([(a, 1), (b, 1), (elsewhere, 1)])
    finish = store.deliveries.finish
    assert finish(ids[a, 1], A1, DeliveryStatus.DEAD, code=404)
    assert finish(ids[b, 1], A1, DeliveryStatus.PENDING, next_in=300, code=503)
    assert finish(ids[elsewhere, 1], A1, DeliveryStatus.PENDING, next_in=5, code=503)
    assert claim(store, A1) == [(a, 2)]
    assert finish(ids[a, 2], A1, DeliveryStatus.PENDING, next_in=30, code=503)
    soonest = due([HOOK], now)  # a's second try, not OTHER's
    assert soonest == by_seq(store, a, 2).next_at
    assert now + 30 <= soonest <= store.deliveries.now() + 30
    assert due([HOOK], soonest + 1) == by_seq(store, b, 1).next_at
    assert due([HOOK, OTHER], now) == by_seq(store, elsewhere, 1).next_at
    # Behind a row of its session pending again, a row waits for that one, not its time.
    assert store.deliveries.retry(ids[a, 1]) is not None
    assert due([HOOK], now) == by_seq(store, b, 1).next_at
    assert due([], now) is None


def test_finish_is_fenced_by_the_claim(store: Store) -> None:
    sid = bound(store)
    notice(store, sid)
    [stale] = store.deliveries.claim(A1, {HOOK: -1.0}, 1)
    [live] = store.deliveries.claim(B1, LEASE, 1)
    did = stale.delivery.id
    assert live.delivery.id == did and live.payload == {"text": "hello"}
    assert not store.deliveries.finish(did, A1, DeliveryStatus.DELIVERED, code=200)
    row = store.deliveries.get(did)
    assert row is not None and (row.status, row.attempts, row.claimed_by) == ("pending", 0, B1)
    before = store.deliveries.now()
    assert store.deliveries.finish(
        did, B1, DeliveryStatus.PENDING, next_in=30, code=500, error="x" * 2000
    )
    row = store.deliveries.get(did)
    assert row is not None and (row.status, row.attempts, row.claimed_by) == ("pending", 1, None)
    assert (row.last_code, len(row.last_error), row.claim_expires_at) == (500, 500, None)
    assert before + 30 <= row.next_at <= store.deliveries.now() + 30
    assert not store.deliveries.finish(did, B1, DeliveryStatus.DELIVERED)  # not claimed
    store.deliveries.retry(did)
    [again] = store.deliveries.claim(A1, LEASE, 1)
    assert again.delivery.attempts == 1
    assert store.deliveries.finish(did, A1, DeliveryStatus.DELIVERED, code=200)
    row = store.deliveries.get(did)
    assert row is not None and (row.status, row.attempts, row.last_code) == ("delivered", 2, 200)
    assert row.delivered_at is not None and row.last_error == ""
    assert not store.deliveries.finish(did, A1, DeliveryStatus.DEAD)  # final: untouched
    assert store.deliveries.get(did) == row
    assert "claimed_by" not in row.to_dict() and row.to_dict()["status"] == "delivered"


def test_retry_of_a_dead_a_pending_and_a_delivered_row(store: Store) -> None:
    sid = bound(store)
    for n in range(3):
        notice(store, sid, f"n{n}")
    ids = [d.id for d in rows(store, sid)]
    finish = store.deliveries.finish
    claim(store, A1)
    assert finish(ids[0], A1, DeliveryStatus.DELIVERED, code=200)
    claim(store, A1)
    assert finish(ids[1], A1, DeliveryStatus.PENDING, next_in=300, code=500)
    claim(store, A1)  # nothing: the second waits
    delivered = store.deliveries.get(ids[0])
    assert store.deliveries.retry(ids[0]) == delivered  # left as it is
    pending = store.deliveries.retry(ids[1])
    assert pending is not None and (pending.status, pending.attempts, pending.next_at) == (
        "pending",
        1,
        0.0,
    )
    claim(store, A1)
    assert finish(ids[1], A1, DeliveryStatus.DEAD, code=410, error="gone")
    dead = store.deliveries.retry(ids[1])
    assert dead is not None and (dead.status, dead.attempts, dead.next_at) == ("pending", 0, 0.0)
    assert (dead.last_code, dead.last_error) == (410, "gone")  # what happened, kept
    assert claim(store, B1) == [(sid, 2)]
    assert store.deliveries.retry("d" + "0" * 32) is None


def test_retry_all_sends_a_target_s_rows_again_in_the_order_they_were_made(
    store: Store,
) -> None:
    a, b, d, e = bound(store), bound(store), bound(store), bound(store)
    c = bound(store, target=OTHER)
    for sid, n in [(a, 1), (b, 1), (a, 2), (b, 2), (a, 3), (c, 1), (d, 1), (e, 1)]:
        notice(store, sid, f"{n}")
    ids = {(x.session, x.seq): x.id for x in store.deliveries.list()}
    finish, both = store.deliveries.finish, {HOOK: 60.0, OTHER: 60.0}
    # What an outage left: dead rows in an order of their own, a row delivered between
    # two of them, one in its backoff, one in flight, and another target's dead row.
    assert claim(store, A1, lease=both) == sorted([(a, 1), (b, 1), (c, 1), (d, 1), (e, 1)])
    for key in [(b, 1), (c, 1), (a, 1)]:
        assert finish(ids[key], A1, DeliveryStatus.DEAD, code=503, error="HTTP 503")
    assert finish(ids[d, 1], A1, DeliveryStatus.PENDING, next_in=300, code=503)
    assert finish(ids[e, 1], A1, DeliveryStatus.PENDING, next_in=-1, code=503)  # due
    assert claim(store, B1) == sorted([(a, 2), (b, 2), (e, 1)])  # e's: B1's, in flight
    assert finish(ids[b, 2], B1, DeliveryStatus.DEAD, code=404, error="HTTP 404")
    assert finish(ids[a, 2], B1, DeliveryStatus.DELIVERED, code=200)
    assert claim(store, A1) == [(a, 3)]
    assert finish(ids[a, 3], A1, DeliveryStatus.DEAD, code=503, error="HTTP 503")

    assert store.deliveries.retry_all(HOOK) == (4, 1)  # dead a1 b1 b2 a3; d1 due now
    for key in [(a, 1), (b, 1), (b, 2), (a, 3), (d, 1)]:
        row = store.deliveries.get(ids[key])
        assert row is not None and (row.status, row.next_at, row.claimed_by) == (
            "pending",
            0.0,
            None,
        )
        assert row.attempts == (1 if key == (d, 1) else 0) and row.last_code in (503, 404)
    kept = [store.deliveries.get(ids[key]) for key in [(a, 2), (c, 1), (e, 1)]]
    assert [(x.status, x.claimed_by) for x in kept if x] == [
        ("delivered", None),  # never sent twice
        ("dead", None),  # another target's
        ("pending", B1),  # being sent: its attempt decides
    ]
    # One at a time, as a target with room for one takes them: as they were made.
    order = []
    while found := store.deliveries.claim(A1, LEASE, 1):
        [taken] = found
        order.append((taken.delivery.session, taken.delivery.seq))
        assert finish(taken.delivery.id, A1, DeliveryStatus.DELIVERED, code=200)
    assert order == [(a, 1), (b, 1), (b, 2), (a, 3), (d, 1)]
    assert store.deliveries.retry_all(HOOK) == (0, 0)
    assert store.deliveries.retry_all("nowhere") == (0, 0)


def test_counts_listing_and_prune(store: Store) -> None:
    assert store.deliveries.counts() == {"pending": 0, "delivered": 0, "dead": 0}
    sessions = [bound(store) for _ in range(4)]
    for sid in sessions:
        notice(store, sid)
    notice(store, sessions[3])
    first = {d.session: d for d in store.deliveries.list() if d.seq == 1}
    outcomes = [DeliveryStatus.DELIVERED, DeliveryStatus.DELIVERED, DeliveryStatus.DEAD]
    claim(store, A1)
    for sid, status in zip(sessions, outcomes, strict=False):
        assert store.deliveries.finish(first[sid].id, A1, status)
    assert store.deliveries.counts() == {"pending": 2, "delivered": 2, "dead": 1}
    assert store.deliveries.list(status="dead")[0].session == sessions[2]
    assert [d.session for d in store.deliveries.list(session=sessions[0])] == [sessions[0]]
    [newest, *_] = store.deliveries.list()
    assert (newest.session, newest.seq) == (sessions[3], 2)
    # Prune forgets delivered rows delivered before the time given, and nothing else.
    assert store.deliveries.prune(time.time() - 3600) == 0
    assert store.deliveries.prune(store.deliveries.now() + 1) == 2
    assert store.deliveries.counts() == {"pending": 2, "delivered": 0, "dead": 1}


def test_sync_kinds_and_bind(store: Store) -> None:
    old = [bound(store, ("answer",)) for _ in range(3)]
    other = bound(store, ("answer",), target=OTHER)
    assert store.deliveries.sync_kinds({HOOK: ["notice", "answer"]}) == 3
    assert store.deliveries.sync_kinds({HOOK: ["answer", "notice"]}) == 0  # as it is now
    assert store.deliveries.sync_kinds({HOOK: ["notice"], OTHER: ["answer"]}) == 3
    for sid in [*old, other]:
        notice(store, sid)
        store.events.append(sid, "model_response", {"text": "the answer"})
    assert [d.kind for d in rows(store, old[0])] == ["notice"]
    assert [d.kind for d in rows(store, other)] == ["answer"]
    with pytest.raises(SessionNotFound):
        store.deliveries.bind("no-such-session", HOOK, ["answer"])
    assert store.deliveries.sync_kinds({}) == 0
