"""The pool's count of the deltas lost between a worker and the supervisor: a gap in a
turn's indexes is that many lost; an index at or below one seen (the turn went on with
another worker, or began again) starts counting afresh and is no loss."""

from __future__ import annotations

from supervisor.pool.deltas import DeltaIndexes

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
