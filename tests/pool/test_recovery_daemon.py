"""Recovery with the daemon as a real process: the breaker, the boot scan, the metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.conftest import python_env
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until
from tests.support import run_turnkeeper

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)


def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return run_turnkeeper(*args, env=python_env(), config=daemon.config_path)


def sigkill(daemon: Daemon) -> None:
    """SIGKILL the supervisor alone; its workers die with it (parent-death signal)."""
    daemon.signal(signal.SIGKILL)
    daemon.wait(10)


def started(store: Store, session_id: str, after: int) -> bool:
    return any(e.type == "turn_started" for e in store.events.read(session_id, after=after))


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text `text`, 0 if it is absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? ([0-9.e+-]+)$"
    if labels:
        pattern = rf"^{re.escape(name)}\{{{re.escape(want)}\}} ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_three_sigkills_trip_the_breaker_and_a_reset_lets_the_boot_scan_run(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(
        http={"listen": f"unix:{tmp_path / 'api.sock'}"},
        recovery={"breaker_threshold": 3, "breaker_window": 300},
    )
    # Boots 1 and 2 are SIGKILLed as soon as they are ready.
    for _ in range(2):
        daemon.start()
        sigkill(daemon)
    # Boot 3 dies with a turn in flight.
    daemon.start()
    with Store(daemon.url, migrate=False) as store:
        victim = store.sessions.create("admin").id
        gate = tmp_path / "gate"  # the turn is held until its daemon is dead
        seq = inject(store, victim, f"/gate {gate} slow")
        wait_until(lambda: started(store, victim, seq), 20, "the slow turn to start")
        sigkill(daemon)
        gate.touch()

        # Boot 4: three unclean boots within the window trip the breaker.
        daemon.start()
        wait_until(lambda: "boot_scan: 1 interrupted" in daemon.log(), 20, "the boot scan")
        assert "breaker TRIPPED" in daemon.log()
        with daemon.client() as client:
            status = client.get("/v1/status").json()
            assert status["breaker"]["tripped"] is True
            assert status["breaker"]["unclean_boots"] == 3
            scraped = client.get("/metrics").text
            assert metric(scraped, "turnkeeper_breaker_tripped") == 1.0
        shown = cli(daemon, "status")
        assert shown.returncode == 0, shown.stderr
        assert "breaker TRIPPED: 3 unclean boots" in shown.stdout
        boots = cli(daemon, "boots")
        assert boots.returncode == 0 and "TRIPPED" in boots.stdout, boots.stdout + boots.stderr
        # The boot scan was suppressed, and said so once for the session.
        suppressed = re.findall(r"\[recovery\].*boot_scan suppressed", daemon.log())
        assert len(suppressed) == 1, daemon.log()

        # The control plane still serves: a new session's message is answered, and attach
        # streams the reply.
        with daemon.client() as client:
            fresh = client.post("/v1/sessions", json={}).json()["id"]
            accepted = client.post(f"/v1/sessions/{fresh}/inject", json={"text": "still here"})
            assert accepted.status_code == 202, accepted.text
            wait_until(lambda: turn_ended(store, fresh), 20, "the fresh session's turn")
            with client.stream("GET", f"/v1/sessions/{fresh}/attach", params={"after": 0}) as sse:
                body = ""
                for chunk in sse.iter_text():
                    body += chunk
                    if "turn_ended" in body:
                        break
            assert "echo: still here" in body
        # Meanwhile (the fresh turn is the positive signal) the interrupted one was left.
        assert store.sessions.get(victim).active_turn_id is not None
        assert "continuation" not in [e.type for e in events(store, victim)]

        # `turnkeeper breaker reset` clears it, and the held-back boot scan runs.
        reset = cli(daemon, "breaker", "reset")
        assert reset.returncode == 0 and "breaker reset" in reset.stdout, reset.stderr
        ended = wait_until(lambda: turn_ended(store, victim, seq), 30, "the held-back turn")
        assert ended.payload["outcome"] == "completed"
        found = events(store, victim)
        notes = [e for e in found if e.type == "continuation"]
        assert len(notes) == 1 and notes[0].payload["cause"] == "daemon_restart"
        replies = [e for e in found if e.type == "model_response" and e.payload["text"]]
        assert [r.payload["text"] for r in replies] == [f"echo: /gate {gate} slow"]
        assert "breaker clear" in daemon.log().rsplit("breaker TRIPPED", 1)[1]
        after = cli(daemon, "breaker", "status")
        assert after.returncode == 0 and after.stdout.startswith("clear"), after.stdout


def test_a_metrics_scrape_after_a_worker_crash_shows_the_restart_and_the_recovery(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(http={"listen": f"unix:{tmp_path / 'api.sock'}"})
    daemon.start()
    with Store(daemon.url, migrate=False) as store, daemon.client() as client:
        before = client.get("/metrics").text
        assert metric(before, "turnkeeper_worker_restarts_total") == 0.0
        session = client.post("/v1/sessions", json={}).json()["id"]
        gate = tmp_path / "gate"  # the turn is held until its worker is dead
        seq = client.post(f"/v1/sessions/{session}/inject", json={"text": f"/gate {gate} hi"})
        seq = seq.json()["seq"]
        wait_until(lambda: started(store, session, seq), 20, "the turn to start")
        owner = wait_until(lambda: daemon.owner_pid(store, session), 10, "the owner")
        os.kill(owner, signal.SIGKILL)
        gate.touch()
        ended = wait_until(lambda: turn_ended(store, session, seq), 30, "the continued turn")
        assert ended.payload["outcome"] == "completed"
        # The dead worker's slot is filled again (on a busy machine, after the turn ended).
        wait_until(
            lambda: (
                metric(client.get("/metrics").text, "turnkeeper_workers", state="running") == 2.0
            ),
            30,
            "the slot to be refilled",
        )
        scraped = client.get("/metrics").text
    assert metric(scraped, "turnkeeper_worker_restarts_total") == 1.0
    assert (
        metric(
            scraped,
            "turnkeeper_session_recovery_total",
            action="continue",
            cause="worker_crash",
            outcome="started",
        )
        == 1.0
    ), scraped
    assert metric(scraped, "turnkeeper_session_recovery_age_seconds_count") == 1.0
    # The other families an operator relies on are there too.
    assert metric(scraped, "turnkeeper_append_latency_seconds_count") > 0
    assert metric(scraped, "turnkeeper_sessions", state="open") == 1.0
    assert metric(scraped, "turnkeeper_workers", state="running") == 2.0
    assert metric(scraped, "turnkeeper_events_committed_total", type="continuation") == 1.0
    assert "turnkeeper_mcp_servers" in scraped
    assert metric(scraped, "turnkeeper_breaker_tripped") == 0.0
    # A clean stop's step durations are shown by the next boot.
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    daemon.start()
    with daemon.client() as client:
        scraped = client.get("/metrics").text
    assert metric(scraped, "turnkeeper_shutdown_step_seconds", step="descendants") > 0


def test_a_turn_that_dies_before_doing_anything_again_gets_a_resend_notice(
    daemons: Daemons,
) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("admin").id
        seq = inject(store, sid, "/crash-at-start")
        ended = wait_until(lambda: turn_ended(store, sid, seq), 30, "recovery to end the turn")
        assert ended.payload == {"outcome": "failed", "reason": "unsafe_tail"}
        found = events(store, sid)
        # One continuation note, and no second note on top of it: a notice instead.
        assert [e.type for e in found].count("continuation") == 1
        notice = next(e for e in found if e.type == "notice")
        assert (
            notice.payload["resend"] is True and "send your message again" in notice.payload["text"]
        )
        info = store.sessions.get(sid)
        assert info.status == "open" and info.resend_requested_at is not None
        # The user resends: it is answered, and the mark is gone.
        again = inject(store, sid, "hello again")
        reply = wait_until(lambda: turn_ended(store, sid, again), 30, "the answer")
        assert reply.payload["outcome"] == "completed"
        assert store.sessions.get(sid).resend_requested_at is None
        assert re.search(r"\[recovery\].*unsafe tail \(last_is_continuation_note\)", daemon.log())


def test_with_auto_continue_off_a_turn_waits_for_the_users_next_message(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(recovery={"auto_continue": False}).start()
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("admin").id
        # Held at a gate that never opens: the turn is in flight when its worker dies.
        seq = inject(store, sid, f"/gate {tmp_path / 'never'} first")
        wait_until(lambda: started(store, sid, seq), 20, "the turn to start")
        owner = wait_until(lambda: daemon.owner_pid(store, sid), 10, "the owner")
        os.kill(owner, signal.SIGKILL)
        wait_until(
            lambda: re.search(r"\[recovery\].*auto_continue is off", daemon.log()), 20, "the skip"
        )
        assert "continuation" not in [e.type for e in events(store, sid)]
        assert store.sessions.get(sid).active_turn_id is not None  # left as it was
        # The user's next message drives a new turn, with no note; the old one ends.
        again = inject(store, sid, "second")
        wait_until(
            lambda: any(
                e.type == "turn_ended" and e.payload["outcome"] == "completed"
                for e in store.events.read(sid, after=again)
            ),
            30,
            "the next turn",
        )
        found = events(store, sid)
        assert "continuation" not in [e.type for e in found]
        first_end = next(e for e in found if e.type == "turn_ended")
        assert first_end.payload["outcome"] == "interrupted"
        replies = [e.payload["text"] for e in found if e.type == "model_response"]
        assert replies == ["echo: second"]


def test_the_boot_scan_is_bounded_and_old_interruptions_are_finalized(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(
        http={"listen": f"unix:{tmp_path / 'api.sock'}"},
        # One a pass, and no second pass before the test is over.
        recovery={"max_per_pass": 1, "pass_interval": 300, "freshness": 15},
    ).start()
    with Store(daemon.url, migrate=False) as store:
        old = store.sessions.create("admin").id
        seq_old = inject(store, old, f"/gate {tmp_path / 'never'} old")  # held until killed
        wait_until(lambda: started(store, old, seq_old), 20, "the old turn")
        # Older than the freshness window, which is long enough that the fresh turns are
        # still inside it at the next boot on a busy machine.
        time.sleep(15.5)
        fresh = [store.sessions.create("admin").id for _ in range(3)]
        gate = tmp_path / "gate"  # the fresh turns are held until the daemon is dead
        seqs = [inject(store, sid, f"/gate {gate} fresh {n}") for n, sid in enumerate(fresh)]
        for sid, seq in zip(fresh, seqs, strict=True):
            wait_until(lambda sid=sid, seq=seq: started(store, sid, seq), 20, "the fresh turns")
        sigkill(daemon)
        gate.touch()
        daemon.start()
        # The stale turn is ended with a notice asking to resend, not continued.
        ended = wait_until(lambda: turn_ended(store, old, seq_old), 20, "the stale turn")
        assert ended.payload == {"outcome": "failed", "reason": "stale"}
        notice = next(e for e in events(store, old) if e.type == "notice")
        assert "longer ago than recovery continues turns" in notice.payload["text"]
        assert store.sessions.get(old).resend_requested_at is not None

        # One fresh session is continued by the boot scan (max_per_pass 1), written to
        # the boot row's attempted list first; the others wait for a first touch or the
        # next pass.
        def ended_fresh() -> list[str]:
            return [s for s, q in zip(fresh, seqs, strict=True) if turn_ended(store, s, q)]

        wait_until(ended_fresh, 20, "the boot scan's continuation")
        wait_until(
            lambda: re.search(
                r"boot_scan: 4 interrupted sessions, 1 to continue, 2 left", daemon.log()
            ),
            20,
            "the boot scan's summary",
        )
        done = ended_fresh()
        assert len(done) == 1
        assert store.boots.recent(1)[0].attempted == done
        waiting = [s for s in fresh if s not in done]
        with daemon.client() as client:
            assert client.get(f"/v1/sessions/{waiting[0]}").status_code == 200  # first touch
        first = dict(zip(fresh, seqs, strict=True))
        wait_until(lambda: turn_ended(store, waiting[0], first[waiting[0]]), 20, "touched one")
        assert store.sessions.get(waiting[1]).active_turn_id is not None  # still untouched
