"""The pool's count of the deltas lost between a worker and the supervisor: a gap in a
turn's indexes is that many lost; an index at or below one seen (the turn went on with
another worker, or began again) starts counting afresh and is no loss."""

from __future__ import annotations

import pytest

from supervisor.pool import deltas
from supervisor.pool.deltas import DeltaIndexes, StreamedText

S, T, U = "s" * 32, "t" * 32, "u" * 32


def test_a_gap_in_a_turns_indexes_is_the_deltas_lost() -> None:
    indexes = DeltaIndexes()
    assert [indexes.missed("w0.1", S, T, i) for i in (0, 1, 4, 5, 9)] == [0, 0, 2, 0, 3]


def test_the_first_deltas_of_a_turn_lost_count_too() -> None:
    assert DeltaIndexes().missed("w0.1", S, T, 3) == 3


def test_another_worker_or_turn_or_a_new_start_counts_afresh() -> None:
    indexes = DeltaIndexes()
    assert indexes.missed("w0.1", S, T, 5) == 5
    assert indexes.missed("w1.1", S, T, 2) == 2  # the turn went on with another worker
    assert indexes.missed("w1.1", S, U, 0) == 0  # the next turn
    assert indexes.missed("w1.1", S, U, 1) == 0
    assert indexes.missed("w1.1", S, U, 0) == 0  # the same worker began it again


def test_sessions_are_counted_apart_and_forgotten() -> None:
    indexes = DeltaIndexes()
    indexes.missed("w0.1", S, T, 0)
    indexes.missed("w0.1", U, T, 0)
    assert indexes.missed("w0.1", U, T, 2) == 1
    indexes.forget(S)
    indexes.forget(U)
    assert len(indexes) == 0


# --- the text streamed since the last answer: what an interrupt commits as the cut ---


def test_the_text_streamed_since_the_last_answer_is_kept_whole() -> None:
    streamed = StreamedText()
    assert streamed.get(S) is None
    for piece in ("echo:", " one", " two"):
        streamed.add(S, T, piece)
    assert streamed.get(S) == (T, "echo: one two", True)
    streamed.answered(S)  # committed: what streams next is the next model call's
    assert streamed.get(S) is None
    streamed.add(S, T, "next")
    assert streamed.get(S) == (T, "next", True)


def test_a_new_turn_starts_afresh_and_a_lost_delta_marks_the_text_incomplete() -> None:
    streamed = StreamedText()
    streamed.add(S, T, "old")
    streamed.add(S, U, "new")
    assert streamed.get(S) == (U, "new", True)
    streamed.add(S, U, " more", missed=2)
    assert streamed.get(S) == (U, "new more", False)
    streamed.forget(S)
    assert streamed.get(S) is None


def test_the_text_kept_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deltas, "MAX_STREAMED", 10)
    streamed = StreamedText()
    streamed.add(S, T, "0123456")
    streamed.add(S, T, "789abc")
    assert streamed.get(S) == (T, "0123456789", False)
