"""The one backoff: its jitter and its fixed runs of tries, and the waits of each retry that
uses it, as they were when each wrote its own doubling."""

from __future__ import annotations

import peewee
import pytest

from supervisor.core.backoff import Backoff
from supervisor.deliveries.rules import Policy
from supervisor.store.db import BUSY_BACKOFF, run_write
from supervisor.tasks.runner import BACKOFF as TASK_RUNNER_BACKOFF
from workers.runner import STORAGE_RETRY


@pytest.mark.parametrize(
    ("failures", "jitter", "wait"),
    [(1, 0.0, 1.0), (1, 1.0, 2.0), (1, 0.5, 1.5), (3, 0.0, 4.0), (3, 1.0, 8.0), (9, 0.25, 12.5)],
)
def test_the_jitter_spreads_a_wait_over_its_upper_half(
    failures: int, jitter: float, wait: float
) -> None:
    assert Backoff(initial=2.0, factor=2.0, cap=20.0).jittered(failures, jitter) == wait


@pytest.mark.parametrize("jitter", [-0.01, 1.01])
def test_a_jitter_outside_zero_to_one_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError, match="jitter"):
        Backoff().jittered(1, jitter)


def test_a_jittered_wait_past_any_float_is_the_cap() -> None:
    assert Backoff(initial=1.0, cap=10.0).jittered(10**6, 1.0) == 10.0


def test_a_run_of_tries_is_the_first_waits_in_order() -> None:
    assert Backoff(initial=0.5, factor=2.0, cap=3.0).delays(5) == (0.5, 1.0, 2.0, 3.0, 3.0)
    assert Backoff().delays(0) == ()


@pytest.mark.parametrize(("base", "cap"), [(5.0, 600.0), (0.1, 0.1), (3.0, 7.0)])
def test_the_deliveries_wait_as_their_own_doubling_did(base: float, cap: float) -> None:
    policy = Policy(max_attempts=5, base=base, cap=cap)
    for failed in (1, 2, 3, 8, 40, 5000):
        for jitter in (0.0, 0.3, 1.0):
            full = min(cap, base * 2.0 ** (failed - 1)) if failed < 1000 else cap
            assert policy.delay(failed, jitter) == full / 2 + jitter * full / 2


def test_the_retries_of_a_task_runner_wait_half_a_second_doubling_four_times() -> None:
    assert TASK_RUNNER_BACKOFF == (0.5, 1.0, 2.0, 4.0)


def test_a_session_runner_waits_a_second_doubling_up_to_thirty_for_the_database() -> None:
    waits = [STORAGE_RETRY.delay(n) for n in range(1, 9)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_busy_database_is_tried_again_after_waits_doubling_from_5_ms_to_half_a_second() -> None:
    db = peewee.SqliteDatabase(":memory:")
    slept: list[float] = []
    failures = iter([*(["locked"] * 9), "integrity", "locked", None])

    def work() -> str:
        failure = next(failures)
        if failure == "locked":
            raise peewee.OperationalError("database is locked")
        if failure == "integrity":
            raise peewee.IntegrityError("UNIQUE constraint failed")
        return "written"

    assert run_write(db, work, sleep=slept.append, clock=lambda: 0.0) == "written"
    doubling = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]
    assert slept == [*doubling, 0.5]  # an integrity retry waits not, nor resets the waits
    assert [BUSY_BACKOFF.delay(n) for n in range(1, 10)] == doubling
