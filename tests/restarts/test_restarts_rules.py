"""The restart rules as pure code: a reason made safe to store and show, the admission
table (a live request first, then the rate limit), the settlement table, and the words
the user and the model are told."""

from __future__ import annotations

import re
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.vocabulary import RestartOutcome, RestartState
from supervisor.restarts.rules import (
    BEFORE_BEGIN,
    REASON_MAX,
    Admission,
    Settlement,
    admit,
    clean_reason,
    notice_text,
    result_text,
    settle,
    wait_left,
)
from supervisor.store import EventRecord
from supervisor.store.events import SessionRow, advance, make_request
from workers.history import message_of
from workers.models import Message

OK, FAILED = RestartOutcome.OK, RestartOutcome.FAILED
PENDING, RESTARTING = RestartState.PENDING, RestartState.RESTARTING

# --- clean_reason ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("", ""),
        ("   ", ""),
        ("deploy 0.9.1", "deploy 0.9.1"),
        ("  new\tconfig\r\n\n loaded  ", "new config loaded"),
        ("bell\x07 and\x00nul\x1b[31m", "bell andnul[31m"),
        ("a \x00 b", "a b"),  # a dropped control leaves no double space
        ("right\u202eto left\u200b", "rightto left"),  # bidi override, zero-width space
        ("lone \ud800 surrogate", "lone surrogate"),
        ("über ✓ 重启", "über ✓ 重启"),
        ("x" * 600, "x" * REASON_MAX),
        ("y" * 499 + " z", "y" * 499),  # no space left at the cut
    ],
)
def test_a_reason_is_cleaned(given: str, expected: str) -> None:
    assert clean_reason(given) == expected


@pytest.mark.parametrize("given", [None, 3, b"bytes", ["a"], {"text": "a"}])
def test_a_reason_that_is_not_a_string_is_refused(given: object) -> None:
    with pytest.raises(ValueError, match=r"^reason must be a string$"):
        clean_reason(given)


@given(st.text())
def test_a_cleaned_reason_is_short_and_has_no_control_characters(text: str) -> None:
    cleaned = clean_reason(text)
    assert len(cleaned) <= REASON_MAX
    assert all(unicodedata.category(ch) not in ("Cc", "Cf", "Cs") for ch in cleaned)
    assert cleaned == cleaned.strip() and "  " not in cleaned
    assert all(ch == " " or not ch.isspace() for ch in cleaned)
    assert clean_reason(cleaned) == cleaned  # cleaning is done once and for all
    cleaned.encode("utf-8")  # storable on every backend


# --- admit -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "last", "now", "min_interval", "expected"),
    [
        (False, None, 1000.0, 60.0, Admission("new")),
        (False, 900.0, 1000.0, 60.0, Admission("new")),
        (False, 940.0, 1000.0, 60.0, Admission("new")),  # exactly min_interval ago
        (False, 950.0, 1000.0, 60.0, Admission("rate_limited", 10.0)),
        (False, 999.5, 1000.0, 60.0, Admission("rate_limited", 59.5)),
        # A live request answers first, whatever the rate limit says.
        (True, 999.0, 1000.0, 60.0, Admission("in_progress")),
        (True, None, 1000.0, 60.0, Admission("in_progress")),
        (True, 100.0, 1000.0, 0.0, Admission("in_progress")),
        # No limit at all.
        (False, 1000.0, 1000.0, 0.0, Admission("new")),
        (False, 2000.0, 1000.0, 0.0, Admission("new")),
        # A clock stepped back: never a wait longer than min_interval.
        (False, 5000.0, 1000.0, 60.0, Admission("rate_limited", 60.0)),
    ],
)
def test_admission(
    active: bool, last: float | None, now: float, min_interval: float, expected: Admission
) -> None:
    got = admit(active, last, now, min_interval)
    assert got.verdict == expected.verdict
    assert got.retry_after == pytest.approx(expected.retry_after)


@given(
    st.floats(0, 1e9, allow_nan=False),
    st.floats(-1e4, 1e4, allow_nan=False),
    st.floats(0, 1e4, allow_nan=False),
)
def test_a_rate_limited_request_waits_at_most_min_interval(
    now: float, ago: float, min_interval: float
) -> None:
    got = admit(False, now - ago, now, min_interval)
    if got.verdict == "rate_limited":
        assert 0 < got.retry_after <= min_interval
    else:
        assert got.verdict == "new" and got.retry_after == 0.0


# --- settle ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "boot", "refused", "outcome", "detail"),
    [
        (RESTARTING, "clean", None, OK, "^$"),
        (PENDING, "clean", None, OK, "^" + re.escape(BEFORE_BEGIN) + "$"),
        (RESTARTING, "unclean", None, FAILED, r"did not stop cleanly \(something was left"),
        (PENDING, "unclean", None, FAILED, r"did not stop cleanly .* started again$"),
        (RESTARTING, "startup_failed", None, FAILED, r"never become ready\) and was started"),
        (RESTARTING, None, None, FAILED, r"did not stop cleanly \(it crashed or was killed\)"),
        (PENDING, None, None, FAILED, r"\(it crashed or was killed\) and was started again"),
        (RESTARTING, "odd", None, FAILED, r"\(its boot ended odd\)"),
        # Refused: failed, whatever the boot did.
        (PENDING, None, "restart.turn_wait: bad value", FAILED, "^the restart did not "
         r"happen: restart.turn_wait: bad value$"),
        (PENDING, "clean", "the configuration does not load", FAILED, "does not load$"),
        (RESTARTING, "clean", "", FAILED, "^the restart did not happen$"),
        (PENDING, None, "x\n\x00y", FAILED, "happen: x y$"),
    ],
)  # fmt: skip
def test_settlement(
    state: RestartState, boot: str | None, refused: str | None, outcome: str, detail: str
) -> None:
    got = settle(state, boot, refused)
    assert isinstance(got, Settlement) and got.outcome == outcome
    assert re.search(detail, got.detail), got.detail


def test_a_settled_request_is_not_settled_again() -> None:
    with pytest.raises(ValueError, match="settled already"):
        settle(RestartState.DONE, "clean")
    with pytest.raises(ValueError):
        settle("bogus", "clean")


# --- words -----------------------------------------------------------------------------


def test_the_notice_tells_the_user_what_happened() -> None:
    ok = notice_text(OK, 3.24, "", "0.9.0", "0.9.1", "ab12ab12ab12", "cd34cd34cd34")
    assert ok == (
        "The restart this session asked for completed in 3.2 s: version 0.9.0 -> 0.9.1, "
        "configuration ab12ab12ab12 -> cd34cd34cd34."
    )
    early = notice_text(OK, 1.0, BEFORE_BEGIN, "0.9.0", "0.9.0", "ab", "ab")
    assert early.endswith(f"Note: {BEFORE_BEGIN}.")
    failed = notice_text(FAILED, None, "the daemon did not stop cleanly", "0.9.0", None, "ab", "")
    assert failed == (
        "The restart this session asked for did not complete cleanly: the daemon did not "
        "stop cleanly. It took an unknown time; version 0.9.0 -> ?, configuration ab -> ?."
    )


def test_the_result_tells_the_model_what_happened() -> None:
    payload = {
        "restart": "r1",
        "outcome": "ok",
        "detail": "",
        "seconds": 2.0,
        "reason": "load the new tools",
        "version_before": "0.9.0",
        "version_after": "0.9.0",
        "config_before": "aaaa",
        "config_after": "bbbb",
    }
    assert result_text(payload) == (
        "[restart result] The restart you asked for (reason: load the new tools) completed "
        "in 2.0 s: version 0.9.0 -> 0.9.0, configuration aaaa -> bbbb."
    )
    failed = result_text(payload | {"outcome": "failed", "detail": "it crashed"})
    assert failed.startswith(
        "[restart result] The restart you asked for (reason: load the new tools) did not "
        "complete cleanly: it crashed. It took 2.0 s;"
    )


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"outcome": "ok"},
        {"outcome": None, "seconds": "soon", "reason": 7, "detail": ["x"]},
        {"outcome": "ok", "seconds": float("nan"), "version_before": None},
        {"seconds": True, "config_after": {"a": 1}},
    ],
)
def test_the_result_text_survives_any_payload(payload: dict[str, object]) -> None:
    text = result_text(payload)
    assert text.startswith("[restart result] The restart you asked for")
    assert "unknown time" in text


@pytest.mark.parametrize(("status", "pending"), [("open", True), ("closed", False)])
def test_a_restart_result_is_input_its_next_turn_reads(status: str, pending: bool) -> None:
    payload = {"restart": "r1", "outcome": "ok", "seconds": 1.5, "reason": "tools"}
    row = SessionRow(0, 1, False, None, None, 0, status=status)
    advance(row, make_request("s", "restart_result", payload, writer="supervisor"))
    assert (row.last_seq, row.pending) == (1, pending)
    event = EventRecord("s", 1, "restart_result", None, payload, 0.0, "supervisor")
    assert message_of(event) == Message("user", result_text(payload))


@pytest.mark.parametrize(
    ("requested_at", "now", "turn_wait", "asking", "left"),
    [
        (100.0, 100.0, 60.0, False, 0.0),  # no turn in flight that asked: begin now
        (100.0, 100.0, 60.0, True, 60.0),  # it asked just now: wait for it
        (100.0, 130.0, 60.0, True, 30.0),
        (100.0, 160.0, 60.0, True, 0.0),  # waited turn_wait: begin, the turn is cut
        (100.0, 500.0, 60.0, True, 0.0),
        (100.0, 90.0, 60.0, True, 60.0),  # the clock stepped back: never longer than turn_wait
        (100.0, 100.0, 0.0, True, 0.0),  # turn_wait 0: never wait
    ],
)
def test_an_agents_request_waits_for_its_turn_at_most_turn_wait(
    requested_at: float, now: float, turn_wait: float, asking: bool, left: float
) -> None:
    assert wait_left(requested_at, now, turn_wait, asking) == left
