"""The delivery rules without I/O: what an answer means, the backoff with its jitter, the
end at `max_age` (the last wait ending at it) or after a positive `max_attempts`, and the
signature a receiver checks. Time is a fake clock's, moved by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.deliveries.rules import Policy, Verdict, signature, verdict, verify
from tests.clock import FakeClock

DAY = 86400.0


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Verdict.DELIVERED),
        (204, Verdict.DELIVERED),
        (299, Verdict.DELIVERED),
        (400, Verdict.DEAD),
        (401, Verdict.DEAD),
        (404, Verdict.DEAD),
        (410, Verdict.DEAD),
        (499, Verdict.DEAD),
        (408, Verdict.RETRY),
        (429, Verdict.RETRY),
        (500, Verdict.RETRY),
        (503, Verdict.RETRY),
        (301, Verdict.RETRY),
        (100, Verdict.RETRY),
        (None, Verdict.RETRY),
    ],
)
def test_what_an_answer_means(status: int | None, expected: Verdict) -> None:
    assert verdict(status) is expected


def test_the_backoff_doubles_from_the_base_to_the_cap() -> None:
    policy = Policy(max_attempts=5, base=5.0, cap=600.0)
    assert [policy.delay(n, 1.0) for n in range(1, 10)] == [
        5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 600.0
    ]  # fmt: skip
    assert [policy.delay(n, 0.0) for n in (1, 2, 8)] == [2.5, 5.0, 300.0]
    assert policy.delay(10_000, 0.5) == 450.0  # no overflow however long the outage


@given(st.integers(min_value=1, max_value=2000), st.floats(min_value=0.0, max_value=1.0))
def test_a_wait_is_within_half_and_all_of_its_delay(failed: int, jitter: float) -> None:
    policy = Policy()
    full = min(policy.cap, policy.base * 2.0 ** min(failed - 1, 60))
    assert full / 2 <= policy.delay(failed, jitter) <= full


@pytest.mark.parametrize(("failed", "jitter"), [(0, 0.5), (1, -0.1), (1, 1.5)])
def test_a_bad_input_to_the_backoff_is_refused(failed: int, jitter: float) -> None:
    with pytest.raises(ValueError):
        Policy().delay(failed, jitter)


def failing_until_dead(policy: Policy, clock: FakeClock, jitter: float) -> tuple[int, str]:
    """A delivery whose every attempt fails (taking no time), tried from `clock`'s now on
    as the courier tries it: its attempts when it is given up, and why."""
    created = clock.time()
    attempts = 0
    while True:
        attempts += 1
        age = clock.time() - created
        answer, why = policy.after(attempts, Verdict.RETRY, age)
        if answer is Verdict.DEAD:
            return attempts, why
        wait = policy.next_in(attempts, jitter, age)
        assert 0 < wait <= policy.cap
        clock.sleep_blocking(wait)


def test_with_the_defaults_a_delivery_is_tried_for_a_day_not_a_count() -> None:
    policy, clock = Policy(), FakeClock()
    assert (policy.max_age, policy.max_attempts, policy.base, policy.cap) == (DAY, 0, 5.0, 600.0)
    created = clock.time()
    attempts, why = failing_until_dead(policy, clock, jitter=1.0)
    assert clock.time() - created == pytest.approx(DAY, abs=1e-3)  # not a second sooner
    # 5, 10, ... 320 s, then every 600 s: some 150 attempts, not 5.
    assert 145 <= attempts <= 155
    assert why == "not delivered within delivery.max_age (86400 s)"


def test_a_delivery_is_dead_at_its_deadline_whatever_its_attempts() -> None:
    policy, clock = Policy(max_age=DAY), FakeClock()
    created = clock.time()
    clock.sleep_blocking(DAY - 0.5)
    assert policy.after(1, Verdict.RETRY, clock.time() - created) == (Verdict.RETRY, "")
    assert policy.after(10**6, Verdict.RETRY, clock.time() - created) == (Verdict.RETRY, "")
    clock.sleep_blocking(0.5)
    late = clock.time() - created
    assert policy.after(1, Verdict.RETRY, late) == (
        Verdict.DEAD,
        "not delivered within delivery.max_age (86400 s)",
    )
    # An answer that decides by itself is not changed by the age.
    assert policy.after(1, Verdict.DELIVERED, late) == (Verdict.DELIVERED, "")
    assert policy.after(1, Verdict.DEAD, 0.0) == (Verdict.DEAD, "")
    for max_age, said in [(30 * DAY, "2592000"), (0.25, "0.25"), (90.0, "90")]:
        _, why = Policy(max_age=max_age).after(1, Verdict.RETRY, max_age)
        assert why == f"not delivered within delivery.max_age ({said} s)"


def test_the_last_wait_ends_at_the_deadline() -> None:
    policy = Policy(base=5.0, cap=600.0, max_age=1000.0)
    assert policy.next_in(1, 1.0, 0.0) == 5.0
    assert policy.next_in(8, 1.0, 100.0) == 600.0
    assert policy.next_in(8, 1.0, 900.0) == 100.0  # not 600: the target may be back by then
    assert policy.next_in(8, 0.0, 999.5) == 0.5
    with pytest.raises(ValueError):
        policy.next_in(1, 1.0, 1000.0)  # given up already: no next attempt


def test_a_positive_max_attempts_ends_it_sooner() -> None:
    policy = Policy(max_attempts=3)
    assert policy.after(1, Verdict.RETRY, 0.0) == (Verdict.RETRY, "")
    assert policy.after(2, Verdict.RETRY, 0.0) == (Verdict.RETRY, "")
    assert policy.after(3, Verdict.RETRY, 0.0) == (
        Verdict.DEAD,
        "failed delivery.max_attempts (3) times",
    )
    assert policy.after(3, Verdict.DELIVERED, 0.0) == (Verdict.DELIVERED, "")
    assert policy.after(1, Verdict.DEAD, 0.0) == (Verdict.DEAD, "")
    assert failing_until_dead(Policy(max_attempts=5, max_age=DAY), FakeClock(), 1.0) == (
        5,
        "failed delivery.max_attempts (5) times",
    )


@given(
    max_age=st.floats(min_value=0.001, max_value=10 * DAY),
    waits=st.floats(min_value=0.001, max_value=500.0),  # max_age / cap: at most 500 waits
    spread=st.floats(min_value=1.0, max_value=1e6),  # cap / base
    jitter=st.floats(min_value=0.0, max_value=1.0),
)
def test_every_attempt_failing_a_delivery_is_dead_at_created_at_plus_max_age(
    max_age: float, waits: float, spread: float, jitter: float
) -> None:
    cap = max_age / waits
    policy, clock = Policy(base=cap / spread, cap=cap, max_age=max_age), FakeClock()
    created = clock.time()
    _, why = failing_until_dead(policy, clock, jitter)
    assert clock.time() - created == pytest.approx(max_age, abs=1e-3)
    assert "delivery.max_age" in why


@pytest.mark.parametrize(
    "settings",
    [{"max_attempts": -1}, {"max_age": 0.0}, {"max_age": -1.0}, {"base": 0.0}, {"cap": 1.0}],
)
def test_a_bad_policy_is_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Policy(**settings)  # type: ignore[arg-type]


def test_the_signature_is_the_hmac_of_timestamp_and_body() -> None:
    # The known answer, computed with another tool:
    # printf '1700000000.{}' | openssl dgst -sha256 -hmac key
    assert signature(b"key", 1_700_000_000, b"{}") == (
        "sha256=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
    )


def test_a_receiver_refuses_a_changed_body_another_key_or_an_old_timestamp() -> None:
    body, at = b'{"seq": 4, "text": "hello"}', 1_700_000_000
    good = signature(b"secret", at, body)
    assert verify(b"secret", at, body, good, now=at + 10, skew=300)
    assert not verify(b"secret", at, body + b" ", good, now=at, skew=300)
    assert not verify(b"other", at, body, good, now=at, skew=300)
    assert not verify(b"secret", at + 1, body, good, now=at, skew=300)
    assert not verify(b"secret", at, body, good, now=at + 301, skew=300)
