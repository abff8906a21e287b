"""Hung workers, judged with a clock that is a number: a silence past `hang_timeout` is
looked at once more before the worker is aborted, because the silence may be the
supervisor's own (it was stopped with its workers: a paused host, a frozen cgroup)."""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor.contract.config import PoolConfig
from supervisor.pool import processes
from supervisor.pool.processes import ABORT_GRACE, CONFIRM_HEARTBEATS, CONFIRM_MIN, check_hangs

POOL = PoolConfig(heartbeat_interval=1.0, hang_timeout=5.0)
CONFIRM = max(CONFIRM_HEARTBEATS * POOL.heartbeat_interval, CONFIRM_MIN)


def worker(last_heartbeat: float) -> Any:
    return SimpleNamespace(
        alive=True, stop_requested=False, aborted_at=None, suspected_at=None, ready=True,
        last_heartbeat=last_heartbeat, identity="w0.1", pid=4242,
    )  # fmt: skip


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(processes, "send_signal", lambda pid, sig: signals.append((pid, sig)))
    return signals


def test_a_worker_heard_from_after_the_supervisor_was_stopped_is_not_aborted(
    sent: list[tuple[int, int]],
) -> None:
    w = worker(last_heartbeat=100.0)
    # The supervisor ran again at 108 after a stop: 8 s of silence, not the worker's.
    assert check_hangs([w], 108.0, POOL) == 108.0 + CONFIRM
    assert sent == [] and w.aborted_at is None
    w.last_heartbeat = 108.2  # its heartbeat arrives as soon as it runs again
    assert check_hangs([w], 108.0 + CONFIRM, POOL) == 108.2 + POOL.hang_timeout
    assert sent == []


def test_a_worker_still_silent_after_a_second_look_is_aborted(
    sent: list[tuple[int, int]],
) -> None:
    w = worker(last_heartbeat=100.0)
    assert check_hangs([w], 105.5, POOL) == 105.5 + CONFIRM
    assert check_hangs([w], 105.5 + CONFIRM / 2, POOL) == 105.5 + CONFIRM  # not yet
    assert sent == []
    at = 105.5 + CONFIRM
    assert check_hangs([w], at, POOL) == at + ABORT_GRACE
    assert sent == [(4242, signal.SIGABRT)] and w.aborted_at == at
    check_hangs([w], at + ABORT_GRACE, POOL)
    assert sent[-1] == (4242, signal.SIGKILL)
