"""The turn time the console charts (`turnkeeper_turn_seconds`): timed from the commits the
daemon hears of, a turn whose start it never heard of not timed, the map of turns in
flight bounded. Pure: an injected time, no daemon."""

from __future__ import annotations

from supervisor.metrics import Metrics, TurnClock


def timed(metrics: Metrics) -> list[float]:
    """(count, sum) of the histogram."""
    samples = {
        s.name: s.value
        for family in metrics.turn_seconds.collect()
        for s in family.samples
        if s.name.endswith(("_count", "_sum"))
    }
    return [samples["turnkeeper_turn_seconds_count"], samples["turnkeeper_turn_seconds_sum"]]


def test_a_turn_is_timed_from_its_start_or_continuation_to_its_end() -> None:
    metrics = Metrics()
    clock = TurnClock(metrics)
    clock.heard("a", "turn_started", 10.0)
    clock.heard("a", "model_response", 11.0)
    clock.heard("b", "turn_ended", 12.0)  # its start was never heard: not timed
    clock.heard("a", "turn_ended", 12.5)
    assert timed(metrics) == [1.0, 2.5]
    clock.heard("a", "continuation", 20.0)  # a turn going on after a restart
    clock.heard("a", "turn_ended", 21.0)
    clock.heard("a", "turn_ended", 22.0)  # twice: timed once
    assert timed(metrics) == [2.0, 3.5]


def test_the_turns_followed_are_bounded() -> None:
    metrics = Metrics()
    clock = TurnClock(metrics, cap=3)
    for n, session in enumerate("abcd"):
        clock.heard(session, "turn_started", float(n))
    assert list(clock.began) == ["b", "c", "d"]  # the oldest start dropped
    clock.heard("a", "turn_ended", 9.0)
    clock.heard("d", "turn_ended", 9.0)
    assert timed(metrics) == [1.0, 6.0]
