"""Several daemons on one database: a lost host's turns go on elsewhere, once.

Real daemons (`tests.cluster.Cluster`: host-a, host-b, ... with `lease.stale_after` =
STALE_AFTER) on one PostgreSQL schema or MariaDB database, real signals, and the
database read afterwards. Turns are held in flight by `/gate` until the test opens the
gate, so what a host held when it was lost is known exactly:
- a SIGKILLed host's sessions are leased by the others within STALE_AFTER + 2 s, spread
  over them, and every turn ends exactly once with one `host_lost` continuation;
- a host paused past STALE_AFTER loses its sessions to the others, and when it comes
  back it keeps running, drops them, and writes nothing with its old leases;
- a host paused past its hang timeout (but not its stale time) takes the pause for no
  hang of its workers: they and their turns go on;
- a restarted host's boot sweep leaves every other host's processes and rows alone;
- a second live daemon with the same `daemon.host_id` refuses to start (exit 78), but a
  restart right after a crash takes its own id over;
- a clean stop hands the leases back: the others adopt at once.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import EventRecord
from tests.cluster import STALE_AFTER, Cluster
from tests.conftest import CLUSTER_WAIT
from tests.daemon import Daemon, wait_until

# One cluster at a time on the machine (conftest.CLUSTER_LOCK); each timeout has the wait.
pytestmark = [pytest.mark.usefixtures("cluster_turn"), pytest.mark.xdist_group("cluster")]

WAIT_S = 60.0  # a bound on waiting for what must happen, not a measure of speed
# The bound on adoption after a host is lost: its leases run out (STALE_AFTER
# after their last renewal), then a survivor takes each one, at once or ADOPT_GRACE later.
ADOPT_BOUND = STALE_AFTER + 2.0
# Polling the database from this process adds its own delay to every figure measured
# here (a read of every session each round, on a machine busy with the daemons): one
# second on top of the bound, never more.
MEASURE_SLACK = 1.0
EX_CONFIG = 78
# One worker and no spare per daemon where the test is not about the pool: fewer processes
# to start on a machine that runs three daemons per test.
SMALL = {"workers": 1, "spare": 0, "heartbeat_interval": 0.2, "hang_timeout": 5.0}


@pytest.fixture
def clusters(tmp_path: Path, db_url: str) -> Iterator[Callable[..., Cluster]]:
    """Start clusters on this test's database; every daemon is killed at the end."""
    made: list[Cluster] = []

    def make(n: int = 3, **sections: dict[str, Any]) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(made)}", db_url, n, **sections)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.close()


def spread(cluster: Cluster, count: int, gate: Path) -> dict[str, str]:
    """`count` sessions, each with a turn held in flight by `gate`, created and sent
    round-robin through the daemons' APIs; the host owning each, once all are in flight."""
    hosts = list(cluster.daemons)
    clients = {host: cluster[host].client() for host in hosts}
    ids: list[str] = []
    try:
        for i in range(count):
            http = clients[hosts[i % len(hosts)]]
            made = http.post("/v1/sessions", json={"title": f"s{i}"})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            sent = http.post(f"/v1/sessions/{sid}/inject", json={"text": f"/gate {gate} s{i}"})
            assert sent.status_code == 202, sent.text
            ids.append(sid)
    finally:
        for http in clients.values():
            http.close()

    def in_flight() -> dict[str, str] | None:
        infos = cluster.store.sessions.some(ids)
        if len(infos) < count or not all(i.active_turn_id and i.owner for i in infos):
            return None
        return {i.id: str(i.owner).split("/", 1)[0] for i in infos}

    owners: dict[str, str] = wait_until(in_flight, WAIT_S, "every turn to be in flight")
    return {sid: owners[sid] for sid in ids}


def adoption(cluster: Cluster, lost: list[str], gone: str, since: float) -> dict[str, float]:
    """Seconds from `since` (monotonic) until each of `lost` was leased by a host other
    than `gone`, polling the database."""
    adopted: dict[str, float] = {}
    deadline = since + WAIT_S
    while len(adopted) < len(lost):
        waiting = [sid for sid in lost if sid not in adopted]
        owners = cluster.owners(waiting)
        now = time.monotonic()
        for sid, host in owners.items():
            if host is not None and host != gone:
                adopted[sid] = now - since
        if now > deadline:
            pytest.fail(f"{len(waiting)} sessions of {gone} not adopted after {WAIT_S} s")
        time.sleep(0.02)
    return adopted


def settled(cluster: Cluster, ids: list[str]) -> bool:
    """No session has a turn in flight or input waiting."""
    return not cluster.store.sessions.some(ids)


def check_once(events: list[EventRecord], host_lost: bool) -> None:
    """One message, one turn, one answer, one end; a `host_lost` continuation if adopted."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "seqs not contiguous"
    kinds = [e.type for e in events]
    assert kinds.count("user_message") == 1, kinds
    turns = {e.turn_id for e in events if e.turn_id is not None}
    assert len(turns) == 1, kinds
    ended = [e for e in events if e.type == "turn_ended"]
    assert len(ended) == 1, kinds
    assert ended[0].payload["outcome"] == "completed", ended[0].payload
    assert events[-1].type == "turn_ended", kinds
    answers = [e.payload.get("text") for e in events if e.type == "model_response"]
    message = events[0].payload["text"]
    assert answers == [f"echo: {message}"], answers
    notes = [e.payload for e in events if e.type == "continuation"]
    if host_lost:
        assert len(notes) == 1, kinds
        # {"cause", "text", "last_event_at", "attempt"}: the first attempt, saying why.
        assert notes[0]["cause"] == "host_lost", notes[0]
        assert notes[0]["attempt"] == 1 and "another host" in notes[0]["text"], notes[0]
    else:
        assert notes == [], notes


def finish(cluster: Cluster, owners: dict[str, str], adopted: set[str], gate: Path) -> None:
    """Open the gate; every turn ends exactly once, each adopted one after a `host_lost`
    note, and no other session was continued at all."""
    gate.touch()
    ids = list(owners)
    wait_until(lambda: settled(cluster, ids), WAIT_S, "every turn to end")
    for sid in ids:
        check_once(cluster.events(sid), sid in adopted)


@pytest.mark.timeout(150 + CLUSTER_WAIT)
@pytest.mark.parametrize(
    ("db_url", "hosts", "count"),
    [("postgresql", 3, 30), ("mysql", 2, 6)],  # MariaDB: wakes poll, no LISTEN/NOTIFY
    indirect=["db_url"],
)
def test_a_killed_hosts_turns_are_adopted_in_time_spread_and_finished_once(
    clusters: Callable[..., Cluster], tmp_path: Path, hosts: int, count: int
) -> None:
    cluster = clusters(hosts)
    gate = tmp_path / "gate"
    owners = spread(cluster, count, gate)
    by_host = {host: [sid for sid, h in owners.items() if h == host] for host in cluster.daemons}
    assert all(by_host.values()), f"some daemon owns nothing: {by_host}"
    gone = "host-a"
    lost = by_host[gone]

    killed = time.monotonic()
    cluster.kill(gone)
    delays = adoption(cluster, lost, gone, killed)
    worst = max(delays.values())
    print(
        f"\nadoption after SIGKILL ({cluster.store.backend}, {len(lost)} sessions): "
        f"first {min(delays.values()):.2f} s, last {worst:.2f} s (bound {ADOPT_BOUND:.1f} s)"
    )
    assert worst <= ADOPT_BOUND + MEASURE_SLACK, delays

    now = cluster.owners(owners)
    adopters = {now[sid] for sid in lost}
    assert adopters == set(cluster.daemons) - {gone}, f"not spread over the survivors: {now}"
    # The survivors' own sessions stayed where they were.
    assert all(now[sid] == host for sid, host in owners.items() if host != gone), now
    finish(cluster, owners, set(lost), gate)


@pytest.mark.timeout(150 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_paused_host_is_fenced_when_it_comes_back_and_keeps_running(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    # A hang check slower than the pause: fencing alone is what this test watches (the
    # hang check after a pause is the next test's).
    cluster = clusters(3, pool={**SMALL, "hang_timeout": 30.0})
    gate = tmp_path / "gate"
    owners = spread(cluster, 9, gate)
    gone = "host-b"
    lost = [sid for sid, host in owners.items() if host == gone]
    assert lost, owners
    tokens = {sid: cluster.store.sessions.get(sid).lease_token for sid in lost}
    daemon = cluster[gone]
    mark = len(daemon.log())
    workers = {(p.pid, p.create_time()) for p in daemon.live_workers()}
    assert workers, "host-b runs no worker"

    paused = time.monotonic()
    stopped = cluster.pause(gone)
    try:
        delays = adoption(cluster, lost, gone, paused)
        print(f"\nadoption of a paused host's {len(lost)} sessions: {max(delays.values()):.2f} s")
        assert max(delays.values()) <= ADOPT_BOUND + MEASURE_SLACK, delays
        adopted = {sid: cluster.store.sessions.get(sid).lease_token for sid in lost}
        assert all(adopted[sid] > tokens[sid] for sid in lost), (tokens, adopted)
        # Paused well past its stale time, as a VM that was frozen.
        time.sleep(max(0.0, paused + STALE_AFTER + 3.0 - time.monotonic()))
    finally:
        cluster.resume(stopped)

    # Back, it sees the others took its sessions, drops them and keeps running.
    said = "another daemon took the session from"
    wait_until(
        lambda: daemon.log()[mark:].count(said) >= len(lost), WAIT_S, f"{said!r} x {len(lost)}"
    )
    log = daemon.log()[mark:]
    assert "this host was away" in log, log
    assert daemon.proc is not None and daemon.proc.poll() is None, log
    assert daemon.ready(), log
    assert daemon.status()["hosts"], "the resumed daemon does not serve its status"

    finish(cluster, owners, set(lost), gate)
    assert gone not in cluster.owners(lost).values()
    for sid in lost:
        events = cluster.events(sid)
        note = next(e for e in events if e.type == "continuation")
        assert note.lease_token == adopted[sid], (note, adopted[sid])
        # Nothing written with the paused host's lease once the adopter wrote.
        late = [e for e in events if e.seq > note.seq and (e.lease_token or 0) < adopted[sid]]
        assert late == [], late
        assert all(e.lease_token in (None, tokens[sid]) for e in events if e.seq < note.seq)
    # Its workers were paused with it, not hung: they are told to stop the taken sessions'
    # turns and go on serving (a hang check that counted the pause would abort them all).
    now = {(p.pid, p.create_time()) for p in daemon.live_workers()}
    assert workers <= now, f"the resumed host lost its workers: {daemon.log()[mark:]}"


@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_host_paused_past_its_hang_timeout_keeps_its_workers_and_turns(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    hang = 2.0
    cluster = clusters(1, lease={"stale_after": 60.0}, pool={**SMALL, "hang_timeout": hang})
    gate = tmp_path / "gate"
    owners = spread(cluster, 2, gate)
    daemon = cluster["host-a"]
    mark = len(daemon.log())
    workers = {(p.pid, p.create_time()) for p in daemon.live_workers()}
    assert workers, "host-a runs no worker"

    # The whole host frozen (a VM paused) for longer than pool.hang_timeout, but not for
    # lease.stale_after: nobody adopts anything, and nothing was hung. After a freeze the
    # processes wake in any order; here the daemon first, its workers a moment later.
    stopped = cluster.pause("host-a")
    time.sleep(hang + 1.5)
    cluster.resume(stopped[:1])
    time.sleep(0.5)
    cluster.resume(stopped[1:])
    assert daemon.status()["slots"], "the resumed daemon does not serve its status"

    finish(cluster, owners, set(), gate)
    log = daemon.log()[mark:]
    assert "hung; aborting it" not in log, log
    now = {(p.pid, p.create_time()) for p in daemon.live_workers()}
    assert workers <= now, f"the paused host's workers were replaced: {log}"


@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_restarted_hosts_sweep_leaves_the_other_hosts_alone(
    clusters: Callable[..., Cluster],
) -> None:
    cluster = clusters(3, pool=SMALL)
    wait_until(lambda: all(cluster.children(h) for h in cluster.daemons), WAIT_S, "child rows")
    others = {
        host: ({(p.pid, p.create_time()) for p in cluster.processes(host)}, cluster.children(host))
        for host in ("host-a", "host-b")
    }
    for host, (procs, rows) in others.items():
        assert len(procs) >= 2 and rows, (host, procs, rows)  # the daemon and its worker
        assert {(r.pid, r.create_time) for r in rows} <= procs, (host, rows, procs)
    before = cluster.children("host-c")
    assert before, "host-c recorded no children"

    restarted = cluster["host-c"]
    cluster.kill("host-c")
    restarted.start()
    assert "swept" in restarted.log().split(f"--- run {restarted.runs} ---")[-1]

    for host, (procs, rows) in others.items():
        now = {(p.pid, p.create_time()) for p in cluster.processes(host)}
        assert procs <= now, f"{host} lost processes to host-c's sweep: {procs - now}"
        assert {r.id for r in rows} <= {r.id for r in cluster.children(host)}, host
    left = {r.id for r in before} & {r.id for r in cluster.children("host-c")}
    assert not left, f"host-c's earlier rows were not swept: {left}"


@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_host_id_is_held_by_one_live_daemon_and_taken_back_after_a_crash(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    # A stale time no restart on a busy machine outlasts: the row is live when it comes back.
    cluster = clusters(1, lease={"stale_after": 60.0}, pool=SMALL)
    first = cluster["host-a"]
    # Its own state dir, runtime dir and socket; the same database and host id.
    shared = {k: v for k, v in first.config.items() if k not in ("daemon", "http")}
    twin = Daemon(tmp_path / "twin", daemon={"host_id": "host-a"}, **shared)
    try:
        started = time.monotonic()
        twin.start(wait=False)
        assert twin.proc is not None
        code = twin.proc.wait(timeout=WAIT_S)
        took = time.monotonic() - started
        log = twin.log()
        print(f"\nthe second daemon with host id host-a exited {code} after {took:.2f} s")
        assert code == EX_CONFIG, log
        assert took < 15.0, log
        assert "daemon.host_id" in log, log
        assert f"pid {first.pid} on {socket.gethostname()}" in log, log
        assert first.ready(), "the first daemon suffered from the second's start"
    finally:
        twin.kill_everything()

    crashed = first.pid
    cluster.kill("host-a")
    first.start()  # at once: the row still names the dead pid as live
    log = first.log().split(f"--- run {first.runs} ---")[-1]
    assert "[hosts] host id host-a" in log, log
    assert f"took over host id host-a from pid {crashed}" in log, log
    (row,) = cluster.store.hosts.all()
    assert row.pid == first.pid and row.live, row


@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_clean_stop_hands_its_turns_to_the_others_at_once(
    clusters: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = clusters(3, pool=SMALL)
    gate = tmp_path / "gate"
    owners = spread(cluster, 6, gate)
    gone = "host-c"
    lost = [sid for sid, host in owners.items() if host == gone]
    assert lost, owners
    daemon = cluster[gone]

    stopped = time.monotonic()
    daemon.signal(signal.SIGTERM)
    delays = adoption(cluster, lost, gone, stopped)
    assert daemon.wait(WAIT_S) == 0, daemon.log()
    worst = max(delays.values())
    print(f"\nadoption after SIGTERM ({len(lost)} sessions): {worst:.2f} s")
    assert "leases handed back" in daemon.log(), daemon.log()
    assert worst <= 2.0 + MEASURE_SLACK, delays
    finish(cluster, owners, set(lost), gate)


@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql", "mysql"], indirect=True)
def test_input_sent_to_one_host_runs_on_the_worker_of_the_host_that_owns_the_session(
    clusters: Callable[..., Cluster],
) -> None:
    """The owner keeps its session: another daemon's intake only wakes it (PostgreSQL:
    NOTIFY; MariaDB: the owner's probe of pending sessions)."""
    cluster = clusters(2, pool=SMALL)
    with cluster["host-a"].client() as a, cluster["host-b"].client() as b:
        sid = a.post("/v1/sessions", json={"title": "owned by a"}).json()["id"]
        assert a.post(f"/v1/sessions/{sid}/inject", json={"text": "first"}).status_code == 202
        wait_until(lambda: settled(cluster, [sid]), WAIT_S, "the first turn")
        # A new session has no owner yet: whichever daemon's pass sees its input first
        # takes it (host-a's, nearly always; host-b's probe on a busy machine). The input
        # that follows goes through the other one.
        owner = cluster.store.sessions.get(sid).owner
        assert owner is not None and owner.split("/")[0] in ("host-a", "host-b"), owner
        other = b if owner.startswith("host-a/") else a
        delays = []
        for i in range(5):
            sent = time.monotonic()
            answer = other.post(f"/v1/sessions/{sid}/inject", json={"text": f"via b {i}"})
            assert answer.status_code == 202, answer.text
            wait_until(lambda: settled(cluster, [sid]), WAIT_S, "the turn sent through host-b")
            delays.append(time.monotonic() - sent)
    info = cluster.store.sessions.get(sid)
    assert info.owner == owner, "the session moved instead of waking its owner"
    replies = [e.payload["text"] for e in cluster.events(sid) if e.type == "model_response"]
    assert replies == ["echo: first", *(f"echo: via b {i}" for i in range(5))], replies
    print(f"\ninject on one host -> turn ended on the other ({cluster.store.backend}): {delays}")
