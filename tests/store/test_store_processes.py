"""The store under real processes: contention, fencing and SIGKILL on one SQLite file."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.procs.appender", *args],
        cwd=REPO,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def committed_lines(output: str) -> list[tuple[str, int, str]]:
    rows = []
    for line in output.splitlines():
        parts = line.split()
        # A SIGKILL can cut the last line short; a partial line is no report.
        if len(parts) == 4 and parts[0] == "ok" and len(parts[3]) == 32:
            rows.append((parts[1], int(parts[2]), parts[3]))
    return rows


def stored(store: Store, session_id: str) -> dict[int, str]:
    events = store.events.read(session_id, limit=1_000_000)
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), "seqs are not contiguous"
    assert store.sessions.get(session_id).last_seq == len(seqs)
    return {e.seq: e.payload["marker"] for e in events}


def test_four_processes_contending_for_the_same_sessions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tk.db'}"
    with Store(url) as store:
        sessions = [store.sessions.create("test").id for _ in range(3)]
    procs = [spawn("contend", url, "4", *sessions) for _ in range(4)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "locked" not in err
        outputs.append(out)
    everything = "\n".join(outputs)
    results = Counter(line.split()[0] for line in everything.splitlines() if line)
    # Both outcomes happened: appends committed, and stale writers were fenced out.
    assert results["ok"] > 100 and results["lost"] > 0, results
    assert set(results) == {"ok", "lost"}
    with Store(url, migrate=False) as store:
        logs = {sid: stored(store, sid) for sid in sessions}
    reported = committed_lines(everything)
    assert len(reported) == results["ok"]
    for sid, seq, marker in reported:
        assert logs[sid][seq] == marker
    # Nothing was stored that no process was told had committed.
    assert sum(len(log) for log in logs.values()) == len(reported)


@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_loses_no_returned_append(tmp_path: Path) -> None:
    path = tmp_path / "tk.db"
    url = f"sqlite:///{path}"
    with Store(url) as store:
        sessions = [store.sessions.create("test").id for _ in range(4)]
    rng = random.Random(20)
    returned: list[tuple[str, int, str]] = []
    for _ in range(20):
        proc = spawn("loop", url, "6", *sessions)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        returned.extend(committed_lines(out))
    assert len(returned) > 200
    with Store(url, migrate=False) as store:
        logs = {sid: stored(store, sid) for sid in sessions}
    for sid, seq, marker in returned:
        assert logs[sid].get(seq) == marker, f"append {sid}:{seq} returned but is not stored"
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
