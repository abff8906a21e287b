"""The host registry and the claims several daemons make on one database, run alike on
SQLite, PostgreSQL and MariaDB: one holder per host id, renewal and fencing, leases taken
only by compare-and-set, and each host's child rows its own."""

from __future__ import annotations

import time

import pytest

from supervisor.store import Grant, HostTaken, Me, ReplayedSeq, SingleHost, Store
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

TTL = 30.0


def me(host: str, boot: str, pid: int = 4242) -> Me:
    return Me(host, boot, "machine-1", "m" * 32, pid, 1000.0, "test")


def test_a_live_host_id_is_refused_to_a_second_daemon_naming_the_first(store: Store) -> None:
    assert store.hosts.register(me("host-a", "boot-1"), TTL, gone=lambda h: False) is None
    with pytest.raises(HostTaken) as refused:
        store.hosts.register(me("host-a", "boot-2", pid=99), TTL, gone=lambda h: False)
    message = str(refused.value)
    assert message.startswith("daemon.host_id 'host-a' is held by a live turnkeeper")
    assert "pid 4242 on machine-1" in message and "boot boot-1" in message
    # A holder that is gone (a crash on this machine a moment ago) is taken over at once.
    before = store.hosts.register(me("host-a", "boot-2", pid=99), TTL, gone=lambda h: True)
    assert before is not None and before.boot_id == "boot-1"
    [row] = store.hosts.all()
    assert (row.boot_id, row.pid, row.state) == ("boot-2", 99, "live")


def test_a_renewal_says_how_long_the_row_had_run_out_or_that_another_boot_has_it(
    store: Store,
) -> None:
    store.hosts.register(me("host-a", "boot-1"), 0.2, gone=lambda h: False)
    assert store.hosts.renew("host-a", "boot-1", 0.2) == 0.0
    time.sleep(0.5)  # paused past its time to live
    assert [h.state for h in store.hosts.all()] == ["lost"]
    overdue = store.hosts.renew("host-a", "boot-1", TTL)
    assert overdue is not None and overdue >= 0.25
    assert [h.state for h in store.hosts.all()] == ["live"]
    # A row that ran out is anyone's: a daemon with the same id took it while this one
    # was away, and this one's next renewal finds itself fenced out.
    store.hosts.renew("host-a", "boot-1", 0.1)
    time.sleep(0.3)
    store.hosts.register(me("host-a", "boot-2"), TTL, gone=lambda h: False)
    assert store.hosts.renew("host-a", "boot-1", TTL) is None
    assert store.hosts.renew("host-a", "boot-2", TTL) == 0.0


def test_leaving_lets_this_boots_leases_run_out_and_no_one_elses(store: Store) -> None:
    store.hosts.register(me("host-a", "boot-1"), TTL, gone=lambda h: False)
    ours = store.sessions.create("admin").id
    theirs = store.sessions.create("admin").id
    store.leases.grant(
        [Grant(ours, "host-a/boot-1/w0.1"), Grant(theirs, "host-b/boot-9/w0.1")], TTL
    )
    assert store.hosts.owned() == {"host-a": 1, "host-b": 1}
    assert store.hosts.leave("host-a", "boot-1", "host-a/boot-1") == 1
    assert store.leases.holder(ours) is None
    assert store.leases.holder(theirs) is not None
    assert [h.state for h in store.hosts.all()] == ["left"]


def test_a_grant_is_a_claim_on_the_token_it_was_planned_on(store: Store) -> None:
    sid = store.sessions.create("admin").id
    [first] = store.leases.grant([Grant(sid, "host-a/boot-1/w0.1", expect=0)], TTL, "host-a/")
    assert first.lease is not None and first.lease.token == 1
    # Another daemon planned on the same read (token 0): it lost the race.
    [late] = store.leases.grant([Grant(sid, "host-b/boot-2/w0.1", expect=0)], TTL, "host-b/")
    assert late.lease is None and late.raced
    # On a fresh read (token 1) it still may not take host-a's live lease...
    [live] = store.leases.grant([Grant(sid, "host-b/boot-2/w0.1", expect=1)], TTL, "host-b/")
    assert live.lease is None and live.raced
    # ...but host-a's own daemon may move it between its workers, and once it ran out,
    # anyone may take it.
    [moved] = store.leases.grant([Grant(sid, "host-a/boot-1/w1.1", expect=1)], 0.1, "host-a/")
    assert moved.lease is not None and moved.lease.token == 2
    time.sleep(0.3)
    [adopted] = store.leases.grant([Grant(sid, "host-b/boot-2/w0.1", expect=2)], TTL, "host-b/")
    assert adopted.lease is not None and adopted.lease.token == 3


def test_a_batch_grant_judges_each_lease_as_it_would_alone(store: Store) -> None:
    """One transaction, three statements whatever the batch: each grant still gets its own
    answer, in order, and only the ones it names are taken."""
    (free, other, charged, moved, closed, lost, twice) = [
        store.sessions.create("admin").id for _ in range(7)
    ]
    store.leases.grant([Grant(other, "host-b/boot-2/w0.1")], TTL)  # host-b's, live
    for sid in (charged, moved):
        store.events.append(sid, "user_message", {"text": "hi"}, writer="intake")
        store.events.append(sid, "turn_started", {}, turn_id=f"t-{sid}", writer="worker")
    store.sessions.close(closed, "admin")
    tokens = {
        sid: info.lease_token for sid, info in store.sessions.many([free, other, lost]).items()
    }
    batch = [
        Grant(free, "host-a/boot-1/w0.1", expect=tokens[free]),
        Grant(other, "host-a/boot-1/w0.1", expect=tokens[other]),  # not ours to take
        Grant(charged, "host-a/boot-1/w1.1", charge=f"t-{charged}", expect=0),
        Grant(moved, "host-a/boot-1/w1.1", charge="an-older-turn", expect=0),
        Grant(closed, "host-a/boot-1/w0.1"),
        Grant(lost, "host-a/boot-1/w0.1", expect=tokens[lost] + 1),  # planned on a later read
        Grant(twice, "host-a/boot-1/w0.1", expect=0),
        Grant(twice, "host-a/boot-1/w1.1", expect=0),
        Grant("no-such-session", "host-a/boot-1/w0.1"),
    ]
    results = store.leases.grant(batch, TTL, "host-a/")
    answers = [(r.lease is not None, r.attempts, r.moved_on, r.raced) for r in results]
    assert answers == [
        (True, None, False, False),
        (False, None, False, True),
        (True, 2, False, False),  # the turn's first run was attempt 1
        (False, None, True, False),
        (False, None, False, False),
        (False, None, False, True),
        (True, None, False, False),
        (False, None, False, True),  # the first grant of it took it
        (False, None, False, False),
    ]
    rows = store.sessions.many([free, other, charged, moved, twice])
    for result in results:
        if result.lease is not None:
            row = rows[result.lease.session_id]
            assert (row.owner, row.lease_token) == (result.lease.owner, result.lease.token)
            assert result.lease.expires_at == row.lease_expires_at
    assert rows[other].owner == "host-b/boot-2/w0.1" and rows[other].lease_token == 1
    assert (rows[charged].attempt_turn_id, rows[charged].attempt_count) == (f"t-{charged}", 2)
    assert rows[moved].owner is None and rows[moved].attempt_count == 1
    assert rows[twice].owner == "host-a/boot-1/w0.1" and rows[twice].lease_token == 1


def test_a_workers_renewal_stops_when_its_hosts_row_runs_out(store: Store) -> None:
    sid = store.sessions.create("admin").id
    owner = "host-a/boot-1/w0.1"
    store.leases.grant([Grant(sid, owner)], TTL)
    host = ("host-a", "boot-1")
    assert store.leases.renew_owner(owner, TTL, host) == 1  # no row: a worker run alone
    store.hosts.register(me("host-a", "boot-1"), 0.2, gone=lambda h: False)
    assert store.leases.renew_owner(owner, TTL, host) == 1
    time.sleep(0.4)  # the supervisor stopped renewing the host row (hung, paused)
    assert store.leases.renew_owner(owner, TTL, host) == 0
    store.hosts.renew("host-a", "boot-1", TTL)
    assert store.leases.renew_owner(owner, TTL, host) == 1
    store.hosts.register(me("host-a", "boot-2"), TTL, gone=lambda h: True)  # taken over
    assert store.leases.renew_owner(owner, TTL, host) == 0


def test_a_hosts_sweep_sees_its_own_children_only(store: Store) -> None:
    store.boots.begin("old-hostname", 1, "v", boot_id="legacy-boot")
    legacy = store.children.record("legacy-boot", 11, 1.0, "worker")  # before hosts were
    mine = store.children.record("boot-1", 12, 1.0, "worker", host="host-a")
    store.children.record("boot-2", 13, 1.0, "mcp", host="host-b")
    store.children.record("boot-now", 14, 1.0, "worker", host="host-a")
    found = store.children.of_other_boots("boot-now", "host-a", ("old-hostname",))
    assert sorted(c.id for c in found) == sorted([legacy, mine])
    assert [c.pid for c in store.children.of_other_boots("boot-now", "host-b")] == [13]
    assert len(store.children.of_other_boots("boot-now")) == 3  # SQLite: one host, all


def test_sqlite_serves_one_host(store: Store) -> None:
    store.hosts.register(me("host-a", "boot-1"), TTL, gone=lambda h: False, single=True)
    if store.backend != "sqlite":
        store.hosts.register(me("host-b", "boot-2"), TTL, gone=lambda h: False)
        return
    with pytest.raises(SingleHost, match=r"store.url is a SQLite database, which serves one"):
        store.hosts.register(me("host-b", "boot-2"), TTL, gone=lambda h: False, single=True)
    # The other daemon is gone (a crash here a moment ago): another id may start.
    store.hosts.register(me("host-b", "boot-2"), TTL, gone=lambda h: True, single=True)


def test_hosts_gone_long_ago_are_forgotten(store: Store) -> None:
    store.hosts.register(me("host-a", "boot-1"), 0.1, gone=lambda h: False)
    store.hosts.register(me("host-b", "boot-2"), TTL, gone=lambda h: False)
    time.sleep(0.3)
    assert store.hosts.prune(60.0) == 0  # gone, but not for long
    assert store.hosts.prune(0.1) == 1
    assert [h.host_id for h in store.hosts.all()] == ["host-b"]


def test_a_late_judgement_neither_charges_nor_ends_a_turn_another_daemon_moved_on(
    store: Store,
) -> None:
    sid = store.sessions.create("admin").id
    [first] = store.leases.grant([Grant(sid, "host-a/boot-1/w0.1")], TTL)
    assert first.lease is not None
    lease = first.lease
    store.events.append(sid, "user_message", {"text": "hi"}, writer="intake")
    store.events.append(sid, "turn_started", {}, turn_id="t1", token=lease.token, writer="worker")
    judged = store.sessions.get(sid)  # what host-b read and judged: turn t1, token 1
    assert (judged.active_turn_id, judged.lease_token) == ("t1", 1)
    # Meanwhile the worker ended t1 (its lease was still good): a charge of t1 is no claim.
    store.events.append(
        sid, "turn_ended", {"outcome": "completed"}, turn_id="t1", token=lease.token,
        writer="worker",
    )  # fmt: skip
    [late] = store.leases.grant(
        [Grant(sid, "host-b/boot-2/w0.1", charge="t1", expect=1)], TTL, "host-b/"
    )
    assert late.lease is None and store.sessions.get(sid).attempt_count == 0
    # And a turn someone leased since it was judged is not ended under its new owner.
    store.events.append(
        sid, "turn_started", {}, turn_id="t2", token=lease.token, writer="worker"
    )  # fmt: skip
    store.leases.grant([Grant(sid, "host-c/boot-3/w0.1", expect=1)], TTL)  # token 2
    assert not store.sessions.finalize(sid, "t2", "resend", "stale", token=1)
    assert store.sessions.get(sid).active_turn_id == "t2"
    assert store.sessions.finalize(sid, "t2", "resend", "stale", token=2)


def test_a_runs_next_prompt_and_a_resume_after_the_same_checkpoint_append_one(
    store: Store,
) -> None:
    """The worker's prompt after a checkpoint and recovery's resume of the run (another
    daemon's scan at the same moment) share a key: whichever comes second appends nothing."""
    sid = store.sessions.create("admin").id
    at = store.events.append(sid, "checkpoint", {"turns": 1, "stop_reason": None}, writer="worker")
    key = f"autonomous-resume:{at}"
    first = store.events.append(
        sid, "user_message", {"text": "go on", "autonomous": True}, writer="worker",
        idempotency_key=key,
    )  # fmt: skip
    second = store.events.append(
        sid, "user_message", {"text": "go on", "autonomous": True, "resumed": True},
        writer="supervisor", idempotency_key=key,
    )  # fmt: skip
    assert isinstance(second, ReplayedSeq) and second == first
    assert [e.type for e in store.events.read(sid)] == ["checkpoint", "user_message"]
