"""Several daemons on one database, decided over plain data: who adopts a lost host's
sessions, when, and what a daemon does with a session another daemon took from it.

No processes and no database: rendezvous spread, the adoption clock and the engine's
commands for leases of other hosts, checked with a clock that is a number.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from supervisor.core import engine
from supervisor.core.adoption import ADOPT_GRACE, adopts, next_adoption
from supervisor.core.engine import Facts, Judge, Move, SessionView, Wake, WorkerView
from supervisor.core.recovery import Trigger, interruption

NOW = 1_800_000_000.0
MONO = 5_000.0
HOSTS = ("host-a", "host-b", "host-c")


def facts(host: str, live: tuple[str, ...] = HOSTS) -> Facts:
    return Facts(
        owner_prefix=f"{host}/boot0001",
        host_prefix=f"{host}/",
        heartbeat_interval=1.0,
        live_hosts=live,
    )


def lost(i: int, expired_at: float = NOW - 0.1) -> SessionView:
    """A session of host-a, whose lease ran out, with a turn in flight."""
    return SessionView(
        f"s{i:04d}", owner="host-a/dead0001/w0.1", lease_expires_at=expired_at, active_turn_id="t"
    )


def plan(session: SessionView, host: str, **kwargs: object) -> list[engine.Command]:
    workers = {"w0.1": WorkerView("w0.1", last_heartbeat=MONO)}
    return engine.plan(
        [session],
        workers,
        kwargs.pop("assigned", {}),  # type: ignore[arg-type]
        {},
        {},
        facts(host),
        now=kwargs.pop("now", NOW),  # type: ignore[arg-type]
        wall=NOW,
        monotonic=MONO,
        tokens=kwargs.pop("tokens", None),  # type: ignore[arg-type]
    )


def test_every_survivor_agrees_on_one_adopter_and_the_lost_host_is_never_it() -> None:
    sessions = [lost(i) for i in range(600)]
    picked: Counter[str] = Counter()
    for s in sessions:
        # host-a's row may still look live: the survivors leave it out all the same.
        takers = [h for h in ("host-b", "host-c") if adopts(s, h, HOSTS, NOW)]
        assert len(takers) == 1, takers
        picked[takers[0]] += 1
    # Spread: each of the two survivors takes about half (binomial, 600 draws).
    assert set(picked) == {"host-b", "host-c"}
    assert 240 <= picked["host-b"] <= 360, picked


def test_a_daemon_the_hash_did_not_pick_adopts_after_the_grace() -> None:
    s = lost(7, expired_at=NOW)
    other = next(h for h in ("host-b", "host-c") if not adopts(s, h, HOSTS, NOW))
    assert not adopts(s, other, HOSTS, NOW + ADOPT_GRACE - 0.01)
    assert adopts(s, other, HOSTS, NOW + ADOPT_GRACE)
    # Alone on the database (the others are gone too), a daemon takes everything at once.
    assert adopts(s, other, (other,), NOW)


def test_the_next_adoption_is_when_the_first_live_lease_of_another_host_runs_out() -> None:
    mine = SessionView("m", owner="host-b/boot0001/w0.1", lease_expires_at=NOW + 1)
    expired = lost(1, expired_at=NOW - 5)  # already adoptable: the pass sees it anyway
    soon = [lost(i, expired_at=NOW + 3) for i in range(40)]
    later = lost(99, expired_at=NOW + 9)
    due = next_adoption([mine, expired, *soon, later], "host-b", HOSTS, NOW)
    # Some of the 40 are host-b's by the hash: their expiry; none of them earlier.
    assert due == NOW + 3
    theirs = [s for s in soon if not adopts(s, "host-b", HOSTS, s.lease_expires_at or 0)]
    assert next_adoption(theirs, "host-b", HOSTS, NOW) == NOW + 3 + ADOPT_GRACE
    assert next_adoption([mine, expired], "host-b", HOSTS, NOW) is None


def test_a_lost_hosts_session_is_judged_as_its_workers_death_by_its_adopter_only() -> None:
    s = lost(3)
    adopter = next(h for h in ("host-b", "host-c") if adopts(s, h, HOSTS, NOW))
    other = "host-c" if adopter == "host-b" else "host-b"
    assert plan(s, adopter) == [Judge(s.id, Trigger.WORKER_DEATH, "w0.1")]
    assert plan(s, other) == []
    assert plan(s, other, now=NOW + ADOPT_GRACE) == [Judge(s.id, Trigger.WORKER_DEATH, "w0.1")]
    # A live lease of another host is left alone by everyone.
    live = SessionView("s", owner="host-a/boot/w0.1", lease_expires_at=NOW + 20, pending=True)
    assert plan(live, "host-b") == plan(live, "host-c") == []


def test_a_session_another_daemon_took_is_dropped_and_its_worker_told() -> None:
    """This host was paused: its lease (token 4) ran out, another daemon took token 5."""
    taken = SessionView(
        "s", owner="host-b/boot0009/w1.1", lease_expires_at=NOW + 20, lease_token=5, pending=True
    )
    commands = plan(taken, "host-a", assigned={"s": "w0.1"}, tokens={"s": 4})
    assert commands == [Move("s", "w0.1", renewing=True, taken=True)]
    # A read older than this daemon's own grant is no news: the worker keeps it.
    ours = SessionView(
        "s", owner="host-a/boot0001/w0.1", lease_expires_at=NOW + 20, lease_token=4,
        pending=True, last_seq=2,
    )  # fmt: skip
    assert plan(ours, "host-a", assigned={"s": "w0.1"}, tokens={"s": 5}) == [Wake("s", "w0.1", 2)]


def row(owner: str) -> SimpleNamespace:
    """A session row with an interrupted turn whose lease ran out."""
    return SimpleNamespace(
        id="s", owner=owner, lease_expires_at=NOW - 1, active_turn_id="t", status="open",
        pending=False, updated_at=NOW - 2, attempt_turn_id=None, attempt_count=0,
    )  # fmt: skip


def test_the_note_says_the_host_was_lost() -> None:
    def cause(owner: str, trigger: Trigger) -> str:
        return interruption(
            row(owner), [], trigger, NOW, host_prefix="host-b/", last_attempt_at=None, died=False
        ).cause

    assert cause("host-a/dead0001/w0.1", Trigger.WORKER_DEATH) == "host_lost"
    assert cause("host-b/old00001/w0.1", Trigger.BOOT_SCAN) == "daemon_restart"
    assert cause("host-b/old00001/w0.1", Trigger.WORKER_DEATH) == "lease_expired"
