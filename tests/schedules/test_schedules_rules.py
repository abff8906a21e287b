"""The rules of firing (`supervisor.schedules.rules`) over plain data and an injected clock,
and cron's times (`supervisor.contract.cron`): what is due, on time or missed, what a
misfire policy makes of the missed ones, and that no time is ever decided twice."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.contract.cron import Cron, CronError, check
from supervisor.core import engine
from supervisor.core.engine import Judge, Memory, SessionView, WorkerView
from supervisor.core.recovery import Trigger
from supervisor.core.vocabulary import Cause, FireOutcome, Misfire
from supervisor.schedules import rules
from supervisor.schedules.rules import LATE, Facts, Fire

FIRED, CAUGHT_UP, SKIPPED = FireOutcome.FIRED, FireOutcome.CAUGHT_UP, FireOutcome.SKIPPED
T0 = 1_800_000_000.0  # a whole multiple of 2, 10 and 60


class Every:
    """Times every `period` seconds from T0 (and before it): the simplest `rules.Times`."""

    def __init__(self, period: float) -> None:
        self.period = period

    def after(self, moment: float) -> float | None:
        return T0 + ((moment - T0) // self.period + 1) * self.period

    def back(self, upto: float, since: float, limit: int) -> tuple[list[float], bool]:
        found: list[float] = []
        t = T0 + (upto - T0) // self.period * self.period
        while t > since:
            if len(found) == limit:
                return found, True
            found.append(t)
            t -= self.period
        return found, False


def decide(times: rules.Times, facts: Facts) -> list[Fire]:
    return rules.decide(*rules.due(times, facts), facts)


def shape(fires: list[Fire]) -> list[tuple[float, FireOutcome, int]]:
    return [(f.scheduled_for - T0, f.outcome, f.passed_over) for f in fires]


# --- on time, missed, misfire -------------------------------------------------------------


def test_times_due_while_the_scheduler_runs_fire_on_time_each() -> None:
    facts = Facts(since=T0, started=T0 - 100, now=T0 + 4.01)
    assert shape(decide(Every(2), facts)) == [(2, FIRED, 0), (4, FIRED, 0)]
    assert decide(Every(2), Facts(since=T0 + 4, started=T0 - 100, now=T0 + 5.9)) == []


def test_after_a_stop_run_once_catches_up_the_newest_missed_time_once() -> None:
    # Down from T0 (the last fire) to T0 + 10.5 (this boot): 2, 4, ..., 10 were missed.
    facts = Facts(since=T0, started=T0 + 10.5, now=T0 + 10.6, misfire=Misfire.RUN_ONCE)
    (fire,) = decide(Every(2), facts)
    assert shape([fire]) == [(10, CAUGHT_UP, 4)]
    assert fire.injected
    assert "missed 5 times (while no daemon ran)" in fire.reason
    assert "run_once: it runs now, 4 older skipped" in fire.reason


def test_after_a_stop_skip_runs_none_and_records_the_newest_as_skipped() -> None:
    facts = Facts(since=T0, started=T0 + 10.5, now=T0 + 12.2, misfire=Misfire.SKIP)
    fires = decide(Every(2), facts)
    assert shape(fires) == [(10, SKIPPED, 4), (12, FIRED, 0)]  # then on time again
    assert not fires[0].injected and "misfire skip: none runs" in fires[0].reason


def test_run_once_past_misfire_grace_runs_none() -> None:
    day, hour = 86400.0, 3600.0
    # A daily run missed at T0 + 2 days; the daemon is back 6 hours later.
    late = Facts(since=T0, started=T0 + 2 * day + 6 * hour, now=T0 + 2 * day + 6 * hour)
    (fire,) = decide(Every(day), late)
    assert shape([fire]) == [(2 * day, SKIPPED, 1)]
    assert "past schedules.misfire_grace (3600 s): none runs" in fire.reason
    # Exactly misfire_grace old is still within it; a moment more is not.
    exact = Facts(since=T0, started=T0 + day + hour, now=T0 + day + hour, grace=hour)
    assert shape(decide(Every(day), exact)) == [(day, CAUGHT_UP, 0)]
    past = Facts(since=T0, started=T0 + day + hour, now=T0 + day + hour + 0.5, grace=hour)
    assert shape(decide(Every(day), past)) == [(day, SKIPPED, 0)]


def test_a_scheduler_held_up_past_late_coalesces_like_a_stop() -> None:
    facts = Facts(since=T0, started=T0 - 1000, now=T0 + LATE + 10.5)
    fires = decide(Every(2), facts)
    assert fires[0].outcome is CAUGHT_UP and fires[0].scheduled_for < facts.now - LATE
    assert "held up" in fires[0].reason
    assert all(f.outcome is FIRED and f.scheduled_for >= facts.now - LATE for f in fires[1:])
    assert len(fires) + sum(f.passed_over for f in fires) == int((LATE + 10.5) // 2)


def test_a_time_another_daemon_was_up_for_is_on_time_for_one_that_booted_after_it() -> None:
    # This daemon boots at T0 + 0.5; T0 is due. Was another one up at T0?
    def outcome(*up: tuple[float, float]) -> FireOutcome:
        facts = Facts(since=T0 - 1, started=T0 + 0.5, now=T0 + 0.6, misfire=Misfire.SKIP, up=up)
        (fire,) = decide(Every(2), facts)
        return fire.outcome

    assert outcome() is SKIPPED  # none: missed
    assert outcome((T0 - 100, T0 + 0.2)) is FIRED  # renewed after it
    assert outcome(rules.up_span(T0 - 100, T0 - 0.5, live=True)) is FIRED  # renewing still
    assert outcome(rules.up_span(T0 - 100, T0 - 0.5, live=False)) is SKIPPED  # lost before it
    assert outcome(rules.up_span(T0 - 100, T0 - rules.RENEWED - 0.1, live=True)) is SKIPPED
    assert outcome(rules.up_span(T0 + 0.1, T0 + 0.4, live=True)) is SKIPPED  # came after it
    assert rules.up_span(5.0, 7.0, live=True) == (5.0, 7.0 + rules.RENEWED)


def test_a_time_before_a_missed_one_is_missed_too() -> None:
    # Another daemon was up until T0 + 3 and fired nothing; this one boots at T0 + 10.5.
    facts = Facts(since=T0, started=T0 + 10.5, now=T0 + 10.6, up=((T0 - 100, T0 + 3),))
    (fire,) = decide(Every(2), facts)
    assert shape([fire]) == [(10, CAUGHT_UP, 4)]  # T0 + 2 coalesces with the rest
    assert "(while no daemon ran)" in fire.reason


def test_a_new_schedule_fires_nothing_before_it_was_armed() -> None:
    facts = Facts(since=T0 + 3, started=T0 - 50, now=T0 + 3.5)
    assert decide(Every(2), facts) == []
    assert rules.next_due(Every(2), facts.since, facts.now) == T0 + 4


def test_more_missed_than_counted_says_at_least() -> None:
    facts = Facts(since=0.0, started=T0 + 0.5, now=T0 + 0.5)
    (fire,) = decide(Every(1), facts)
    assert fire.passed_over == rules.MAX_MISSED - 1
    assert f"at least {rules.MAX_MISSED} times" in fire.reason


def test_an_unknown_misfire_value_misses_by_skipping() -> None:
    assert rules.misfire("run_once") is Misfire.RUN_ONCE
    assert rules.misfire("whatever a newer daemon wrote") is Misfire.SKIP


@settings(max_examples=400, deadline=None)
@given(
    period=st.sampled_from([1.0, 2.0, 3.0, 60.0, 3600.0]),
    since=st.floats(T0, T0 + 5000),
    started=st.floats(T0, T0 + 10_000),
    steps=st.lists(st.floats(0.01, 400), min_size=1, max_size=8),
    misfire=st.sampled_from(list(Misfire)),
    grace=st.sampled_from([0.0, 5.0, 60.0, 3600.0]),
    up=st.lists(
        st.tuples(st.floats(T0 - 100, T0 + 10_000), st.floats(0, 3000)).map(
            lambda span: (span[0], span[0] + span[1])
        ),
        max_size=3,
    ),
)
def test_each_time_is_decided_once_in_order_whatever_the_passes(
    period: float,
    since: float,
    started: float,
    steps: list[float],
    misfire: Misfire,
    grace: float,
    up: list[tuple[float, float]],
) -> None:
    """Passes at any moments: every due time is accounted for once (a row, or passed over
    by the row of a newer missed time), rows go forward, at most one decision of a pass
    is not on time (the first, for the newest missed time), and a pass again at the same
    moment decides nothing."""
    times, now, decided = Every(period), since, since
    rows: list[Fire] = []
    for step in steps:
        now += step
        facts = Facts(decided, started, now, misfire, grace, tuple(up))
        due, more = rules.due(times, facts)
        fires = rules.decide(due, more, facts)
        assert not more and len(fires) + sum(f.passed_over for f in fires) == len(due)
        assert [f.scheduled_for for f in fires] == sorted({f.scheduled_for for f in fires})
        assert all(decided < f.scheduled_for <= now for f in fires)
        late = [f for f in fires if f.outcome is not FIRED]
        assert late == fires[: len(late)] and len(late) <= 1
        missed = [t for t in due if t < now - LATE or not rules.was_up(t, facts)]
        for f in late:
            assert f.scheduled_for == max(missed)
            if f.outcome is CAUGHT_UP:
                assert misfire is Misfire.RUN_ONCE and now - f.scheduled_for <= grace
        on_time = [f.scheduled_for for f in fires if f.outcome is FIRED]
        assert all(t >= now - LATE and rules.was_up(t, facts) for t in on_time)
        assert all(t > max(missed, default=since) for t in on_time)
        rows += fires
        decided = rows[-1].scheduled_for if rows else decided
        again = Facts(decided, started, now, misfire, grace, tuple(up))
        assert rules.decide(*rules.due(times, again), again) == []
    every, _ = times.back(now, since, 1_000_000)
    assert sum(1 + f.passed_over for f in rows) == len(every)


# --- messages, keys and interrupted scheduled turns ----------------------------------


def test_a_fire_message_carries_its_schedule_and_time_and_its_key_is_theirs() -> None:
    payload = rules.message("s1", "hello", "alice", T0 + 2, CAUGHT_UP)
    assert payload == {
        "text": "hello",
        "by": "alice",
        "schedule": "s1",
        "scheduled_for": int(T0 + 2),
        "outcome": "caught_up",
    }
    key = rules.idempotency_key("s1", T0 + 2)
    assert key == rules.idempotency_key("s1", T0 + 2.0) and len(key) <= 200
    assert key != rules.idempotency_key("s1", T0 + 4)
    assert key != rules.idempotency_key("s2", T0 + 2)


HOST, BOOT = "h1/", "h1/aaaaaaaa"


@pytest.mark.parametrize(
    ("owner", "expires", "updated", "cause"),
    [
        ("h1/aaaaaaaa/w1.1", 1100.0, 900.0, None),  # ours, renewing
        ("h1/aaaaaaaa/w1.1", 990.0, 900.0, Cause.LEASE_EXPIRED),  # ours, stopped renewing
        ("h1/bbbbbbbb/w1.1", 1100.0, 900.0, Cause.DAEMON_RESTART),  # an earlier boot's
        ("h2/cccccccc/w1.1", 1100.0, 900.0, None),  # another host's, live
        ("h2/cccccccc/w1.1", 999.0, 900.0, Cause.HOST_LOST),  # another host's, ran out
        (None, None, 995.0, None),  # released a moment ago: its handoff may come
        (None, None, 900.0, Cause.INTERRUPTED),  # released long ago: nobody runs it
    ],
)
def test_an_interrupted_scheduled_turn_is_one_nobody_runs(
    owner: str | None, expires: float | None, updated: float, cause: Cause | None
) -> None:
    found = rules.interruption(owner, expires, updated, 1000.0, host_prefix=HOST, boot_prefix=BOOT)
    assert found is cause
    if cause is not None:
        assert cause.text in rules.interrupted_notice(cause)


# --- cron ---------------------------------------------------------------------------------


def test_six_fields_have_seconds_first() -> None:
    cron = check("*/2 * * * * *")
    assert cron.after(T0) == T0 + 2 and cron.after(T0 + 0.5) == T0 + 2
    assert cron.back(T0 + 5, T0, 10) == ([T0 + 4, T0 + 2], False)
    assert cron.back(T0 + 4, T0, 1) == ([T0 + 4], True)
    assert check("0 * * * *").after(T0 + 1) == T0 + 3600
    assert check("* * * * *").after(T0) == T0 + 60


def test_the_shortest_gap_of_the_next_times() -> None:
    assert check("*/2 * * * * *").upcoming(T0, 3) == [T0 + 2, T0 + 4, T0 + 6]
    assert rules.shortest_gap(check("* * * * * *").upcoming(T0, rules.GAP_SAMPLE)) == 1
    assert rules.shortest_gap(check("0,40 * * * * *").upcoming(T0, rules.GAP_SAMPLE)) == 20
    assert rules.shortest_gap(check("*/5 * * * *").upcoming(T0, rules.GAP_SAMPLE)) == 300
    # Seconds 59 and 0 of two minutes in a row: 1 s apart across the minute.
    assert rules.shortest_gap(check("0,30,59 * * * * *").upcoming(T0, 10)) == 1
    assert rules.shortest_gap(check("0 0 1 1 *").upcoming(T0, 1)) is None


def test_times_are_wall_times_of_the_time_zone() -> None:
    paris = ZoneInfo("Europe/Paris")
    cron = Cron("30 9 * * *", "Europe/Paris")
    winter = datetime(2026, 1, 10, 12, tzinfo=paris).timestamp()
    summer = datetime(2026, 7, 10, 12, tzinfo=paris).timestamp()
    for moment in (winter, summer):
        fired = datetime.fromtimestamp(cron.after(moment) or 0, paris)
        assert (fired.hour, fired.minute, fired.day) == (9, 30, 11)
    assert Cron("30 9 * * *").after(winter) != cron.after(winter)  # UTC is another time


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("61 * * * *", "Bad minute"),
        ("* * * *", "Wrong number of fields"),
        ("* * * * * * *", "Wrong number of fields"),
        ("every day", "Wrong number of fields"),
        ("0 0 30 2 *", "Bad day-of-month"),
        ("*/0 * * * *", "Bad minute"),
        ("", "1 to 200 printable characters"),
        ("* * * * *\x00", "printable"),
        ("1" * 201, "1 to 200"),
    ],
)
def test_a_bad_expression_says_what_is_wrong(expr: str, says: str) -> None:
    with pytest.raises(CronError) as caught:
        check(expr)
    assert caught.value.field == "cron" and says in str(caught.value)


@pytest.mark.parametrize(
    "name", ["Mars/Olympus", "utc", "../etc/passwd", "/etc/localtime", "", "Europe"]
)
def test_an_unknown_time_zone_is_named(name: str) -> None:
    with pytest.raises(CronError) as caught:
        check("* * * * *", name)
    assert caught.value.field == "timezone" and "unknown time zone" in str(caught.value)


EXPRESSIONS = ["*/2 * * * * *", "*/7 * * * *", "0 */3 * * *", "15,45 9-17 * * 1-5", "0 0 1 * *"]


@settings(max_examples=200, deadline=None)
@given(
    expr=st.sampled_from(EXPRESSIONS),
    zone=st.sampled_from(["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata"]),
    since=st.floats(T0, T0 + 86400 * 400),
    span=st.floats(0, 86400 * 3),
)
def test_back_is_forward_reversed(expr: str, zone: str, since: float, span: float) -> None:
    cron = Cron(expr, zone)
    forward: list[float] = []
    moment = since
    while (moment := cron.after(moment) or float("inf")) <= since + span and len(forward) < 300:
        forward.append(moment)
    if len(forward) == 300:
        return  # too many to compare in a property test
    back, more = cron.back(since + span, since, 300)
    assert back == forward[::-1] and not more


# --- the engine leaves interrupted scheduled turns to the scheduler ------------------


def test_the_engine_never_continues_a_scheduled_turn() -> None:
    facts = engine.Facts(owner_prefix="h/boot0001", host_prefix="h/", heartbeat_interval=1.0)
    workers = {"w0.1": WorkerView("w0.1", last_heartbeat=100.0)}

    def judged(kind: str, memory: Memory, **row: Any) -> list[Trigger]:
        session = SessionView("s1", active_turn_id="t1", kind=kind, **row)
        commands = engine.plan(
            [session], workers, {}, {}, {"s1": memory}, facts, now=T0, wall=T0, monotonic=100.0
        )
        scanned = engine.scan_targets([session], {}, facts, Trigger.BOOT_SCAN)
        return [c.trigger for c in commands if isinstance(c, Judge)] + [t for _, t in scanned]

    dead = {"owner": "h/boot0001/w9.1", "lease_expires_at": T0 - 1}
    earlier = {"owner": "h/oldboot1/w0.1", "lease_expires_at": T0 - 1}
    for row, memory in [
        (dead, Memory(died=True)),
        (earlier, Memory(touched=True)),
        (earlier, Memory()),
        ({"owner": "other/boot/w0.1", "lease_expires_at": T0 - 1}, Memory()),
    ]:
        assert judged("attached", memory, **row), row  # the same turn of a chat goes on
        assert judged("scheduled", memory, **row) == [], row
    # A message sent to it meanwhile still drives its next turn, as for any session.
    queued = judged("scheduled", Memory(), pending=True, last_seq=3, **earlier)
    assert queued == [Trigger.USER_MESSAGE]
