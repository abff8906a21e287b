"""The boot breaker, driven directly with made-up boot rows and times."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.breaker import RETENTION, BootRecord, BreakerState, evaluate, prune_before

NOW = 10_000.0
WINDOW = 300.0


def died(started_at: float) -> BootRecord:
    """An earlier boot that never ended: the process died."""
    return BootRecord(started_at)


def ended(started_at: float, outcome: str) -> BootRecord:
    """An earlier boot that ended 1 s after it started, with `outcome`."""
    return BootRecord(started_at, started_at + 1.0, outcome)


def current(started_at: float = NOW) -> BootRecord:
    """The boot doing the evaluating."""
    return BootRecord(started_at, is_current=True)


def judge(
    boots: list[BootRecord] | None, now: float = NOW, reset_at: float | None = None
) -> BreakerState:
    """The breaker with the default threshold (3) and window (300 s)."""
    return evaluate(boots, now, 3, WINDOW, reset_at)


# -- what counts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("boot", "counts"),
    [
        pytest.param(died(NOW - 10), True, id="never-ended"),
        pytest.param(ended(NOW - 10, "startup_failed"), False, id="startup-failed"),
        pytest.param(ended(NOW - 10, "unclean"), True, id="marked-unclean"),
        pytest.param(ended(NOW - 10, "clean"), False, id="clean"),
        pytest.param(BootRecord(NOW - 10, None, "clean"), True, id="clean-without-end-time"),
        pytest.param(current(NOW - 10), False, id="current-boot"),
        pytest.param(
            BootRecord(NOW - 10, NOW - 9, "startup_failed", True), False, id="current-failed"
        ),
    ],
)
def test_what_counts_as_unclean(boot: BootRecord, counts: bool) -> None:
    assert boot.unclean is counts
    assert judge([boot]).unclean_in_window == int(counts)


@pytest.mark.parametrize(
    ("earlier", "tripped"),
    [
        ([], False),
        ([died(NOW - 30)], False),
        ([died(NOW - 30), died(NOW - 20)], False),
        ([died(NOW - 30), died(NOW - 20), died(NOW - 10)], True),
        ([died(NOW - 40), died(NOW - 30), died(NOW - 20), died(NOW - 10)], True),
        ([died(NOW - 30), ended(NOW - 20, "startup_failed"), died(NOW - 10)], False),
        ([died(NOW - 30), ended(NOW - 20, "unclean"), died(NOW - 10)], True),
        ([died(NOW - 30), ended(NOW - 20, "clean"), died(NOW - 10)], False),
    ],
)
def test_threshold_is_reached_on_the_fourth_boot(earlier: list[BootRecord], tripped: bool) -> None:
    """3 unclean boots before this one trip it; this boot itself is not counted."""
    state = judge([*earlier, current()])
    assert state.tripped is tripped
    assert (state.clears_at is not None) is tripped
    assert not state.fails_open


def test_a_start_that_keeps_failing_before_it_serves_never_trips_it() -> None:
    """A port taken under `Restart=always`: a boot a second, each `startup_failed`, then
    the start that binds. Those boots ran no session: the breaker stays clear, and the
    unclean boots around them still count as before."""
    failed = [ended(NOW - 60 + i, "startup_failed") for i in range(50)]
    assert judge([*failed, current()]) == BreakerState(
        False, 0, "0 unclean boots in the last 300 s (threshold 3)"
    )
    state = judge([died(NOW - 100), *failed, died(NOW - 5), died(NOW - 2), current()])
    assert (state.tripped, state.unclean_in_window) == (True, 3)


def test_threshold_of_one() -> None:
    assert evaluate([died(NOW - 1), current()], NOW, 1, WINDOW).tripped
    assert not evaluate([current()], NOW, 1, WINDOW).tripped


# -- the window edges -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("started_at", "counts"),
    [
        pytest.param(NOW - WINDOW, False, id="exactly-window-old"),
        pytest.param(math.nextafter(NOW - WINDOW, math.inf), True, id="a-hair-younger"),
        pytest.param(NOW - WINDOW - 1, False, id="older"),
        pytest.param(NOW, True, id="started-now"),
        pytest.param(NOW + 60, True, id="stamped-in-the-future"),
    ],
)
def test_window_edge(started_at: float, counts: bool) -> None:
    state = judge([died(started_at), died(NOW - 1), died(NOW - 2)])
    assert state.unclean_in_window == 2 + counts
    assert state.tripped is counts


def test_clears_when_the_oldest_counted_boot_leaves_the_window() -> None:
    boots = [died(NOW - 100), died(NOW - 50), died(NOW - 10), current()]
    state = judge(boots)
    assert state.clears_at == NOW - 100 + WINDOW
    assert judge(boots, now=math.nextafter(state.clears_at, 0.0)).tripped
    assert not judge(boots, now=state.clears_at).tripped


def test_clears_at_with_more_than_threshold() -> None:
    """5 unclean boots, threshold 3: it clears when the 3rd newest leaves, not the oldest."""
    boots = [died(NOW - age) for age in (200, 150, 100, 50, 10)]
    state = judge(boots)
    assert (state.unclean_in_window, state.clears_at) == (5, NOW - 100 + WINDOW)
    assert "suppressed" in state.reason and "breaker reset" in state.reason


# -- reset, fail open, pruning ----------------------------------------------------------


@pytest.mark.parametrize(
    ("reset_at", "count", "tripped"),
    [
        pytest.param(None, 3, True, id="no-reset"),
        pytest.param(NOW - 35, 3, True, id="reset-before-all"),
        pytest.param(NOW - 30, 2, False, id="reset-exactly-at-a-start"),
        pytest.param(NOW - 15, 1, False, id="reset-between"),
        pytest.param(NOW, 0, False, id="reset-now"),
    ],
)
def test_reset(reset_at: float | None, count: int, tripped: bool) -> None:
    state = judge([died(NOW - 30), died(NOW - 20), died(NOW - 10), current()], reset_at=reset_at)
    assert (state.unclean_in_window, state.tripped) == (count, tripped)


def test_unclean_boots_after_a_reset_trip_it_again() -> None:
    boots = [died(NOW - 250 + i) for i in range(3)] + [died(NOW - 30 + i) for i in range(3)]
    assert judge(boots, reset_at=NOW - 100).tripped
    assert judge(boots, reset_at=NOW - 100).unclean_in_window == 3


def test_unreadable_log_fails_open() -> None:
    state = judge(None)
    assert state == BreakerState(False, 0, state.reason, None, fails_open=True)
    assert "could not be read" in state.reason and "fails open" in state.reason


def test_prune_before_is_24_hours_back() -> None:
    assert prune_before(NOW) == NOW - 24 * 3600 == NOW - RETENTION


@pytest.mark.parametrize(("threshold", "window"), [(0, WINDOW), (3, 0.0), (3, -1.0)])
def test_bad_settings_are_refused(threshold: int, window: float) -> None:
    with pytest.raises(ValueError, match="breaker"):
        evaluate([], NOW, threshold, window)


# -- properties -------------------------------------------------------------------------

OUTCOMES = st.sampled_from([None, "clean", "startup_failed", "unclean"])


@st.composite
def boot_logs(draw: st.DrawFn) -> list[BootRecord]:
    """Boot rows at whole seconds around NOW (so the reference arithmetic is exact)."""
    rows = draw(
        st.lists(
            st.builds(
                BootRecord,
                started_at=st.integers(int(NOW) - 1000, int(NOW) + 50).map(float),
                ended_at=st.one_of(st.none(), st.just(NOW)),
                outcome=OUTCOMES,
            ),
            max_size=12,
        )
    )
    if draw(st.booleans()):
        rows.append(current(float(draw(st.integers(int(NOW) - 100, int(NOW))))))
    return rows


@given(
    boots=boot_logs(),
    threshold=st.integers(1, 5),
    window=st.integers(1, 600).map(float),
    reset_at=st.one_of(st.none(), st.integers(int(NOW) - 1000, int(NOW)).map(float)),
    seed=st.integers(),
)
def test_state_matches_a_plain_count(
    boots: list[BootRecord], threshold: int, window: float, reset_at: float | None, seed: int
) -> None:
    counted = [
        b
        for b in boots
        if not b.is_current
        and not (b.ended_at is not None and b.outcome in ("clean", "startup_failed"))
        and NOW - b.started_at < window
        and (reset_at is None or b.started_at > reset_at)
    ]
    state = evaluate(boots, NOW, threshold, window, reset_at)
    assert state.unclean_in_window == len(counted)
    assert state.tripped is (len(counted) >= threshold)
    assert (state.clears_at is None) is not state.tripped
    assert not state.fails_open and state.reason
    shuffled = boots[:]
    random.Random(seed).shuffle(shuffled)
    assert evaluate(shuffled, NOW, threshold, window, reset_at) == state
    without_current = [b for b in boots if not b.is_current]
    assert evaluate(without_current, NOW, threshold, window, reset_at).tripped is state.tripped


@given(
    boots=boot_logs(),
    threshold=st.integers(1, 5),
    window=st.floats(0.001, 600.0),
    fraction=st.floats(0.0, 1.0),
)
def test_stays_tripped_until_clears_at_then_clears(
    boots: list[BootRecord], threshold: int, window: float, fraction: float
) -> None:
    state = evaluate(boots, NOW, threshold, window)
    if state.clears_at is None:
        assert not state.tripped
        return
    assert state.clears_at > NOW
    before = math.nextafter(state.clears_at, -math.inf)
    between = min(before, NOW + fraction * (state.clears_at - NOW))
    assert evaluate(boots, between, threshold, window).tripped
    assert evaluate(boots, before, threshold, window).tripped
    after = evaluate(boots, state.clears_at, threshold, window)
    assert not after.tripped and after.unclean_in_window < threshold


def test_the_daemon_fails_open_when_the_boot_log_cannot_be_read() -> None:
    from types import SimpleNamespace

    from supervisor.contract.config import Config
    from supervisor.metrics import Metrics
    from supervisor.pool.recoverer import Recoverer

    def unreadable(host: str, since: float) -> list[object]:
        raise OSError("disk I/O error")

    recorded: list[dict[str, object]] = []
    store = SimpleNamespace(
        now=lambda: 1000.0,
        boots=SimpleNamespace(
            of_host=unreadable, set_breaker=lambda boot, state: recorded.append(state)
        ),
    )
    metrics = Metrics()
    recoverer = Recoverer(Config(), store, "b" * 32, "host", metrics)  # type: ignore[arg-type]
    state = recoverer.evaluate_breaker()
    assert (state.tripped, state.fails_open) == (False, True)
    assert "could not be read" in state.reason and "fails open" in state.reason
    assert recorded and recorded[0]["fails_open"] is True
    assert b"turnkeeper_breaker_tripped 0.0" in metrics.render()
