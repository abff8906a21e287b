"""Schedules with the daemon as a real process (issue 17): a schedule every 2 s fires 5
times in 10 s with no gap; after 10 s down, `run_once` runs exactly one catch-up fire (the
newest missed time) and `skip` none, then both fire on time again; across 5 restarts
(SIGKILL and SIGTERM) no scheduled time fires twice; every misfire decision is logged and
counted; an interrupted scheduled turn ends with a notice and is never continued; and bad
input, over the API and the command line, is a clear error.

One test, six boots: each boot costs seconds."""

from __future__ import annotations

import collections
import itertools
import json
import math
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import EventRecord, FireInfo, Store
from tests.cli.test_client import cli_env
from tests.daemon import Daemon, daemons, events, wait_until
from tests.http.test_api import Api, assert_error, create_session, start
from tests.pool.test_recovery_daemon import metric
from tests.support import run_turnkeeper

__all__ = ["daemons", "start"]  # the fixtures

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

EVERY_2S = "*/2 * * * * *"
DOWN = 10.0  # seconds the daemon stays down before the catch-up boot


def turnkeeper(daemon: Daemon, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    environ = cli_env(TURNKEEPER_TOKEN=token, COLUMNS="200")
    return run_turnkeeper(*args, env=environ, config=daemon.config_path)


def fires(store: Store, schedule_id: str) -> list[FireInfo]:
    return store.schedules.fires(schedule_id)


def scheduled(found: list[EventRecord], schedule_id: str) -> list[EventRecord]:
    return [
        e for e in found if e.type == "user_message" and e.payload.get("schedule") == schedule_id
    ]


def run_log(daemon: Daemon) -> str:
    return daemon.log().split(f"--- run {daemon.runs} ---")[-1]


def stop(daemon: Daemon, signum: int) -> None:
    daemon.signal(signum)
    daemon.wait(30)


def bad_input_is_a_clear_error(api: Api, session: str) -> None:
    alice, bob = api.client("alice"), api.client("bob")
    ok = {"cron": EVERY_2S, "text": "x", "session": session}
    for change, field, says in [
        ({"cron": "61 * * * *"}, "cron", "is not a cron expression: Bad minute"),
        ({"cron": "* * * * * *"}, "cron", "runs 1 s apart, more often than schedules.min_interval"),
        ({"timezone": "Mars/Olympus"}, "timezone", "unknown time zone 'Mars/Olympus'"),
        ({"misfire": "sometimes"}, "misfire", "'run_once' or 'skip'"),
        ({"session": "0" * 32}, "session", "no session '" + "0" * 32 + "'"),
    ]:
        error = assert_error(alice.post("/v1/schedules", json={**ok, **change}), 422, "invalid")
        assert error["field"] == field and says in error["message"], error
    api.daemon.client().put(  # bob may read alice's session, not write it
        f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "read"}
    ).raise_for_status()
    error = assert_error(bob.post("/v1/schedules", json=ok), 403, "forbidden")
    assert "bob has read access" in error["message"] and "needs write" in error["message"]
    cli = turnkeeper(api.daemon, api.tokens["alice"], "schedules", "add", "every day", "x")
    assert cli.returncode == 1 and "cron: 'every day' is not a cron expression" in cli.stderr


def test_a_schedule_fires_on_time_once_across_restarts(
    start: Callable[..., Api], tmp_path: Path
) -> None:
    # Every 2 s needs schedules.min_interval down from its 60 s.
    api = start(recovery={"breaker_threshold": 100}, schedules={"min_interval": 2})
    daemon, alice = api.daemon, api.client("alice")
    session = create_session(alice, title="reports")
    bad_input_is_a_clear_error(api, session)
    gate = tmp_path / "gate"  # never made: each run of `held` keeps its turn in flight
    cli = turnkeeper(
        daemon, api.tokens["alice"], "schedules", "add", EVERY_2S, "report", "--session", session
    )
    assert cli.returncode == 0, cli.stderr
    reports = cli.stdout.split()[1].rstrip(":")
    answer = alice.post(
        "/v1/schedules",
        json={"cron": EVERY_2S, "text": f"/gate {gate} held", "session": None, "misfire": "skip"},
    )
    assert answer.status_code == 201, answer.text
    held = answer.json()["id"]
    listed = turnkeeper(daemon, api.tokens["alice"], "schedules", "list", "--json")
    assert [s["id"] for s in json.loads(listed.stdout)["schedules"]] == [reports, held]
    table = turnkeeper(daemon, api.tokens["alice"], "schedules", "list").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "CRON", "TIMEZONE", "MISFIRE"]
    assert table[1].startswith(reports) and session in table[1] and table[1].endswith("report")
    assert table[2].startswith(held) and "(new each run)" in table[2] and "skip" in table[2]
    assert api.client("bob").get("/v1/schedules").json()["schedules"][0]["id"] == reports

    with Store(daemon.url, migrate=False) as store:
        # --- boot 1: every 2 s, on time, no gap -----------------------------------------
        wait_until(lambda: fires(store, reports), 10, "the first fire")
        began = time.time()
        time.sleep(10.0)
        ended = time.time()
        # The times due in those 10 s: 5, each fired (a late one is waited for), none twice.
        due = [t for t in range(math.ceil(began), math.ceil(ended)) if t % 2 == 0]
        assert len(due) == 5
        wait_until(
            lambda: {f.scheduled_for for f in fires(store, reports)} >= set(map(float, due)),
            20,
            "the fires of the 10 s",
        )
        window = [f for f in fires(store, reports) if began <= f.scheduled_for < ended]
        assert sorted(f.scheduled_for for f in window) == due, window
        assert all(began - 10 <= f.fired_at <= ended + 10 for f in window)
        first = fires(store, reports)
        assert {f.outcome for f in first} == {"fired"}
        assert all(b.scheduled_for - a.scheduled_for == 2 for a, b in itertools.pairwise(first))
        # On time, give or take a machine so busy that the loop runs seconds late (a fire
        # later than a minute would count as missed).
        assert all(0 <= f.fired_at - f.scheduled_for < 10 for f in first), first
        made = {s.id for s in store.sessions.list(limit=1000) if s.kind == "scheduled"}
        assert made and store.acl.entries(next(iter(made))) == {"alice": "admin"}
        wait_until(
            lambda: any(store.sessions.get(s).active_turn_id for s in made), 10, "a held turn"
        )

        # --- boot 2, after 10 s down: run_once catches up once, skip runs none ---------
        stop(daemon, signal.SIGKILL)
        last = {s: fires(store, s)[-1].scheduled_for for s in (reports, held)}
        in_flight = {s for s in made if store.sessions.get(s).active_turn_id}
        time.sleep(DOWN)
        daemon.start()
        wait_until(lambda: len(fires(store, reports)) >= len(first) + 3, 20, "fires after")
        caught, *after = [f for f in fires(store, reports) if f.scheduled_for > last[reports]]
        assert caught.outcome == "caught_up" and caught.scheduled_for - last[reports] >= DOWN
        assert [f.outcome for f in after] == ["fired"] * len(after)
        assert after[0].scheduled_for == caught.scheduled_for + 2  # the newest missed: then on time
        messages = scheduled(events(store, session), reports)
        assert [m.payload["outcome"] for m in messages].count("caught_up") == 1
        skipped, *again = [f for f in fires(store, held) if f.scheduled_for > last[held]]
        assert skipped.outcome == "skipped" and skipped.seq is None and skipped.session is None
        assert "misfire skip: none runs" in skipped.reason
        assert again and again[0].scheduled_for == skipped.scheduled_for + 2
        log = run_log(daemon)
        missed_reports = _missed(log, reports, "caught_up")
        missed_held = _missed(log, held, "skipped")
        assert missed_reports >= DOWN / 2 and missed_held >= DOWN / 2
        with api.client("admin") as admin:
            text = admin.get("/metrics").text
        assert metric(text, "turnkeeper_schedule_fires_total", outcome="caught_up") == 1
        assert metric(text, "turnkeeper_schedule_fires_total", outcome="skipped") == (
            missed_reports - 1 + missed_held
        )
        assert metric(text, "turnkeeper_schedule_fires_total", outcome="fired") >= 2
        # The held turns the SIGKILL cut end with a notice; none is continued.
        for cut in in_flight:
            wait_until(
                lambda cut=cut: store.sessions.get(cut).active_turn_id is None, 30, "its end"
            )
            found = events(store, cut)
            assert [e.type for e in found[-2:]] == ["notice", "turn_ended"], found
            assert found[-1].payload == {"outcome": "failed", "reason": "not_continued"}
            assert "continuation" not in [e.type for e in found]

        # --- boots 3 to 6: SIGTERM and SIGKILL, each short down ---------------------------
        for signum in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL):
            count = len(fires(store, reports))
            wait_until(lambda count=count: len(fires(store, reports)) >= count + 2, 20, "fires")
            stop(daemon, signum)
            time.sleep(1.0)
            daemon.start()
        wait_until(lambda: len(fires(store, reports)) >= count + 4, 20, "fires of the last boot")
        assert daemon.runs == 6

        # --- every time fired once, and each message once ------------------------------
        # Read with the supervisor paused at a moment no fire is owed: one it commits while
        # the rows and the messages are read would be half of it.
        def paused_with_nothing_owed() -> bool:
            daemon.signal(signal.SIGSTOP)
            if not store.schedules.owed():
                return True
            daemon.signal(signal.SIGCONT)
            time.sleep(0.1)
            return False

        wait_until(paused_with_nothing_owed, 20, "every fire injected")
        for schedule_id in (reports, held):
            rows = fires(store, schedule_id)
            times = [f.scheduled_for for f in rows]
            assert times == sorted(set(times))
            for boot in _by_boot(rows):
                assert [f.outcome for f in boot[1:]] == ["fired"] * (len(boot) - 1)
                assert all(b - a == 2 for a, b in itertools.pairwise(_times(boot)))
            ran = {f.scheduled_for for f in rows if f.outcome != "skipped"}
            unsent = [f for f in rows if f.outcome != "skipped" and f.seq is None]
            assert not unsent, [(f.scheduled_for, f.outcome, f.reason) for f in unsent]
            if schedule_id == reports:
                found = scheduled(events(store, session), reports)
            else:
                runs = [s.id for s in store.sessions.list(limit=1000) if s.kind == "scheduled"]
                logs = [events(store, run) for run in runs]
                found = [m for log in logs for m in scheduled(log, held)]
                assert len(found) == len(runs)  # one message a session
                assert not [e for log in logs for e in log if e.type == "continuation"]
            counts = collections.Counter(m.payload["scheduled_for"] for m in found)
            assert set(counts.values()) == {1}, counts
            assert set(counts) == {int(t) for t in ran}
        daemon.signal(signal.SIGCONT)
        # Removed, it fires no more.
        gone = turnkeeper(daemon, api.tokens["alice"], "schedules", "remove", reports)
        assert gone.returncode == 0 and f"schedule {reports} removed" in gone.stdout
        time.sleep(3.0)
        assert fires(store, reports) == [] and store.schedules.get(reports) is None
        before = len(scheduled(events(store, session), reports))
        time.sleep(2.5)
        assert len(scheduled(events(store, session), reports)) == before


def _missed(log: str, schedule_id: str, outcome: str) -> int:
    """How many times the boot's decision for the schedule says were missed."""
    marker = f"schedule {schedule_id} {outcome}: missed "
    lines = [line for line in log.splitlines() if marker in line]
    assert len(lines) == 1, log
    return int(lines[0].split(marker, 1)[1].split()[0])


def _by_boot(rows: list[FireInfo]) -> list[list[FireInfo]]:
    boots: dict[str, list[FireInfo]] = {}
    for row in rows:
        boots.setdefault(row.fired_by, []).append(row)
    return list(boots.values())


def _times(rows: list[Any]) -> list[float]:
    return [r.scheduled_for for r in rows]
