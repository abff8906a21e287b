"""File descriptors, as pure arithmetic (issue 32): what the daemon holds back for itself
grows with its pool, database threads, tasks and deliveries; `http.max_connections` is
served as configured only when it fits under the limit less that; running out at accept
is told at once, then once a minute with the count since. No I/O: the limit, the
configuration's figures and the time are arguments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract import fdlimit
from supervisor.contract.config import Config
from supervisor.contract.limits import DB_THREADS
from supervisor.core.descriptors import (
    BASE,
    MARGIN,
    MIN_CONNECTIONS,
    PER_CONNECTION,
    PER_WORKER,
    Needs,
    Tally,
    cap,
    needed,
)
from tests.clock import FakeClock

NONE = Needs(workers=0, db_connections=0, tasks=0, deliveries=0)


def test_the_reserve_counts_each_thing_the_daemon_opens_besides_connections() -> None:
    floor = NONE.reserve()
    assert floor == BASE + MARGIN + 2 * PER_CONNECTION  # the loop's and the listener's
    # A worker twice over (its replacement in a reload), each with its pipes and socket.
    assert Needs(3, 0, 0, 0).reserve() == floor + 2 * 3 * PER_WORKER
    assert Needs(0, 8, 0, 0).reserve() == floor + 8 * PER_CONNECTION
    assert Needs(0, 0, 32, 0).reserve() == floor + 32  # a pidfd per running task
    assert Needs(0, 0, 0, 48).reserve() == floor + 48  # a connection per delivery in flight


def test_the_shipped_configuration_is_served_as_configured_under_the_units_limit() -> None:
    config = Config()
    reserve = fdlimit.needs(config).reserve()
    assert fdlimit.needs(config) == Needs(
        workers=3, db_connections=DB_THREADS, tasks=32, deliveries=0
    )
    served = cap(config.http.max_connections, 65536, reserve)  # LimitNOFILE=65536
    assert not served.clamped and served.effective == 1024
    # Under the soft limit most hosts start a program with, 1024 does not fit.
    at_1024 = cap(config.http.max_connections, 1024, reserve)
    assert at_1024.clamped and at_1024.effective == 1024 - reserve
    assert needed(config.http.max_connections, reserve) == 1024 + reserve


def test_deliveries_count_for_every_target() -> None:
    config = Config.model_validate(
        {
            "delivery": {
                "concurrency": 5,
                "targets": [
                    {"name": "a", "url": "http://127.0.0.1:9/a", "secret_env": "A_KEY"},
                    {"name": "b", "url": "http://127.0.0.1:9/b", "secret_env": "B_KEY"},
                ],
            }
        }
    )
    assert fdlimit.needs(config).deliveries == 10


def test_the_clamp_line_names_the_key_both_values_and_what_to_raise() -> None:
    line = cap(1024, 1024, 214).explain()
    assert "http.max_connections 1024" in line
    assert "serving at most 810 connections" in line
    assert "limit is 1024 and 214 are held back" in line
    assert "LimitNOFILE=" in line


def test_a_limit_under_the_reserve_keeps_a_floor_and_says_the_limit_is_too_low() -> None:
    served = cap(1024, 200, 214)
    assert served.starved and served.effective == MIN_CONNECTIONS
    assert "raise the limit" in served.explain()
    # A configured cap under the floor is kept as it is.
    assert cap(3, 200, 214).effective == 3


@given(
    configured=st.integers(1, 100_000),
    soft=st.integers(1, 1 << 20),
    reserve=st.integers(0, 100_000),
)
def test_the_cap_never_exceeds_the_configured_value_or_the_room_left(
    configured: int, soft: int, reserve: int
) -> None:
    served = cap(configured, soft, reserve)
    assert 1 <= served.effective <= configured
    assert served.effective <= max(soft - reserve, MIN_CONNECTIONS)
    assert served.clamped == (served.effective < configured)
    # Served as configured exactly when the limit holds the connections and the reserve.
    if soft - reserve >= MIN_CONNECTIONS:
        assert (not served.clamped) == (soft >= needed(configured, reserve))


def test_running_out_is_told_at_once_then_once_a_minute_with_the_count_since() -> None:
    clock = FakeClock()
    tally = Tally(every=60.0)
    told: list[tuple[float, int]] = []

    def occurs(times: int, apart: float) -> None:
        for _ in range(times):
            clock.sleep_blocking(apart)
            count = tally.note(clock.monotonic())
            if count is not None:
                told.append((clock.monotonic() - 1_000.0, count))

    occurs(1, 0.0)
    assert told == [(0.0, 1)]  # the first at once
    occurs(479, 0.125)  # eight a second: nothing more within the minute
    assert told == [(0.0, 1)] and tally.pending == 479
    occurs(1, 0.125)  # the minute is over: one line, with the count since the first
    assert told == [(0.0, 1), (60.0, 480)]
    assert tally.pending == 0
    clock.sleep_blocking(3600.0)  # quiet for an hour: the next one is told at once again
    occurs(1, 0.0)
    assert told[-1] == (3660.0, 1)


@pytest.mark.parametrize("every", [1.0, 60.0])
def test_a_count_never_goes_missing_between_lines(every: float) -> None:
    clock = FakeClock()
    tally = Tally(every=every)
    total = 0
    for _ in range(1000):
        total += tally.note(clock.monotonic()) or 0
        clock.sleep_blocking(0.37)
    assert total + tally.pending == 1000
