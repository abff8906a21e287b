"""The store's contract, run alike on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import asyncio
import threading
import time

import peewee
import pytest
from playhouse.migrate import SchemaMigrator
from playhouse.migrate import migrate as run_migrations

from supervisor.store import (
    IdempotencyConflict,
    LeaseLost,
    ReplayedSeq,
    SchemaMissing,
    SchemaTooNew,
    SessionClosed,
    SessionNotFound,
    Store,
    migrations,
    request_digest,
    scoped_key,
)
from supervisor.store.db import run_write
from supervisor.store.eventlog import make_request, write_events
from supervisor.store.models import Delivery, Event, Host, RestartRequest, SchemaVersion, Session
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)


def contiguous(store: Store, session_id: str) -> list[int]:
    seqs = [e.seq for e in store.events.read(session_id, limit=100_000)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert store.sessions.get(session_id).last_seq == len(seqs)
    return seqs


# --- schema ---------------------------------------------------------------------------


def test_migrate_is_idempotent_and_stamps_latest(db_url: str) -> None:
    with Store(db_url) as first:
        assert (first.schema_before, first.schema_version) == (0, migrations.LATEST)
    with Store(db_url) as second:
        assert second.schema_before == migrations.LATEST
    with Store(db_url, migrate=False) as reader:
        assert reader.schema_version == migrations.LATEST


def test_a_version_1_database_is_migrated_and_keeps_its_rows(db_url: str) -> None:
    with Store(db_url) as store:  # made at LATEST; turned back into version 1 below
        sid = store.sessions.create("alice").id
        store.events.append(
            sid, "user_message", {"text": "kept", "by": "alice"}, writer="intake",
            idempotency_key="k1",
        )  # fmt: skip
        store.children.record("a-boot-before-hosts", 4242, 1.0, "worker", host="gone")
        migrator = SchemaMigrator.from_database(store.db)
        run_migrations(
            migrator.drop_column("session", "resend_requested_at"),
            migrator.drop_column("intake_key", "digest"),
            migrator.drop_index("session", "session_owner"),
            migrator.drop_index("session", "session_pending_status_updated_at"),
            migrator.drop_index("child_process", "child_process_host"),
            migrator.drop_column("child_process", "host"),
            migrator.drop_column("session", "deliver_to"),
            migrator.drop_column("session", "deliver_kinds"),
            migrator.drop_index("session", "session_principal_status"),
            migrator.drop_column("session", "principal"),
        )
        store.db.drop_tables([Host, Delivery, RestartRequest])
        SchemaVersion.update(version=1).execute()
    with Store(db_url) as store:
        assert (store.schema_before, store.schema_version) == (1, migrations.LATEST)
        assert store.sessions.get(sid).resend_requested_at is None
        assert store.sessions.get(sid).deliver_to is None  # version 8: no target
        assert store.deliveries.counts()["pending"] == 0
        assert store.restarts.list() == []  # version 9: the restart requests
        # Version 10: the session's principal from its ACL (SQLite's rebuilds of the session
        # table above cascaded its ACL rows away; the server databases keep them).
        admins = sorted(p for p, grant in store.acl.entries(sid).items() if grant == "admin")
        assert store.sessions.get(sid).principal == (admins[0] if admins else None)
        assert admins or db_url.startswith("sqlite")
        assert [e.payload["text"] for e in store.events.read(sid)] == ["kept"]
        # Version 4 indexed the work query and lease renewal.
        indexes = {index.name for index in store.db.get_indexes("session")}
        assert {"session_owner", "session_pending_status_updated_at"} <= indexes
        # Version 5 added the host registry and each child's host ("" before it).
        assert store.hosts.all() == []
        assert [c.host for c in store.children.of_other_boots("now")] == [""]
        # Version 3 scoped the key to the principal that sent it: a replay still finds it.
        replay = store.events.append(
            sid, "user_message", {"text": "kept"}, writer="intake",
            idempotency_key=scoped_key("alice", "k1"), idempotency_digest="d",
        )  # fmt: skip
        assert isinstance(replay, ReplayedSeq) and replay == 1
        assert store.sessions.finalize(sid, None, "please resend", "unsafe_tail")
        assert store.sessions.get(sid).resend_requested_at is not None
        store.events.append(sid, "user_message", {"text": "again"}, writer="intake")
        assert store.sessions.get(sid).resend_requested_at is None  # the user did


def test_a_newer_schema_is_refused(db_url: str) -> None:
    with Store(db_url):
        SchemaVersion.update(version=migrations.LATEST + 1).execute()
    for migrate in (True, False):
        with pytest.raises(SchemaTooNew, match="upgrade turnkeeper"):
            Store(db_url, migrate=migrate)


def test_an_unmigrated_database_is_refused_by_readers(db_url: str) -> None:
    with Store(db_url):
        SchemaVersion.delete().execute()
    with pytest.raises(SchemaMissing, match="turnkeeper db migrate"):
        Store(db_url, migrate=False)


# --- sessions and ACL -----------------------------------------------------------------


def test_create_gives_the_creator_admin(store: Store) -> None:
    info = store.sessions.create("alice", kind="autonomous", title="nightly")
    assert (info.kind, info.title, info.last_seq, info.status) == (
        "autonomous",
        "nightly",
        0,
        "open",
    )
    assert store.acl.entries(info.id) == {"alice": "admin"}
    assert [s.id for s in store.sessions.list("alice")] == [info.id]
    assert store.sessions.list("bob") == []


def test_create_rejects_bad_input_and_writes_nothing(store: Store) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.sessions.create("alice", kind="telepathic")
    with pytest.raises(ValueError, match="principal"):
        store.sessions.create("")
    assert store.sessions.list() == []
    with pytest.raises(SessionNotFound):
        store.sessions.get("nope")


def test_acl_grant_and_revoke_are_logged(store: Store) -> None:
    sid = store.sessions.create("alice").id
    assert store.acl.permission(sid, "bob") is None
    store.acl.grant(sid, "bob", "read", by="alice")
    assert store.acl.permission(sid, "bob") == "read"
    store.acl.grant(sid, "bob", "write", by="alice")
    assert store.acl.permission(sid, "bob") == "write"
    assert store.acl.entries(sid) == {"alice": "admin", "bob": "write"}
    store.acl.revoke(sid, "bob", by="alice")
    assert store.acl.permission(sid, "bob") is None
    events = store.events.read(sid)
    assert [e.payload["permission"] for e in events] == ["read", "write", None]
    assert {e.type for e in events} == {"acl"}
    with pytest.raises(ValueError):
        store.acl.grant(sid, "bob", "root")
    with pytest.raises(SessionNotFound):
        store.acl.grant("nope", "bob", "read")
    contiguous(store, sid)


# --- leases ---------------------------------------------------------------------------


def test_a_live_lease_is_exclusive_and_tokens_only_grow(store: Store) -> None:
    sid = store.sessions.create("alice").id
    first = store.leases.acquire(sid, "w0.1", ttl=30)
    assert first is not None and first.token == 1
    assert store.leases.acquire(sid, "w1.1", ttl=30) is None
    assert store.leases.holder(sid) == first
    forced = store.leases.acquire(sid, "w1.1", ttl=30, force=True)
    assert forced is not None and forced.token > first.token
    with pytest.raises(LeaseLost):
        store.leases.renew(first, ttl=30)
    assert not store.leases.release(first)
    assert store.leases.release(forced)
    assert store.leases.holder(sid) is None
    again = store.leases.acquire(sid, "w2.1", ttl=30)
    assert again is not None and again.token > forced.token
    with pytest.raises(SessionNotFound):
        store.leases.acquire("nope", "w0.1", ttl=30)


def test_a_stale_lease_is_taken_over_by_the_database_clock(store: Store) -> None:
    sid = store.sessions.create("alice").id
    old = store.leases.acquire(sid, "host-a", ttl=0.3)
    assert old is not None
    assert store.leases.acquire(sid, "host-b", ttl=30) is None
    time.sleep(0.5)
    assert store.leases.holder(sid) is None
    new = store.leases.acquire(sid, "host-b", ttl=30)
    assert new is not None and new.token > old.token and new.owner == "host-b"


def test_renew_extends_the_lease(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w0.1", ttl=0.5)
    assert lease is not None
    renewed = store.leases.renew(lease, ttl=30)
    assert renewed.expires_at > lease.expires_at
    time.sleep(0.7)
    assert store.leases.holder(sid) == renewed


# --- appends --------------------------------------------------------------------------


def test_appends_are_contiguous_and_read_back(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w0.1", ttl=30)
    assert lease is not None
    seqs = [store.events.append(sid, "notice", {"n": n}, token=lease.token) for n in range(25)]
    assert seqs == list(range(1, 26))
    assert [e.payload["n"] for e in store.events.read(sid, after=10, limit=5)] == [
        10,
        11,
        12,
        13,
        14,
    ]
    assert [e.seq for e in store.events.tail(sid, 3)] == [23, 24, 25]
    assert store.events.read(sid, after=25) == []
    contiguous(store, sid)


def test_fencing_rejects_the_old_holder_and_stores_nothing(store: Store) -> None:
    sid = store.sessions.create("alice").id
    old = store.leases.acquire(sid, "w0.1", ttl=30)
    assert old is not None
    store.events.append(sid, "turn_started", token=old.token, turn_id="t1")
    new = store.leases.acquire(sid, "w1.1", ttl=30, force=True)
    assert new is not None
    with pytest.raises(LeaseLost) as caught:
        store.events.append(sid, "model_response", {"text": "late"}, token=old.token, turn_id="t1")
    assert (caught.value.token, caught.value.current) == (old.token, new.token)
    assert store.sessions.get(sid).last_seq == 1
    assert Event.select().where(Event.session_id == sid).count() == 1
    assert store.events.append(sid, "turn_ended", token=new.token, turn_id="t1") == 2


def test_fencing_inside_one_batch_rejects_only_the_stale_writer(store: Store) -> None:
    a = store.sessions.create("alice").id
    b = store.sessions.create("alice").id
    lease_a = store.leases.acquire(a, "w0.1", ttl=30)
    lease_b = store.leases.acquire(b, "w0.1", ttl=30)
    assert lease_a and lease_b
    store.leases.acquire(a, "w1.1", ttl=30, force=True)
    batch = [
        make_request(a, "notice", {"x": 1}, token=lease_a.token),
        make_request(b, "notice", {"x": 2}, token=lease_b.token),
        make_request(a, "user_message", {"text": "hi"}, writer="intake"),
    ]
    outcomes = run_write(store.db, lambda: write_events(store.db, batch))
    assert isinstance(outcomes[0], LeaseLost)
    assert outcomes[1:] == [1, 1]
    assert [e.type for e in store.events.read(a)] == ["user_message"]


def test_intake_appends_need_no_lease_and_idempotency_keys_dedupe(store: Store) -> None:
    sid = store.sessions.create("alice").id
    seqs = [
        store.events.append(
            sid, "user_message", {"text": "hi"}, writer="intake", idempotency_key="k-1"
        )
        for _ in range(5)
    ]
    assert seqs == [1] * 5
    assert (
        store.events.append(
            sid, "user_message", {"text": "again"}, writer="intake", idempotency_key="k-2"
        )
        == 2
    )
    futures = [
        store.events.submit(
            sid, "user_message", {"text": "x"}, writer="intake", idempotency_key="k-3"
        )
        for _ in range(10)
    ]
    assert {f.result() for f in futures} == {3}
    assert len(store.events.read(sid)) == 3
    contiguous(store, sid)


def test_a_key_replayed_is_marked_and_a_key_reused_for_another_request_conflicts(
    store: Store,
) -> None:
    sid = store.sessions.create("alice").id

    def send(text: str, key: str = "k") -> object:
        return store.events.submit(
            sid, "user_message", {"text": text}, writer="intake",
            idempotency_key=key, idempotency_digest=request_digest(text),
        )  # fmt: skip

    first = send("hi").result()
    assert first == 1 and not isinstance(first, ReplayedSeq)
    again = send("hi").result()
    assert again == 1 and isinstance(again, ReplayedSeq)
    with pytest.raises(IdempotencyConflict):
        send("something else").result()
    # In one batch too: the first of a key commits, a replay is marked, a reuse conflicts.
    batch = [send("x", "k2"), send("x", "k2"), send("y", "k2")]
    assert batch[0].result() == 2 and batch[1].result() == 2
    assert isinstance(batch[1].result(), ReplayedSeq)
    with pytest.raises(IdempotencyConflict):
        batch[2].result()
    assert [e.payload["text"] for e in store.events.read(sid)] == ["hi", "x"]


def test_turn_events_set_and_clear_the_active_turn(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w0.1", ttl=30)
    assert lease is not None
    store.events.append(sid, "turn_started", token=lease.token, turn_id="t1")
    assert store.sessions.get(sid).active_turn_id == "t1"
    store.events.append(sid, "model_response", {"text": "hello"}, token=lease.token, turn_id="t1")
    assert store.sessions.get(sid).active_turn_id == "t1"
    store.events.append(
        sid, "turn_ended", {"outcome": "completed"}, token=lease.token, turn_id="t1"
    )
    assert store.sessions.get(sid).active_turn_id is None


def test_bad_appends_are_refused_before_they_reach_the_database(store: Store) -> None:
    sid = store.sessions.create("alice").id
    with pytest.raises(ValueError, match="event type"):
        store.events.append(sid, "telepathy")
    with pytest.raises(ValueError, match="JSON"):
        store.events.append(sid, "notice", {"when": object()}, writer="intake")
    with pytest.raises(ValueError, match="JSON object"):
        store.events.append(sid, "notice", [1, 2], writer="intake")  # type: ignore[arg-type]
    with pytest.raises(SessionNotFound):
        store.events.append("nope", "notice", writer="intake")
    assert store.sessions.get(sid).last_seq == 0


def test_large_payloads_round_trip(store: Store) -> None:
    sid = store.sessions.create("alice").id
    text = "ü" * 300_000
    store.events.append(sid, "tool_result", {"text": text}, writer="intake")
    assert store.events.read(sid)[0].payload["text"] == text


def test_concurrent_appends_are_group_committed(store: Store) -> None:
    sessions = [store.sessions.create("alice").id for _ in range(32)]
    leases = [store.leases.acquire(sid, "w0.1", ttl=60) for sid in sessions]
    errors: list[BaseException] = []

    def run(sid: str, token: int) -> None:
        try:
            for n in range(20):
                store.events.append(sid, "notice", {"n": n}, token=token)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(lease.session_id, lease.token))
        for lease in leases
        if lease is not None
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.events.committed == 32 * 20
    # Group commit: many appends shared a transaction.
    assert store.events.commits < store.events.committed / 2
    for sid in sessions:
        assert [e.payload["n"] for e in store.events.read(sid)] == list(range(20))
        contiguous(store, sid)


def test_async_append(store: Store) -> None:
    sid = store.sessions.create("alice").id

    async def main() -> list[int]:
        return list(
            await asyncio.gather(
                *(
                    store.events.append_async(sid, "notice", {"n": n}, writer="intake")
                    for n in range(10)
                )
            )
        )

    assert sorted(asyncio.run(main())) == list(range(1, 11))


def test_a_closed_log_refuses_appends(db_url: str) -> None:
    s = Store(db_url)
    sid = s.sessions.create("alice").id
    future = s.events.submit(sid, "notice", writer="intake")
    s.close()
    assert future.result() == 1
    with pytest.raises(Exception, match="closed"):
        s.events.submit(sid, "notice", writer="intake")


# --- boots and children ---------------------------------------------------------------


def test_boot_rows(store: Store) -> None:
    first = store.boots.begin("host-a", 100, "0.1.0")
    store.boots.end(first, "clean")
    second = store.boots.begin("host-a", 101, "0.1.0")
    store.boots.set_attempted(second, ["s1", "s2"])
    boots = store.boots.recent()
    assert [b.boot_id for b in boots] == [second, first]
    assert boots[0].outcome is None and boots[0].attempted == ["s1", "s2"]
    assert boots[1].outcome == "clean" and boots[1].ended_at is not None
    with pytest.raises(ValueError):
        store.boots.end(second, "exploded")


def test_child_registry(store: Store) -> None:
    old = store.children.record(
        "boot-1", 4242, 1700000000.5, "mcp", pgid=4242, worker="w0.1", name="files"
    )
    store.children.record("boot-2", 4343, 1700000001.5, "worker")
    left = store.children.of_other_boots("boot-2")
    assert [(c.pid, c.create_time, c.kind, c.name) for c in left] == [
        (4242, 1700000000.5, "mcp", "files")
    ]
    store.children.forget([old])
    assert store.children.of_other_boots("boot-2") == []


def test_session_rows_are_plain_data(store: Store) -> None:
    sid = store.sessions.create("alice", title="t").id
    data = store.sessions.get(sid).to_dict()
    assert data["id"] == sid and data["title"] == "t" and data["last_seq"] == 0
    assert Session.select().count() == 1
    assert isinstance(store.db, peewee.Database)


def test_attempts_are_charged_refunded_and_finalized_only_for_the_active_turn(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w1", 30)
    assert lease is not None
    store.events.append(sid, "user_message", {"text": "hi"}, writer="intake")
    store.events.append(sid, "turn_started", {}, token=lease.token, turn_id="t1")
    assert store.sessions.charge_attempt(sid, "t2") is None  # not the active turn
    assert store.sessions.charge_attempt(sid, "t1") == 2  # its first run was attempt 1
    assert store.sessions.charge_attempt(sid, "t1") == 3
    store.sessions.refund_attempt(sid, "t1")
    assert store.sessions.get(sid).attempt_count == 2
    # The continuation note itself charges nothing: the charge came before it.
    store.events.append(
        sid, "continuation", {"cause": "worker_crash"}, token=lease.token, turn_id="t1"
    )
    assert store.sessions.get(sid).attempt_count == 2
    assert not store.sessions.finalize(sid, "t2", "resend please", "stale")
    assert store.sessions.finalize(sid, "t1", "resend please", "stale")
    info = store.sessions.get(sid)
    assert (info.active_turn_id, info.status, info.owner, info.attempt_count) == (
        None,
        "open",
        None,
        0,
    )
    assert info.lease_token > lease.token  # the old owner is fenced out
    *_, notice, ended = store.events.read(sid)
    assert (notice.type, notice.payload["resend"], notice.payload["reason"]) == (
        "notice",
        True,
        "stale",
    )
    assert (ended.type, ended.payload) == ("turn_ended", {"outcome": "failed", "reason": "stale"})
    with pytest.raises(LeaseLost):
        store.events.append(
            sid, "model_response", {"text": "late"}, token=lease.token, turn_id="t1"
        )


def test_a_session_is_created_with_its_first_events_or_not_at_all(store: Store) -> None:
    info = store.sessions.create(
        "alice",
        kind="autonomous",
        events=[("checkpoint", {"turns": 0}), ("user_message", {"text": "go"})],
    )
    assert [e.type for e in store.events.read(info.id)] == ["checkpoint", "user_message"]
    assert store.sessions.get(info.id).pending
    before = len(store.sessions.list())
    with pytest.raises(ValueError):
        store.sessions.create("alice", events=[("no_such_type", {})])
    assert len(store.sessions.list()) == before
    assert [s.id for s in store.sessions.idle_autonomous()] == []  # it has input waiting


def test_the_breaker_reads_this_hosts_boots_and_keeps_a_reset(store: Store) -> None:
    first = store.boots.begin("host-a", 1, "v")
    store.boots.begin("host-b", 2, "v")
    store.boots.set_breaker(first, {"tripped": True})
    at = store.boots.reset_breaker("host-a")
    [row] = store.boots.of_host("host-a", 0.0)
    assert row.boot_id == first and row.breaker == {"tripped": True, "reset_at": at}
    assert store.boots.of_host("host-a", at + 3600) == []
    with pytest.raises(LookupError):
        store.boots.reset_breaker("host-c")
    assert store.boots.prune(store.now() + 1) == 2
    assert store.boots.recent() == []


def test_turn_started_keeps_pending_for_a_message_it_did_not_read(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w1", 30)
    assert lease is not None
    read = store.events.append(sid, "user_message", {"text": "one"}, writer="intake")
    store.events.append(sid, "user_message", {"text": "two"}, writer="intake")  # unread
    store.events.append(sid, "turn_started", {"read_to": read}, token=lease.token, turn_id="t1")
    assert store.sessions.get(sid).pending  # "two" still needs a turn
    store.events.append(
        sid, "turn_ended", {"outcome": "completed"}, token=lease.token, turn_id="t1"
    )
    last = store.events.read(sid)[-1].seq
    store.events.append(sid, "turn_started", {"read_to": last}, token=lease.token, turn_id="t2")
    assert not store.sessions.get(sid).pending  # it read everything
    with pytest.raises(ValueError, match="read_to"):
        store.events.append(sid, "turn_started", {"read_to": "x"}, token=lease.token, turn_id="t3")


# --- close and release ------------------------------------------------------------------


def test_close_ends_the_turn_for_good_takes_no_input_and_is_idempotent(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w1", 30)
    assert lease is not None
    store.events.append(sid, "user_message", {"text": "hi"}, writer="intake")
    store.events.append(sid, "turn_started", {}, token=lease.token, turn_id="t1")
    store.events.append(sid, "user_message", {"text": "queued"}, writer="intake")
    assert store.sessions.close(sid, "alice")
    info = store.sessions.get(sid)
    assert (info.status, info.active_turn_id, info.pending, info.owner) == (
        "closed",
        None,
        False,
        None,
    )
    *_, ended, notice = store.events.read(sid)
    assert (ended.type, ended.turn_id) == ("turn_ended", "t1")
    assert ended.payload == {"outcome": "interrupted_by_operator", "by": "alice"}
    assert (notice.type, notice.payload["reason"]) == ("notice", "closed")
    last = info.last_seq
    # The worker that ran the turn is fenced out; nobody may take the session again.
    with pytest.raises(LeaseLost):
        store.events.append(sid, "model_response", {}, token=lease.token, turn_id="t1")
    assert store.leases.acquire(sid, "w2", 30, force=True) is None
    assert store.leases.acquire(sid, "w2", 30) is None
    # No new input, whoever writes it; a wake is refused too.
    for writer in ("intake", "cli"):
        with pytest.raises(SessionClosed, match="closed"):
            store.events.append(sid, "user_message", {"text": "late"}, writer=writer)
    with pytest.raises(SessionClosed):
        store.sessions.request_turn(sid)
    assert sid not in {s.id for s in store.sessions.with_work()}
    # Closing again changes nothing; the history is kept.
    assert not store.sessions.close(sid, "bob")
    assert store.sessions.get(sid).last_seq == last
    assert store.sessions.counts()["closed"] == 1
    with pytest.raises(SessionNotFound):
        store.sessions.close("0" * 32, "alice")


def test_close_without_a_turn_in_flight_writes_only_its_notice(store: Store) -> None:
    sid = store.sessions.create("alice", kind="autonomous").id
    assert store.sessions.close(sid, "alice")
    assert [e.type for e in store.events.read(sid)] == ["notice"]
    assert store.sessions.idle_autonomous() == []


def quarantine_with_turn(store: Store) -> tuple[str, int]:
    """A session quarantined by recovery, its poisoned turn t1 ended; and its old token."""
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w1", 30)
    assert lease is not None
    store.events.append(sid, "user_message", {"text": "/crash"}, writer="intake")
    store.events.append(sid, "turn_started", {}, token=lease.token, turn_id="t1")
    for _ in range(3):
        store.sessions.charge_attempt(sid, "t1")
    assert store.sessions.finalize(sid, "t1", "quarantined", "quarantined", quarantine=True)
    return sid, lease.token


def test_release_lifts_a_quarantine_with_a_notice_and_resets_the_attempts(store: Store) -> None:
    sid, _ = quarantine_with_turn(store)
    store.events.append(sid, "user_message", {"text": "hello?"}, writer="cli")
    assert store.sessions.get(sid).status == "quarantined"
    assert store.sessions.release(sid, "bob")
    info = store.sessions.get(sid)
    assert (info.status, info.quarantined_at, info.quarantine_reason) == ("open", None, None)
    assert (info.active_turn_id, info.attempt_turn_id, info.attempt_count) == (None, None, 0)
    notice = store.events.read(sid)[-1]
    assert (notice.type, notice.turn_id, notice.payload["reason"]) == ("notice", "t1", "released")
    assert "bob" in notice.payload["text"] and "not be retried" in notice.payload["text"]
    # Nothing can continue t1; the message sent meanwhile drives a new turn.
    assert store.sessions.charge_attempt(sid, "t1") is None
    assert [s.id for s in store.sessions.with_work()] == [sid] and info.pending
    assert not store.sessions.release(sid, "bob")  # not quarantined (any more)
    with pytest.raises(SessionNotFound):
        store.sessions.release("0" * 32)


def test_release_ends_a_poisoned_turn_that_is_still_active_as_failed(store: Store) -> None:
    sid = store.sessions.create("alice").id
    lease = store.leases.acquire(sid, "w1", 30)
    assert lease is not None
    store.events.append(sid, "user_message", {"text": "/crash"}, writer="intake")
    store.events.append(sid, "turn_started", {}, token=lease.token, turn_id="t1")
    store.sessions.charge_attempt(sid, "t1")
    # Quarantined with its turn left active (by an earlier version, or by hand).
    Session.update(status="quarantined").where(Session.id == sid).execute()
    assert store.sessions.release(sid)
    *_, ended, notice = store.events.read(sid)
    assert (ended.type, ended.turn_id) == ("turn_ended", "t1")
    assert ended.payload == {"outcome": "failed", "reason": "released"}
    assert (notice.type, notice.turn_id) == ("notice", "t1")
    info = store.sessions.get(sid)
    assert (info.status, info.active_turn_id, info.attempt_count) == ("open", None, 0)
    assert info.lease_token > lease.token and info.owner is None
    assert store.sessions.charge_attempt(sid, "t1") is None  # never continued
    assert sid not in {s.id for s in store.sessions.with_work()}  # nothing to run


def test_a_batch_of_sessions_is_read_as_each_would_be_alone(store: Store) -> None:
    """What a worker reads first of the sessions one `assign` hands it: the rows with their
    newest compaction, then the logs from there on, in one query each, as `get`,
    `last_of` and `read` give them one session at a time."""
    plain, compacted, idle = (store.sessions.create("alice").id for _ in range(3))
    for sid in (plain, compacted):
        store.events.append(sid, "user_message", {"text": f"hi {sid}"}, writer="intake")
        store.events.append(sid, "turn_started", {"read_to": 1}, turn_id="t1")
    old = {"summary": "old", "to_seq": 1, "method": "model"}
    store.events.append(compacted, "compaction", old, turn_id="t1")
    store.events.append(compacted, "user_message", {"text": "more"}, writer="intake")
    newest = {"summary": "newer", "to_seq": 3, "method": "model"}
    store.events.append(compacted, "compaction", newest, turn_id="t1")
    wanted = [plain, compacted, idle, "no-such-session"]

    opened = store.sessions.opening(wanted)
    assert set(opened) == {plain, compacted, idle}
    for sid, (info, compaction) in opened.items():
        assert info == store.sessions.get(sid)
        last = store.events.last_of(sid, "compaction")
        assert compaction == (None if last is None else last.payload)
    assert opened[compacted][1] == newest

    after = {plain: 0, compacted: 3, idle: 0}
    logs = store.events.logs(after)
    assert logs == {sid: store.events.read(sid, n, 1_000) for sid, n in after.items()}
    assert [e.seq for e in logs[compacted]] == [4, 5]
    assert logs[idle] == []
