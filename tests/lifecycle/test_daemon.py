"""The daemon as a real process: turns, worker crashes, hangs, restarts and fencing."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import tomli_w

from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]


def test_turns_run_and_every_event_is_committed(daemons: Daemons) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        plain = store.sessions.create("test").id
        tool = store.sessions.create("test").id
        inject(store, plain, "hello")
        inject(store, tool, '/tool echo {"x": 1}')
        for sid in (plain, tool):
            wait_until(lambda sid=sid: turn_ended(store, sid), 20, "the turn to end")
        assert [e.type for e in events(store, plain)] == [
            "user_message",
            "turn_started",
            "model_response",
            "turn_ended",
        ]
        assert events(store, plain)[2].payload["text"] == "echo: hello"
        tool_events = events(store, tool)
        assert [e.type for e in tool_events] == [
            "user_message",
            "turn_started",
            "model_response",
            "tool_call",
            "tool_result",
            "model_response",
            "turn_ended",
        ]
        assert tool_events[5].payload["text"] == 'echo: {"x": 1}'
        assert tool_events[-1].payload["outcome"] == "completed"
        assert store.sessions.get(tool).active_turn_id is None
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(15) == 0


def test_a_second_daemon_on_the_same_state_dir_is_refused(daemons: Daemons) -> None:
    daemon = daemons().start()
    second = subprocess.run(
        [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path), "run"],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert f"pid {daemon.pid}" in second.stderr
    assert daemon.proc is not None and daemon.proc.poll() is None


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sigkill_of_a_worker_mid_turn_twenty_times(daemons: Daemons, tmp_path: Path) -> None:
    # Five slots, so that 20 kills stay below the crash-loop backoff's long delays.
    daemon = daemons(pool={"workers": 4, "spare": 1}).start()
    rng = random.Random(3)
    with Store(daemon.url, migrate=False) as store:
        sessions = [store.sessions.create("test").id for _ in range(3)]
        for round in range(20):
            wait_until(lambda: len(daemon.live_workers()) >= 4, 30, "workers to adopt with")
            sid = sessions[round % len(sessions)]
            # The turn is held at a gate until its worker is dead, so no kill comes too late.
            gate = tmp_path / f"gate-{round}"
            seq = inject(store, sid, f"/gate {gate} round {round}")
            started = wait_until(
                lambda sid=sid, seq=seq: next(
                    (e for e in store.events.read(sid, after=seq) if e.type == "turn_started"), None
                ),
                20,
                "the turn to start",
            )
            time.sleep(rng.uniform(0.1, 0.6))
            victim = daemon.owner_pid(store, sid)
            assert victim is not None
            psutil.Process(victim).kill()  # dead before it runs again: then the gate opens
            gate.touch()
            ended = wait_until(
                lambda sid=sid, seq=seq: turn_ended(store, sid, seq),
                20,
                f"round {round}'s turn to end after the kill",
            )
            assert ended.turn_id == started.turn_id
            assert ended.payload["outcome"] == "completed"
            turn = [e for e in events(store, sid) if e.turn_id == started.turn_id]
            assert [e.type for e in turn].count("continuation") == 1
            continuation = next(e for e in turn if e.type == "continuation")
            assert continuation.payload["cause"] == "worker_crash"
            answers = [e for e in turn if e.type == "model_response"]
            assert [a.payload["text"] for a in answers] == [f"echo: /gate {gate} round {round}"]
            assert daemon.owner_pid(store, sid) != victim
        # Every dead worker's slot was filled again: 4 workers + 1 spare are alive.
        wait_until(lambda: len(daemon.live_workers()) == 5, 40, "the slots to be refilled")
    assert "exited with signal SIGKILL" in daemon.log()


@pytest.mark.timeout(240)  # a minute or more on a busy two-core machine
def test_sigkill_of_the_supervisor_leaves_no_worker_and_turns_finish_after_restart(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons().start()
    gate = tmp_path / "gate"  # every turn is held until the supervisor was killed
    with Store(daemon.url, migrate=False) as store:
        sessions = [store.sessions.create("test").id for _ in range(4)]
        for sid in sessions:
            inject(store, sid, f"/gate {gate} after the crash")
        wait_until(
            lambda: all(store.sessions.get(s).active_turn_id for s in sessions),
            20,
            "every turn to start",
        )
        workers = daemon.live_workers()
        assert workers
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        gone_by = time.monotonic() + 2.0
        _, alive = psutil.wait_procs(workers, timeout=2.0)
        assert not alive, f"workers outlived the supervisor: {[p.pid for p in alive]}"
        assert time.monotonic() <= gone_by + 0.5
        gate.touch()
        daemon.start()
        for sid in sessions:
            ended = wait_until(lambda sid=sid: turn_ended(store, sid), 30, "the turn to end")
            assert ended.payload["outcome"] == "completed"
            kinds = [e.type for e in events(store, sid)]
            assert kinds.count("model_response") == 1
            continuation = next(e for e in events(store, sid) if e.type == "continuation")
            assert continuation.payload["cause"] == "daemon_restart"
    # The killed supervisor could not forget its workers' rows; the next boot swept them.
    assert re.search(r"swept [1-9]\d* processes of earlier boots: 0 killed", daemon.log())


def test_a_hung_worker_is_detected_by_heartbeat_and_replaced(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(pool={"heartbeat_interval": 0.2, "hang_timeout": 2.0}).start()
    marker = tmp_path / "hung-once"
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("test").id
        seq = inject(store, sid, f"/hang-once {marker}")
        wait_until(marker.exists, 20, "the agent to hang")
        hung = daemon.owner_pid(store, sid)
        assert hung is not None
        wait_until(
            lambda: (
                not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
            ),
            15,
            "the hung worker to be killed",
        )
        ended = wait_until(lambda: turn_ended(store, sid, seq), 30, "the turn to end")
        assert ended.payload["outcome"] == "completed"
    log = daemon.log()
    assert "hung; aborting it" in log
    # faulthandler's traceback of the hung event loop, pointing at the blocking line.
    assert "Fatal Python error: Aborted" in log and "tests/agents.py" in log
    wait_until(lambda: len(daemon.live_workers()) == 2, 20, "a replacement worker")


@pytest.mark.timeout(180)
def test_rolling_restart_under_load_loses_and_duplicates_nothing(daemons: Daemons) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        sessions = [store.sessions.create("test").id for _ in range(20)]
        for sid in sessions:
            inject(store, sid, "/sleep 1.5 through the reload")
        wait_until(
            lambda: sum(1 for s in sessions if store.sessions.get(s).active_turn_id) >= 10,
            20,
            "turns to be running",
        )
        old = dict(daemon.worker_pids())
        # A reload replaces the workers when a key they read changed.
        daemon.config["pool"]["history_cache_mb"] = 32
        daemon.config_path.write_text(tomli_w.dumps(daemon.config))
        daemon.signal(signal.SIGHUP)
        for sid in sessions:
            wait_until(lambda sid=sid: turn_ended(store, sid), 60, "every turn to end")
        wait_until(lambda: "rolling restart done" in daemon.log(), 60, "the restart to finish")
        for sid in sessions:
            found = events(store, sid)
            kinds = [e.type for e in found]
            assert kinds.count("turn_started") == 1 and kinds.count("turn_ended") == 1
            assert kinds.count("model_response") == 1, kinds
            assert found[-1].payload["outcome"] == "completed"
            assert found[-2].payload["text"] == "echo: through the reload"
        for pid in old.values():
            wait_until(
                lambda pid=pid: (
                    not psutil.pid_exists(pid)
                    or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                ),
                10,
                f"old worker {pid} to exit",
            )
        handed = [s for s in sessions if any(e.type == "continuation" for e in events(store, s))]
        for sid in handed:
            continuation = next(e for e in events(store, sid) if e.type == "continuation")
            assert continuation.payload["cause"] == "handoff"
    assert "rolling restart of 2 workers" in daemon.log()


def test_a_frozen_worker_is_fenced_out_after_its_lease_goes_stale(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(
        pool={"heartbeat_interval": 0.2, "hang_timeout": 120.0}, lease={"stale_after": 1.5}
    ).start()
    gate = tmp_path / "gate"  # holds the turn in its first worker until that one is frozen
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("test").id
        seq = inject(store, sid, f"/gate {gate} fenced")
        wait_until(lambda: store.sessions.get(sid).active_turn_id, 20, "the turn to start")
        frozen = daemon.owner_pid(store, sid)
        old_token = store.sessions.get(sid).lease_token
        assert frozen is not None
        psutil.Process(frozen).suspend()
        gate.touch()
        try:
            ended = wait_until(
                lambda: turn_ended(store, sid, seq), 30, "another worker to finish the turn"
            )
            new_token = store.sessions.get(sid).lease_token
            assert new_token > old_token
        finally:
            psutil.Process(frozen).resume()
        # The frozen worker wakes up inside its turn and tries to commit the answer.
        wait_until(lambda: "fenced out" in daemon.log(), 30, "the old worker to log being fenced")
        after = [e for e in events(store, sid) if e.seq > seq]
        assert [e.type for e in after].count("model_response") == 1
        assert [e.type for e in after].count("turn_ended") == 1
        late = [e for e in after if e.seq > ended.seq]
        assert late == [], f"the fenced worker committed {late}"
        assert all(e.lease_token != old_token for e in after if e.type != "turn_started")


def test_a_turn_that_keeps_killing_its_worker_is_quarantined(daemons: Daemons) -> None:
    daemon = daemons().start()
    with Store(daemon.url, migrate=False) as store:
        poisoned = store.sessions.create("test").id
        healthy = store.sessions.create("test").id
        inject(store, poisoned, "/crash")
        wait_until(
            lambda: store.sessions.get(poisoned).status == "quarantined",
            60,
            "the poisoned session to be quarantined",
        )
        found = events(store, poisoned)
        # The turn's own run, then 3 continuation attempts, each of which died too.
        assert [e.type for e in found].count("continuation") == 3
        assert [e.type for e in found].count("tool_call") == 4
        notice = next(e for e in found if e.type == "notice")
        assert "quarantined" in notice.payload["text"] and notice.payload["resend"] is True
        assert "attempts to continue it failed" in notice.payload["text"]
        # Recovery stopped it, not the breaker: this daemon never restarted.
        assert "breaker TRIPPED" not in daemon.log()
        assert re.search(r"\[recovery\].*3 attempts failed", daemon.log())
        assert found[-1].type == "turn_ended" and found[-1].payload["reason"] == "quarantined"
        seq = inject(store, healthy, "still serving")
        ended = wait_until(lambda: turn_ended(store, healthy, seq), 20, "the healthy turn")
        assert ended.payload["outcome"] == "completed"
        # The quarantined session is left alone, even with new input, until released.
        inject(store, poisoned, "hello?")
        # A positive signal first: input sent after it was taken up and answered.
        seq = inject(store, healthy, "and after it")
        wait_until(lambda: turn_ended(store, healthy, seq), 20, "the later healthy turn")
        assert store.sessions.get(poisoned).status == "quarantined"
        released = subprocess.run(
            [
                PYTHON,
                "-m",
                "supervisor",
                "--config",
                str(daemon.config_path),
                "sessions",
                "release",
                poisoned,
            ],
            cwd=REPO,
            env=python_env(),
            capture_output=True,
            text=True,
        )
        assert released.returncode == 0, released.stderr
        wait_until(
            lambda: (
                (e := turn_ended(store, poisoned, found[-1].seq))
                and e.payload["outcome"] == "completed"
            ),
            20,
            "the released session to answer",
        )


def test_a_plugin_that_cannot_load_is_a_configuration_error(daemons: Daemons) -> None:
    daemon = daemons(agent={"class": "no_such_module:Agent"})
    daemon.start(wait=False)
    assert daemon.wait(30) == 78
    lines = [line for line in daemon.log().splitlines() if line and not line.startswith("---")]
    assert len(lines) == 1 and "agent.class" in lines[0] and "no_such_module" in lines[0]


@pytest.mark.timeout(120)
def test_the_daemon_exits_non_zero_when_no_worker_can_start(daemons: Daemons) -> None:
    daemon = daemons(
        pool={"workers": 1, "spare": 0}, agent={"class": "tests.agents_broken:BrokenAgent"}
    )
    daemon.start(wait=False)
    assert daemon.wait(90) == 1
    log = daemon.log()
    assert log.count("slot 0 is fatal") == 1
    assert "every slot is fatal" in log
    assert "[daemon] ready" not in log
    with Store(daemon.url, migrate=False) as store:
        assert store.boots.recent(1)[0].outcome == "startup_failed"
