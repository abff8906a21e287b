"""Auto-continue decisions, driven directly with made-up facts and times."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract.config import RecoveryConfig
from supervisor.core.recovery import (
    ATTEMPT_DELAYS,
    MAX_ATTEMPTS,
    Action,
    Decision,
    Interruption,
    Trigger,
    boot_scan_plan,
    cause_of,
    decide,
    next_attempt_at,
)
from supervisor.core.tail import (
    CONTINUABLE_TAILS,
    ENDED_TAILS,
    TERMINAL_TAILS,
    UNSAFE_TAILS,
    TailClass,
    classify_tail,
)

NOW = 100_000.0
ON = RecoveryConfig()
OFF = RecoveryConfig(auto_continue=False)
ATTENDED = (Trigger.FIRST_TOUCH, Trigger.USER_MESSAGE, Trigger.WORKER_DEATH)
UNATTENDED = (
    Trigger.BOOT_SCAN,
    Trigger.RETRY_TIMER,
    Trigger.AUTONOMOUS_RESUME,
    Trigger.SUBAGENT_RESUME,
)
# A fresh interruption that would be continued: our lease expired mid-turn 10 s ago.
BASE = Interruption(
    active_turn_id="turn-1",
    tail=TailClass.TOOL_RESULT_NOT_CONSUMED,
    interrupted_at=NOW - 10,
    cause="worker_crash",
)


def facts(**changes: Any) -> Interruption:
    """BASE with some facts changed."""
    return dataclasses.replace(BASE, **changes)


def run(
    f: Interruption = BASE,
    trigger: Trigger = Trigger.FIRST_TOUCH,
    *,
    now: float = NOW,
    tripped: bool = False,
    settings: RecoveryConfig = ON,
) -> Decision:
    return decide(f, trigger, now, tripped, settings)


def test_a_fresh_interruption_is_continued_and_charged() -> None:
    decision = run()
    assert decision.action is Action.CONTINUE and decision.charged
    assert (decision.cause, decision.attempt, decision.at) == ("worker_crash", 1, None)
    assert not decision.quarantine and not decision.suppressed


# -- what is not charged ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("f", "settings", "tripped", "trigger", "action", "reason"),
    [
        pytest.param(facts(active_turn_id=None), ON, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "not interrupted", id="not-interrupted"),
        pytest.param(facts(active_turn_id=None, queued_user_message=True), ON, False,
                     Trigger.USER_MESSAGE, Action.SKIP, "not interrupted", id="idle-with-message"),
        pytest.param(facts(lease_live=True), ON, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "still running", id="still-running"),
        pytest.param(facts(lease_live=True, lease_other_host=True), ON, False, Trigger.BOOT_SCAN,
                     Action.SKIP, "another host", id="leased-by-another-host"),
        pytest.param(facts(ended_outcome="completed"), ON, False, Trigger.BOOT_SCAN,
                     Action.SKIP, "already ended", id="already-ended"),
        pytest.param(facts(status="quarantined"), ON, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "quarantined", id="quarantined"),
        pytest.param(facts(status="closed"), ON, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "closed", id="closed"),
        pytest.param(facts(tail=TailClass.OPERATOR_INTERRUPT), ON, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "terminal", id="operator-interrupt"),
        pytest.param(facts(queued_user_message=True), ON, False, Trigger.USER_MESSAGE,
                     Action.DRIVE_WITH_QUEUED_MESSAGE, "queued", id="queued-message"),
        pytest.param(BASE, OFF, False, Trigger.FIRST_TOUCH,
                     Action.SKIP, "auto_continue", id="auto-continue-off"),
        pytest.param(BASE, ON, True, Trigger.BOOT_SCAN,
                     Action.SKIP, "breaker", id="breaker"),
        pytest.param(facts(attempts=1, last_attempt_at=NOW - 1), ON, False, Trigger.RETRY_TIMER,
                     Action.CONTINUE_AT, "due in", id="not-due"),
        pytest.param(facts(interrupted_at=NOW - 7200), ON, False, Trigger.BOOT_SCAN,
                     Action.FINALIZE_STALE, "older than freshness", id="stale"),
        pytest.param(facts(tail=TailClass.LAST_IS_CONTINUATION_NOTE), ON, False,
                     Trigger.FIRST_TOUCH,
                     Action.NOTICE_RESEND, "unsafe", id="unsafe-tail"),
        pytest.param(facts(attempts=3), ON, False, Trigger.FIRST_TOUCH,
                     Action.NOTICE_RESEND, "3 attempts failed", id="attempts-spent"),
    ],
)  # fmt: skip
def test_not_charged(
    f: Interruption,
    settings: RecoveryConfig,
    tripped: bool,
    trigger: Trigger,
    action: Action,
    reason: str,
) -> None:
    decision = run(f, trigger, tripped=tripped, settings=settings)
    assert decision.action is action
    assert reason in decision.reason
    assert not decision.charged
    assert decision.attempt is None and decision.cause is None


def test_another_hosts_expired_lease_is_adopted() -> None:
    assert run(facts(lease_other_host=True)).action is Action.CONTINUE


# -- the breaker ------------------------------------------------------------------------


@pytest.mark.parametrize("trigger", list(Trigger))
def test_breaker_stops_unattended_triggers_only(trigger: Trigger) -> None:
    decision = run(trigger=trigger, tripped=True)
    if trigger in UNATTENDED:
        assert (decision.action, decision.suppressed) == (Action.SKIP, True)
        assert trigger.value in decision.reason
    else:
        assert (decision.action, decision.suppressed) == (Action.CONTINUE, False)


@pytest.mark.parametrize(
    "f",
    [
        facts(queued_user_message=True),
        facts(interrupted_at=NOW - 7200),
        facts(attempts=3),
        facts(tail=TailClass.LAST_IS_CONTINUATION_NOTE),
        facts(attempts=2, last_attempt_at=NOW),
    ],
    ids=["queued", "stale", "spent", "unsafe", "not-due"],
)
@pytest.mark.parametrize("trigger", list(Trigger))
def test_breaker_suppresses_every_unattended_action(f: Interruption, trigger: Trigger) -> None:
    free = run(f, trigger)
    decision = run(f, trigger, tripped=True)
    assert free.action is not Action.SKIP
    if trigger in ATTENDED:
        assert decision == free
    else:
        assert (decision.action, decision.suppressed) == (Action.SKIP, True)


def test_nothing_to_suppress_is_not_logged_as_suppressed() -> None:
    for f in (facts(active_turn_id=None), facts(lease_live=True), facts(status="quarantined")):
        decision = run(f, Trigger.BOOT_SCAN, tripped=True)
        assert decision.action is Action.SKIP and not decision.suppressed


# -- tails ------------------------------------------------------------------------------


def test_tail_sets_partition_the_classes() -> None:
    assert set(TailClass) == CONTINUABLE_TAILS | TERMINAL_TAILS
    assert not CONTINUABLE_TAILS & TERMINAL_TAILS and not UNSAFE_TAILS & ENDED_TAILS
    assert all(t.continuable is (t in CONTINUABLE_TAILS) for t in TailClass)


@pytest.mark.parametrize("tail", [t for t in TailClass if t.continuable])
def test_each_continuable_tail_is_continued(tail: TailClass) -> None:
    decision = run(facts(tail=tail))
    assert decision.action is Action.CONTINUE
    assert tail.value in decision.reason


@pytest.mark.parametrize("trigger", list(Trigger))
@pytest.mark.parametrize("tail", [t for t in TailClass if t in TERMINAL_TAILS])
@pytest.mark.parametrize("attempts", [0, 1, 2])
def test_terminal_tails_are_never_continued(
    tail: TailClass, trigger: Trigger, attempts: int
) -> None:
    decision = run(facts(tail=tail, attempts=attempts, last_attempt_at=NOW - 60), trigger)
    assert decision.action is (Action.SKIP if tail in ENDED_TAILS else Action.NOTICE_RESEND)
    assert not decision.quarantine and not decision.charged


@pytest.mark.parametrize("outcome", ["interrupted_by_operator", "failed", "completed"])
def test_a_committed_turn_ended_is_never_continued(outcome: str) -> None:
    decision = run(facts(ended_outcome=outcome))
    assert decision.action is Action.SKIP and outcome in decision.reason


def test_a_queued_message_drives_an_unsafe_tail() -> None:
    """A note would follow a note: the user's own message drives the turn instead."""
    f = facts(tail=TailClass.LAST_IS_CONTINUATION_NOTE, queued_user_message=True)
    assert run(f, Trigger.USER_MESSAGE).action is Action.DRIVE_WITH_QUEUED_MESSAGE


# -- attempts ---------------------------------------------------------------------------


def test_attempt_schedule_constants() -> None:
    assert (ATTEMPT_DELAYS, MAX_ATTEMPTS) == ((0.0, 5.0, 30.0), 3)


@pytest.mark.parametrize(
    ("attempts", "since", "due"),
    [(0, 50.0, 50.0), (1, 50.0, 55.0), (2, 50.0, 80.0), (3, 50.0, None), (9, 50.0, None)],
)
def test_next_attempt_at(attempts: int, since: float, due: float | None) -> None:
    assert next_attempt_at(attempts, since) == due


def test_negative_attempts_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        next_attempt_at(-1, NOW)
    with pytest.raises(ValueError, match="negative"):
        facts(attempts=-1)


@pytest.mark.parametrize(
    ("attempts", "started_ago", "action", "at"),
    [
        pytest.param(1, 4.0, Action.CONTINUE_AT, NOW + 1, id="second-early"),
        pytest.param(1, 5.0, Action.CONTINUE, None, id="second-exactly-due"),
        pytest.param(1, 6.0, Action.CONTINUE, None, id="second-late"),
        pytest.param(2, 29.0, Action.CONTINUE_AT, NOW + 1, id="third-early"),
        pytest.param(2, 30.0, Action.CONTINUE, None, id="third-exactly-due"),
        pytest.param(3, 3600.0, Action.NOTICE_RESEND, None, id="spent"),
        pytest.param(4, 0.0, Action.NOTICE_RESEND, None, id="over-spent"),
    ],
)
def test_attempt_delays(attempts: int, started_ago: float, action: Action, at: float) -> None:
    f = facts(attempts=attempts, last_attempt_at=NOW - started_ago, interrupted_at=NOW - 1)
    decision = run(f)
    assert (decision.action, decision.at) == (action, at)
    assert decision.quarantine is (action is Action.NOTICE_RESEND)
    if action is Action.CONTINUE:
        assert decision.attempt == attempts + 1


def test_without_a_recorded_start_the_last_event_times_the_delay() -> None:
    f = facts(attempts=1, last_attempt_at=None, interrupted_at=NOW - 2)
    assert run(f).at == NOW + 3


def test_first_attempt_is_at_once_even_with_a_clock_step() -> None:
    assert run(facts(interrupted_at=NOW + 60)).action is Action.CONTINUE


def test_three_failed_attempts_end_in_a_notice_and_quarantine() -> None:
    """A turn that keeps dying: at once, after 5 s, after 30 s, then the user is told."""
    f, now, started = BASE, NOW, []
    while True:
        decision = run(f, Trigger.RETRY_TIMER, now=now)
        if decision.action is Action.CONTINUE_AT:
            assert decision.at is not None
            now = decision.at
            continue
        if decision.action is not Action.CONTINUE:
            break
        started.append(now)  # charged before it starts; it dies 1 s later
        f = facts(attempts=f.attempts + 1, last_attempt_at=now, interrupted_at=now + 1)
        now += 1
    assert [t - started[0] for t in started] == [0.0, 5.0, 35.0]
    assert (decision.action, decision.quarantine) == (Action.NOTICE_RESEND, True)
    assert run(facts(status="quarantined", attempts=3)).action is Action.SKIP


def test_spent_attempts_quarantine_before_a_queued_message_runs() -> None:
    decision = run(facts(attempts=3, queued_user_message=True), Trigger.USER_MESSAGE)
    assert (decision.action, decision.quarantine) == (Action.NOTICE_RESEND, True)


def test_spent_attempts_quarantine_even_with_auto_continue_off() -> None:
    assert run(facts(attempts=3), settings=OFF).quarantine


# -- freshness --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interrupted_at", "action"),
    [
        pytest.param(NOW - 3600, Action.CONTINUE, id="exactly-one-hour"),
        pytest.param(math.nextafter(NOW - 3600, -math.inf), Action.FINALIZE_STALE, id="older"),
        pytest.param(NOW - 3599, Action.CONTINUE, id="younger"),
        pytest.param(NOW - 86400, Action.FINALIZE_STALE, id="a-day"),
    ],
)
def test_freshness_edge(interrupted_at: float, action: Action) -> None:
    assert run(facts(interrupted_at=interrupted_at)).action is action


def test_freshness_comes_from_the_settings() -> None:
    f = facts(interrupted_at=NOW - 120)
    assert run(f, settings=RecoveryConfig(freshness=60)).action is Action.FINALIZE_STALE
    assert run(f, settings=RecoveryConfig(freshness=120)).action is Action.CONTINUE


def test_a_stale_turn_with_a_queued_message_is_driven_by_it() -> None:
    f = facts(interrupted_at=NOW - 86400, queued_user_message=True)
    assert run(f, Trigger.USER_MESSAGE).action is Action.DRIVE_WITH_QUEUED_MESSAGE


def test_auto_continue_off_still_lets_a_queued_message_drive() -> None:
    f = facts(queued_user_message=True)
    assert run(f, settings=OFF).action is Action.DRIVE_WITH_QUEUED_MESSAGE


# -- the boot scan ----------------------------------------------------------------------


def test_boot_scan_is_oldest_first_and_capped() -> None:
    candidates = [(f"s{i:02}", NOW - i) for i in range(15)]
    assert boot_scan_plan(candidates, 10) == [f"s{i:02}" for i in range(14, 4, -1)]


@pytest.mark.parametrize(
    ("candidates", "cap", "plan"),
    [
        ([], 10, []),
        ([("a", 1.0), ("b", 2.0)], 0, []),
        ([("b", 1.0), ("a", 1.0), ("c", 0.5)], 2, ["c", "a"]),
        ([("a", 2.0), ("a", 1.0), ("b", 3.0)], 10, ["a", "b"]),
    ],
    ids=["none", "cap-zero", "ties-by-id", "duplicate"],
)
def test_boot_scan_plan(candidates: list[tuple[str, float]], cap: int, plan: list[str]) -> None:
    assert boot_scan_plan(candidates, cap) == plan


def test_boot_scan_refuses_a_negative_cap() -> None:
    with pytest.raises(ValueError, match="max_per_pass"):
        boot_scan_plan([], -1)


@given(
    times=st.dictionaries(st.text(min_size=1, max_size=4), st.floats(0, 1e6), max_size=30),
    cap=st.integers(0, 12),
)
def test_boot_scan_takes_the_oldest(times: dict[str, float], cap: int) -> None:
    plan = boot_scan_plan(list(times.items()), cap)
    assert len(plan) == min(cap, len(times)) == len(set(plan))
    assert [times[s] for s in plan] == sorted(times[s] for s in plan)
    left = set(times) - set(plan)
    assert all(times[s] <= times[other] for s in plan for other in left)


# -- properties over any facts ----------------------------------------------------------

any_facts = st.builds(
    Interruption,
    active_turn_id=st.one_of(st.none(), st.just("turn-1")),
    tail=st.sampled_from(TailClass),
    interrupted_at=st.floats(NOW - 10_000, NOW + 100),
    status=st.sampled_from(["open", "quarantined", "closed"]),
    lease_live=st.booleans(),
    lease_other_host=st.booleans(),
    ended_outcome=st.sampled_from([None, "completed", "failed", "interrupted_by_operator"]),
    queued_user_message=st.booleans(),
    attempts=st.integers(0, 6),
    last_attempt_at=st.one_of(st.none(), st.floats(NOW - 100, NOW + 10)),
    cause=st.sampled_from(["worker_crash", "daemon_restart", "max_tokens", "lease_expired"]),
)
any_settings = st.builds(
    RecoveryConfig, auto_continue=st.booleans(), freshness=st.sampled_from([60.0, 3600.0])
)


@given(f=any_facts, trigger=st.sampled_from(Trigger), tripped=st.booleans(), s=any_settings)
def test_decisions_keep_the_guards(
    f: Interruption, trigger: Trigger, tripped: bool, s: RecoveryConfig
) -> None:
    decision = decide(f, trigger, NOW, tripped, s)
    assert decision.reason
    assert decision.charged is (decision.action is Action.CONTINUE)
    if decision.action is Action.CONTINUE:
        assert f.status == "open" and f.active_turn_id and f.ended_outcome is None
        assert not f.lease_live and not f.queued_user_message and s.auto_continue
        assert f.tail in CONTINUABLE_TAILS and f.attempts < MAX_ATTEMPTS
        assert NOW - f.interrupted_at <= s.freshness
        assert decision.attempt == f.attempts + 1 and decision.cause == f.cause
        assert not (tripped and trigger.unattended)
    else:
        assert decision.attempt is None and decision.cause is None
    if f.status != "open" or f.tail in TERMINAL_TAILS or f.attempts >= MAX_ATTEMPTS:
        assert decision.action is not Action.CONTINUE
    if tripped and trigger.unattended:
        assert decision.action is Action.SKIP
    if decision.suppressed:
        assert tripped and trigger.unattended and decision.action is Action.SKIP
    assert (decision.at is not None) is (decision.action is Action.CONTINUE_AT)
    if decision.at is not None:
        assert decision.at > NOW and 0 < f.attempts < MAX_ATTEMPTS
    if decision.quarantine:
        assert decision.action is Action.NOTICE_RESEND and f.attempts >= MAX_ATTEMPTS
    if decision.action is Action.DRIVE_WITH_QUEUED_MESSAGE:
        assert f.queued_user_message


@given(f=any_facts, s=any_settings)
def test_without_the_breaker_the_trigger_does_not_matter(
    f: Interruption, s: RecoveryConfig
) -> None:
    decisions = {decide(f, trigger, NOW, False, s) for trigger in Trigger}
    assert len(decisions) == 1


@given(f=any_facts, s=any_settings, trigger=st.sampled_from(ATTENDED))
def test_the_breaker_never_changes_an_attended_decision(
    f: Interruption, s: RecoveryConfig, trigger: Trigger
) -> None:
    assert decide(f, trigger, NOW, True, s) == decide(f, trigger, NOW, False, s)


# --- the tail classifier ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ev:
    type: str
    turn_id: str | None = "t1"
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)


def _asks(*ids: str) -> Ev:
    return Ev("model_response", payload={"tool_calls": [{"id": i, "name": "echo"} for i in ids]})


def _answer(finish: str = "stop") -> Ev:
    return Ev("model_response", payload={"text": "echo: x", "finish_reason": finish})


def _result(call_id: str) -> Ev:
    return Ev("tool_result", payload={"call_id": call_id})


USER = Ev("user_message", None, {"text": "x"})
START = Ev("turn_started")
NOTE = Ev("continuation", payload={"cause": "worker_crash"})


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ([USER, START], TailClass.UNANSWERED_USER_MESSAGE),
        ([USER, START, USER], TailClass.UNANSWERED_USER_MESSAGE),
        ([USER, START, _asks("c1")], TailClass.TOOL_CALL_WITHOUT_RESULT),
        ([USER, START, _asks("c1"), Ev("tool_call")], TailClass.TOOL_CALL_WITHOUT_RESULT),
        ([USER, START, _asks("c1", "c2"), _result("c1")], TailClass.TOOL_CALL_WITHOUT_RESULT),
        ([USER, START, _asks("c1"), _result("c1")], TailClass.TOOL_RESULT_NOT_CONSUMED),
        ([USER, START, _answer("length")], TailClass.CUT_BY_MAX_TOKENS),
        ([USER, START, _answer()], TailClass.ANSWERED),
        ([USER, START, _answer(), USER], TailClass.ANSWERED),
        ([USER, START, NOTE], TailClass.LAST_IS_CONTINUATION_NOTE),
        ([USER, START, NOTE, USER], TailClass.LAST_IS_CONTINUATION_NOTE),
        ([USER, START, _asks("c1"), _result("c1"), NOTE], TailClass.LAST_IS_CONTINUATION_NOTE),
        ([USER, START, NOTE, _asks("c1"), _result("c1")], TailClass.TOOL_RESULT_NOT_CONSUMED),
        (
            [USER, START, Ev("turn_ended", payload={"outcome": "interrupted_by_operator"})],
            TailClass.OPERATOR_INTERRUPT,
        ),
        ([USER, START, Ev("turn_ended", payload={"outcome": "failed"})], TailClass.ENDED_IN_ERROR),
        # An earlier turn's events do not count: only this turn's, from its turn_started.
        (
            [Ev("turn_started", "t0"), _answer("length"), USER, START],
            TailClass.UNANSWERED_USER_MESSAGE,
        ),
        ([_asks("c9"), USER, START], TailClass.UNANSWERED_USER_MESSAGE),
    ],
)
def test_classify_tail(tail: list[Ev], expected: TailClass) -> None:
    assert classify_tail(tail, "t1") is expected


@pytest.mark.parametrize(
    ("tail", "trigger", "lease_expired", "cause"),
    [
        (TailClass.CUT_BY_MAX_TOKENS, Trigger.WORKER_DEATH, False, "max_tokens"),
        (TailClass.CUT_BY_MAX_TOKENS, Trigger.BOOT_SCAN, False, "max_tokens"),
        (TailClass.TOOL_RESULT_NOT_CONSUMED, Trigger.WORKER_DEATH, False, "worker_crash"),
        (TailClass.TOOL_RESULT_NOT_CONSUMED, Trigger.WORKER_DEATH, True, "lease_expired"),
        (TailClass.UNANSWERED_USER_MESSAGE, Trigger.BOOT_SCAN, False, "daemon_restart"),
        (TailClass.UNANSWERED_USER_MESSAGE, Trigger.FIRST_TOUCH, True, "daemon_restart"),
    ],
)
def test_the_note_names_the_real_cause(
    tail: TailClass, trigger: Trigger, lease_expired: bool, cause: str
) -> None:
    assert cause_of(tail, trigger, lease_expired) == cause


def test_a_shorter_attempt_schedule_from_the_settings() -> None:
    quick = RecoveryConfig(attempt_delays=(0.0, 1.0))
    assert run(facts(attempts=1, last_attempt_at=NOW - 0.5), settings=quick).action is (
        Action.CONTINUE_AT
    )
    assert run(facts(attempts=1, last_attempt_at=NOW - 1.0), settings=quick).action is (
        Action.CONTINUE
    )
    spent = run(facts(attempts=2), settings=quick)
    assert (spent.action, spent.quarantine) == (Action.NOTICE_RESEND, True)
