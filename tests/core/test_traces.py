"""The trace of a run of a turn: ids derived, traceparent read (pure, no I/O)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.traces import SpanIds, Trigger, parse_traceparent, run_root, trigger_of

TURN = "ab" * 16


def test_a_run_s_root_is_a_function_of_its_turn_and_its_opening_seq() -> None:
    assert run_root(TURN, 7) == run_root(TURN, 7)
    assert run_root(TURN, 7) != run_root(TURN, 8)
    assert run_root(TURN, 7) != run_root("cd" * 16, 7)
    ids = run_root(TURN, 7)
    assert 0 < ids.trace_id < 2**128 and 0 < ids.span_id < 2**64


@given(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32), st.integers(1, 2**62))
def test_a_root_s_traceparent_reads_back_as_itself(turn: str, seq: int) -> None:
    ids = run_root(turn, seq)
    assert parse_traceparent(ids.traceparent) == ids


def test_a_traceparent_as_w3c_writes_it() -> None:
    value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(value) == SpanIds(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    )
    # A later version may carry more fields after the four it shares with 00.
    assert parse_traceparent("01-" + value[3:] + "-more") is not None


def test_anything_else_is_no_traceparent_and_no_error() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for bad in [
        None,
        7,
        {"traceparent": good},
        "",
        good.upper(),
        good + "-extra",  # version 00 has exactly four fields
        "ff" + good[2:],  # version ff is invalid
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        good + "\n",
        "01-" + good[3:] + "-" + "x" * 200,  # past any length a traceparent has
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\x00",
    ]:
        assert parse_traceparent(bad) is None, bad


@given(st.text(max_size=200))
def test_no_text_makes_the_parser_raise(text: str) -> None:
    parse_traceparent(text)


def test_what_started_a_run() -> None:
    assert trigger_of("turn_started", ["intake", "schedule"], False) is Trigger.INTAKE
    assert trigger_of("turn_started", ["task_result"], True) is Trigger.TASK_RESULT
    assert trigger_of("turn_started", [], False) is Trigger.INPUT
    assert trigger_of("continuation", ["intake"], True) is Trigger.RECOVERY
    assert trigger_of("continuation", [], False) is Trigger.CONTINUATION
