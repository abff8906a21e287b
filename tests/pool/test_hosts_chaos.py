"""Chaos across hosts: three daemons on one PostgreSQL schema, killed while a client injects.

Three daemons (`tests.cluster.Cluster`: host-a, host-b, host-c, lease.stale_after 4 s)
serve 12 sessions. One thread injects messages into random sessions, each with its own
Idempotency-Key, through the daemons' APIs in turn (`tests.pool.test_chaos.Injector`'s retry
loop). A request that meets a connection error or a 503 (the daemon it went to was
killed, or is booting again) goes again, with the same key and body, to the next daemon.
Some accepted keys are sent again on purpose to another daemon (the answer must name the
same seq, replayed), a few with another body under the same key (refused with 409).

Meanwhile the test SIGKILLs each daemon once, while it is reading a request (its body
half sent: the client sees the connection break and sends it to the next daemon), and
SIGKILLs a worker of a live daemon a few times, one that runs a turn when there is one.
A watcher notes when each session a killed daemon had work for is owned again: by another
host, within ADOPT_BOUND, once its lease ran out. Then the killed daemon is started again
on its state dir and host id.

At the end every session must come to rest and every daemon stop cleanly; then the
database must show that every accepted key is in the log once, at the seq its 202 named
(the intake keys table agrees); that every message got a reply, or a notice asking the
user to send it again (`tests.pool.test_chaos.judge`: no reply twice, one `turn_ended` per
turn and no work after it, contiguous seqs); that every user message was read by a turn
that ended; and that each session's worker writes carry non-decreasing lease tokens (no
write of an owner after its successor's: fencing).

The seed is printed; TURNKEEPER_HOSTS_CHAOS_SEED=N reruns the same plan. The figures are
printed as JSON (`pytest -s`) and are part of every assertion's message.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import psutil
import pytest

from supervisor.core.adoption import ADOPT_GRACE
from supervisor.store import Store
from supervisor.store.events import scoped_key
from tests.cluster import STALE_AFTER, Cluster
from tests.conftest import CLUSTER_WAIT
from tests.daemon import Daemon, wait_until
from tests.pool.test_chaos import RESEND, Injector, Message, judge, ready_workers, wait_ready

SEED = int(os.environ.get("TURNKEEPER_HOSTS_CHAOS_SEED", "20261201"))
SESSIONS = 12
WORKER_KILLS = 5  # and one SIGKILL of each daemon, in a random order between them
PAUSE = (0.8, 2.0)  # seconds between kills
REDELIVER = 0.25  # the share of accepted keys sent again, to another daemon
CONFLICT = 0.05  # the share sent again under the same key with another body
POLL = 0.05  # the watcher's period
QUIET_TIMEOUT = 45.0  # at the end: every session at rest
STOP_TIMEOUT = 20.0
GIVE_UP = 30.0  # once stopped, how long the request in hand is still retried
ADMIN = "admin"  # every daemon's admin token speaks for this principal
POOL = {"workers": 1, "spare": 1}  # 6 workers on the machine rather than 9: boots are CPU-bound
MODEL_DELAY = 0.5  # seconds added to every echo model call: a kill often finds turns in flight
# A killed daemon's sessions must be owned by another host this soon: its leases run out
# STALE_AFTER after their last renewal, then a survivor takes each, at once or ADOPT_GRACE
# later; the rest is slack for a loaded machine (the target, +2 s, is measured by
# tests/benchmarks/bench_hosts.py).
ADOPT_BOUND = STALE_AFTER + ADOPT_GRACE + 3.0


@dataclass
class Held(Message):
    """A message whose turn waits until `gate` exists (`/gate` of tests.agents.ChaosAgent)."""

    gate: str = ""

    @property
    def text(self) -> str:
        return f"/gate {self.gate} {self.n}"

    @property
    def reply(self) -> str:
        return f"echo: {self.text}"


class Rotation:
    """What `Injector._deliver` posts through here: the daemons' clients in turn. Each
    request goes to the current daemon; after a connection error or a 503 the next goes to
    the next daemon (this one was killed, or is booting again)."""

    def __init__(self, clients: list[httpx.Client], start: int) -> None:
        self.clients = clients
        self.at = start
        self.moved = 0  # times a request went to the next daemon after a failure
        self.last: httpx.Response | None = None  # the last answer

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        self.last = None
        try:
            answer = self.clients[self.at % len(self.clients)].post(url, **kwargs)
        except httpx.TransportError:
            self.at, self.moved = self.at + 1, self.moved + 1
            raise
        if answer.status_code == 503:
            self.at, self.moved = self.at + 1, self.moved + 1
        self.last = answer
        return answer


@dataclass
class Spread(Injector):
    """`tests.pool.test_chaos.Injector` across hosts: injects into random sessions through the
    daemons of `hosts` in turn until stopped (`daemon` is the first one)."""

    hosts: dict[str, Daemon] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)  # what the keys came to
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        clients = [daemon.client() for daemon in self.hosts.values()]
        open_sessions = list(self.sessions)
        try:
            while not self.stop.is_set() and open_sessions:
                kind = self.rng.choices(["plain", "slow"], [3, 2])[0]
                message = self._new(self.rng.choice(open_sessions), kind)
                self._send(Rotation(clients, message.n), message)
                if message.status == 202:
                    self._again(Rotation(clients, message.n + 1), message)
                if message.status == 409:  # quarantined
                    open_sessions.remove(message.session)
                time.sleep(self.rng.uniform(0.05, 0.2))
        finally:
            for client in clients:
                client.close()

    def cut(self, host: str, session: str, kill: Callable[[], None]) -> None:
        """Send `host` a message whose body is half sent when `kill` runs (the daemon dies
        with the request in flight); the broken request goes again, with the same key and
        body, to the next daemon."""
        message = self._new(session, "plain")
        clients = [daemon.client() for daemon in self.hosts.values()]
        first = list(self.hosts).index(host)
        body = json.dumps({"text": message.text}).encode()
        begun, killed = threading.Event(), threading.Event()

        def halves() -> Iterator[bytes]:
            yield body[:5]
            begun.set()
            killed.wait(30)
            yield body[5:]

        def send() -> None:
            message.tries += 1
            try:
                clients[first].post(
                    f"/v1/sessions/{session}/inject",
                    content=halves(),
                    headers={"Idempotency-Key": message.key},
                )
                self.unexpected.append(f"message {message.n}: answered by a daemon killed")
            except httpx.TransportError as exc:
                self.counts[f"cut_by_kill_{type(exc).__name__}"] += 1
                self._send(Rotation(clients, first + 1), message)

        sender = threading.Thread(target=send, name="hosts-cut")
        sender.start()
        begun.wait(10)
        try:
            kill()
        finally:
            killed.set()
            sender.join(GIVE_UP + 10)
            for client in clients:
                client.close()

    def hold(self, host: str, session: str, gate: Path) -> Held:
        """Send `host` a message for `session` whose turn waits for `gate`."""
        message = self._new(session, "held", gate)
        clients = [daemon.client() for daemon in self.hosts.values()]
        try:
            self._send(Rotation(clients, list(self.hosts).index(host)), message)
        finally:
            for client in clients:
                client.close()
        assert isinstance(message, Held)
        return message

    def _new(self, session: str, kind: str, gate: Path | None = None) -> Message:
        with self.lock:
            n = len(self.sent) + 1
            key = f"hosts-{SEED}-{n}"
            message = (
                Message(n, session, kind, key)
                if gate is None
                else Held(n, session, kind, key, gate=str(gate))
            )
            self.sent.append(message)
        return message

    def _send(
        self, rotation: Rotation, message: Message, first: bool = True
    ) -> httpx.Response | None:
        """`Injector._deliver` through the daemons in turn; the final answer. A `first`
        send answered as a replay was committed by a request whose answer was lost."""
        self._deliver(cast(httpx.Client, rotation), message)
        self.counts["sent_again_elsewhere"] += rotation.moved
        if first and rotation.last is not None and _replayed(rotation.last):
            self.counts["replayed_after_error"] += 1
        return rotation.last

    def _again(self, rotation: Rotation, message: Message) -> None:
        """Send an accepted key again, to another daemon: the same body is answered with the
        same seq, replayed; another body (of the other kind) is refused, naming that seq."""
        draw = self.rng.random()
        if draw >= CONFLICT + REDELIVER:
            return
        conflict = draw < CONFLICT
        kind = {"plain": "slow", "slow": "plain"}[message.kind] if conflict else message.kind
        probe = Message(message.n, message.session, kind, message.key)
        answer = self._send(rotation, probe, first=False)
        code = _code(answer)
        if conflict and code == "idempotency_conflict" and _seq(answer) == message.seq:
            self.counts["conflicts_refused"] += 1
        elif not conflict and probe.seq == message.seq and answer and _replayed(answer):
            self.counts["redelivered_replayed"] += 1
        elif code != "quarantined":
            what = "changed" if conflict else "redelivered"
            self.unexpected.append(f"message {message.n} {what}: {_describe(answer)}")


def _replayed(answer: httpx.Response) -> bool:
    return answer.headers.get("Idempotent-Replayed") == "true"


def _code(answer: httpx.Response | None) -> str | None:
    if answer is None or answer.status_code < 400:
        return None
    return str(answer.json().get("error", {}).get("code"))


def _seq(answer: httpx.Response | None) -> int | None:
    if answer is None:
        return None
    body = answer.json()
    seq = body.get("seq", body.get("error", {}).get("seq"))
    return None if seq is None else int(seq)


def _describe(answer: httpx.Response | None) -> str:
    return "no answer" if answer is None else f"{answer.status_code} {answer.text}"


@dataclass
class Kill:
    """One SIGKILL of a daemon, and when each session it had work for was owned again."""

    host: str
    prefix: str  # "<host>/<boot8>/": the lease owners of the boot killed
    at: float  # wall clock
    tracked: dict[str, float | None] | None = None  # session: seconds to its next owner
    by: dict[str, str] = field(default_factory=dict)  # session: the host that owns it now


class Watch:
    """Reads the session table every POLL s in a thread of its own; for each daemon
    killed, notes when each session its boot had work for is owned by another boot."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.kills: list[Kill] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hosts-watch", daemon=True)

    def killed(self, host: str, boot_id: str, at: float) -> Kill:
        kill = Kill(host, f"{host}/{boot_id[:8]}/", at)
        with self.lock:
            self.kills.append(kill)
        return kill

    def late(self) -> list[str]:
        """Sessions of a killed daemon that no other host owned within ADOPT_BOUND."""
        with self.lock:
            return [
                f"{sid} of {k.host} (killed): owned again after {s} s, by {k.by.get(sid)}"
                for k in self.kills
                for sid, s in (k.tracked or {}).items()
                if s is None or s > ADOPT_BOUND or k.by.get(sid) == k.host
            ]

    def run(self) -> None:
        with Store(self.url, migrate=False) as store:
            while not self.stop.wait(POLL):
                rows = store.sessions.list(limit=1_000)
                now = time.time()
                with self.lock:
                    for kill in self.kills:
                        self._look(kill, rows, now)

    @staticmethod
    def _look(kill: Kill, rows: list[Any], now: float) -> None:
        if kill.tracked is None:  # the first look after the kill: what it had work for
            kill.tracked = {
                r.id: None
                for r in rows
                if (r.owner or "").startswith(kill.prefix) and (r.pending or r.active_turn_id)
            }
            return
        for r in rows:
            if r.id not in kill.tracked or kill.tracked[r.id] is not None or not r.owner:
                continue
            if not r.owner.startswith(kill.prefix):
                kill.tracked[r.id] = now - kill.at
                kill.by[r.id] = r.owner.split("/", 1)[0]

    def figures(self) -> dict[str, Any]:
        with self.lock:
            kills = list(self.kills)
        seconds = [s for k in kills for s in _times(k)]
        by = Counter(
            "own_restart" if owner == k.host else "other_host"
            for k in kills
            for owner in k.by.values()
        )
        return {
            "max_s": round(max(seconds), 2) if seconds else None,
            "median_s": round(statistics.median(seconds), 2) if seconds else None,
            "sessions": len(seconds),
            "by": dict(by),
            "not_owned_again": sum(
                1 for k in kills for s in (k.tracked or {}).values() if s is None
            ),
            "per_kill": [
                {
                    "host": k.host,
                    "sessions": len(k.tracked or {}),
                    "max_s": round(max(times), 2) if (times := _times(k)) else None,
                    "by": dict(Counter(k.by.values())),
                }
                for k in kills
            ],
        }


def _times(kill: Kill) -> list[float]:
    return [s for s in (kill.tracked or {}).values() if s is not None]


def hold_a_turn(cluster: Cluster, host: str, injector: Spread, gate: Path) -> str:
    """A new session, made through `host`, with a turn held in flight by `gate`; returned
    once the turn started (on `host`, as a session is run by the daemon it was made on
    unless that one is busy)."""
    with cluster[host].client() as http:
        session = str(http.post("/v1/sessions", json={}).json()["id"])
    message = injector.hold(host, session, gate)

    assert message.status == 202, f"the held turn's message: {message}"
    wait_until(
        lambda: cluster.store.sessions.get(session).active_turn_id, 30, "the held turn to start"
    )
    return session


def kill_daemon(
    cluster: Cluster, host: str, watch: Watch, injector: Spread, session: str, gate: Path
) -> None:
    """SIGKILL the host's daemon (its workers die with it) while it reads a request for
    `session`, and open `gate`; once the other hosts own every session it had work for
    (or ADOPT_BOUND passed), start it again on its state dir."""
    daemon = cluster[host]
    boot = next(h.boot_id for h in cluster.store.hosts.all() if h.host_id == host)
    kills: list[Kill] = []

    def sigkill() -> None:
        daemon.signal(signal.SIGKILL)
        at = time.time()
        daemon.wait(10)
        gate.touch()
        kills.append(watch.killed(host, boot, at))

    injector.cut(host, session, sigkill)
    kill = kills[0]
    while time.time() < kill.at + ADOPT_BOUND:
        with watch.lock:
            if kill.tracked is not None and None not in kill.tracked.values():
                break
        time.sleep(POLL)
    daemon.start(wait=False)


def kill_worker(cluster: Cluster, rng: random.Random) -> bool | None:
    """SIGKILL a ready worker of a live daemon, one that runs a turn if any does. Whether
    the one killed ran a turn; None if there was no ready worker."""
    running = {
        s.owner for s in cluster.store.sessions.list(limit=1_000) if s.active_turn_id and s.owner
    }
    choices: list[tuple[bool, psutil.Process]] = []
    for host, daemon in cluster.daemons.items():
        try:
            procs = ready_workers(daemon)
            status = daemon.status()
        except (httpx.HTTPError, OSError):
            continue  # not serving (yet)
        boot = status["boot"]["id"][:8]
        names = {int(s["pid"]): s["worker"] for s in status["slots"] if s["pid"]}
        for proc in procs:
            owner = f"{host}/{boot}/{names.get(proc.pid)}"
            choices.append((owner in running, proc))
    busy = [c for c in choices if c[0]]
    if not choices:
        return None
    ran, victim = rng.choice(busy or choices)
    try:
        victim.kill()
    except psutil.NoSuchProcess:
        return None
    return ran


def at_work(store: Store, sessions: list[str]) -> list[str]:
    """The open sessions with pending input or a turn in flight."""
    mine = set(sessions)
    return [
        s.id
        for s in store.sessions.list(limit=1_000)
        if s.id in mine and s.status == "open" and (s.pending or s.active_turn_id)
    ]


def audit(store: Store, sessions: list[str], sent: list[Message]) -> tuple[list[str], Counter[str]]:
    """What `judge` does not check: the intake keys, each user message read by a turn that
    ended, fencing by token, duplicated seqs. (problems, continuations by cause)."""
    problems: list[str] = []
    causes: Counter[str] = Counter()
    keys: dict[tuple[str, str], int] = {}
    mine = set(sessions)
    for sid, key, seq in store.db.execute_sql("SELECT session_id, key, seq FROM intake_key"):
        if sid in mine:
            keys[(sid, key)] = int(seq)
    accepted = [m for m in sent if m.status == 202]
    for m in accepted:
        stored = keys.get((m.session, scoped_key(ADMIN, m.key)))
        if stored != m.seq:
            problems.append(f"{m.session}: key {m.key} (202 seq {m.seq}) is kept for {stored}")
    if len(keys) != len(accepted):
        problems.append(f"{len(keys)} intake keys kept for {len(accepted)} accepted messages")
    doubled = list(
        store.db.execute_sql(
            "SELECT session_id, seq, COUNT(*) FROM event GROUP BY session_id, seq "
            "HAVING COUNT(*) > 1"
        )
    )
    problems += [f"{sid}: seq {seq} is in the log {n} times" for sid, seq, n in doubled]
    for sid in sessions:
        found = store.events.read(sid, limit=1_000_000)
        quarantined = store.sessions.get(sid).status == "quarantined"
        ended = {e.turn_id for e in found if e.type == "turn_ended"}
        read_to = [
            int(e.payload["read_to"])
            for e in found
            if e.type == "turn_started" and e.turn_id in ended and "read_to" in e.payload
        ]
        resend_at = [
            e.seq
            for e in found
            if e.type == "notice" and RESEND.search(str(e.payload.get("text", "")))
        ]
        for e in found:
            if e.type == "continuation":
                causes[str(e.payload.get("cause"))] += 1
            if e.type != "user_message" or any(r >= e.seq for r in read_to):
                continue
            if not quarantined and not any(s > e.seq for s in resend_at):
                problems.append(f"{sid}: the user message at seq {e.seq} was read by no turn")
        tokens = [(e.seq, e.lease_token or 0) for e in found if e.writer == "worker"]
        for (seq_a, a), (seq_b, b) in itertools.pairwise(tokens):
            if b < a:
                problems.append(
                    f"{sid}: seq {seq_b} was written with lease token {b} after seq {seq_a} "
                    f"with {a}: an owner wrote after its successor"
                )
    return problems, causes


@pytest.mark.slow
@pytest.mark.timeout(150 + CLUSTER_WAIT)
@pytest.mark.usefixtures("cluster_turn")  # one cluster at a time (conftest.CLUSTER_LOCK)
@pytest.mark.xdist_group("cluster")
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_hosts_chaos_loses_duplicates_and_silences_nothing(db_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    print(f"hosts chaos seed {SEED} (rerun with TURNKEEPER_HOSTS_CHAOS_SEED={SEED})")
    rng = random.Random(SEED)
    cluster = Cluster(tmp_path, db_url, pool=POOL, model={"delay": MODEL_DELAY})
    watch = Watch(db_url)
    plan: list[str | None] = [None] * WORKER_KILLS + sorted(cluster.daemons)
    rng.shuffle(plan)  # a host name: SIGKILL its daemon; None: a worker
    kills: Counter[str] = Counter()
    held: list[str] = []  # a session per daemon kill, its turn held in flight at the kill
    held_by: dict[str, str | None] = {}  # the host killed: the host that ran its held turn
    exits: dict[str, int | None] = {}
    sender: threading.Thread | None = None
    injector: Spread | None = None
    try:
        cluster.start()
        booted = time.monotonic()
        with cluster["host-a"].client() as control:
            sessions = [control.post("/v1/sessions", json={}).json()["id"] for _ in range(SESSIONS)]
        injector = Spread(
            cluster["host-a"], sessions, random.Random(rng.random()), hosts=cluster.daemons
        )
        sender = threading.Thread(target=injector.run, name="hosts-injector")
        watch.thread.start()
        sender.start()
        for host in plan:
            time.sleep(rng.uniform(*PAUSE))
            if host is not None:
                for daemon in cluster.daemons.values():  # one daemon down at a time
                    wait_ready(daemon)
                gate = tmp_path / f"gate-{host}"
                held.append(hold_a_turn(cluster, host, injector, gate))
                held_by[host] = cluster.owner_host(held[-1])
                kill_daemon(cluster, host, watch, injector, rng.choice(sessions), gate)
                kills["daemon"] += 1
                continue
            ran = kill_worker(cluster, rng)
            if ran is not None:
                kills["worker"] += 1
                kills["worker_running_a_turn"] += ran
        chaos_done = time.monotonic()
        for daemon in cluster.daemons.values():
            wait_ready(daemon)
        injector.stop.set()
        sender.join(60)
        assert not sender.is_alive(), "the injector did not stop"
        until = time.monotonic() + QUIET_TIMEOUT
        while (busy := at_work(cluster.store, sessions + held)) and time.monotonic() < until:
            time.sleep(0.25)
        rest_done = time.monotonic()
        watch.stop.set()
        for daemon in cluster.daemons.values():
            daemon.signal(signal.SIGTERM)
        for host, daemon in cluster.daemons.items():
            try:
                exits[host] = daemon.wait(STOP_TIMEOUT)
            except Exception:
                exits[host] = None
        verdict = judge(cluster.store, sessions + held, injector.sent, [])
        found, causes = audit(cluster.store, sessions + held, injector.sent)
    finally:
        watch.stop.set()
        if injector is not None:
            injector.stop.set()
        if sender is not None:
            sender.join(60)
        cluster.close()

    problems = [f"{sid}: not at rest after {QUIET_TIMEOUT:g} s" for sid in busy]
    problems += [f"{host}: exit {code} after SIGTERM" for host, code in exits.items() if code]
    problems += verdict.problems + found
    problems += [f"not adopted within {ADOPT_BOUND:g} s: {late}" for late in watch.late()]
    acked = [m for m in injector.sent if m.status == 202]
    owned_again = watch.figures()
    figures = {
        "seed": SEED,
        "seconds": round(time.monotonic() - started, 1),
        "boot_seconds": round(booted - started, 1),
        "chaos_seconds": round(chaos_done - booted, 1),
        "settle_seconds": round(rest_done - chaos_done, 1),
        "sessions": SESSIONS,
        "injects": {
            "sent": len(injector.sent),
            "accepted": len(acked),
            "refused_quarantined": sum(1 for m in injector.sent if m.status == 409),
        }
        | dict(sorted(injector.counts.items())),
        "request_failures": dict(injector.failures),
        "kills": dict(kills),
        "continuations_by_cause": dict(causes),
        "owned_again_after_daemon_kill": owned_again,
        "held_turns_ran_on": held_by,  # by the host killed
        "messages": dict(verdict.outcome),
        "quarantined_sessions": verdict.quarantined,
        "problems": len(problems),
    }
    report = json.dumps({"hosts_chaos": figures})
    print(report)
    for problem in problems:
        print("PROBLEM", problem)
    assert not injector.unexpected, f"{injector.unexpected[:10]}\n{report}"
    assert acked, f"no message was accepted\n{report}"
    assert kills["daemon"] == len(cluster.daemons) and kills["worker"] > 0, report
    cut = sum(n for name, n in injector.counts.items() if name.startswith("cut_by_kill"))
    assert cut == kills["daemon"], f"a request in flight did not fail with its daemon\n{report}"
    assert injector.counts["sent_again_elsewhere"] > 0, f"no request met a killed daemon\n{report}"
    on_victim = sum(1 for host, ran_on in held_by.items() if ran_on == host)
    assert on_victim > 0, f"no held turn was on the daemon killed: adoption untried\n{report}"
    assert causes["host_lost"] >= on_victim, f"a held turn adopted without its note\n{report}"
    assert not problems, f"{len(problems)} problems (seed {SEED}); first: " + "\n".join(
        [*problems[:15], report]
    )
