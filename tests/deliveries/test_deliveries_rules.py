"""The delivery rules without I/O: what an answer means, the backoff with its jitter, the
end after `max_attempts`, and the signature a receiver checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.deliveries.rules import Policy, Verdict, signature, verdict, verify


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


def test_a_retry_past_max_attempts_is_dead() -> None:
    policy = Policy(max_attempts=3)
    assert policy.after(1, Verdict.RETRY) is Verdict.RETRY
    assert policy.after(2, Verdict.RETRY) is Verdict.RETRY
    assert policy.after(3, Verdict.RETRY) is Verdict.DEAD
    assert policy.after(3, Verdict.DELIVERED) is Verdict.DELIVERED
    assert policy.after(1, Verdict.DEAD) is Verdict.DEAD
    with pytest.raises(ValueError):
        Policy(max_attempts=0)


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
