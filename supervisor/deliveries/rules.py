"""Outbound deliveries: the rules, as pure code (issue 18's groundwork).

A delivery carries one committed event of a session to an operator-configured target (a
URL of `[[delivery.targets]]`, never one from a request), as a signed POST. What an
attempt's answer means, when the next attempt is due, and the signature, are decided
here; the daemon only carries them out.

  answer of an attempt                      verdict      then
  ----------------------------------------  -----------  ----------------------------------
  2xx                                       DELIVERED    done
  408, 429                                  RETRY        again after the backoff, or DEAD
  other 4xx                                 DEAD         at once: sending it again will not
                                                         help (the operator may retry it)
  5xx, 1xx, 3xx, no answer (network, time)  RETRY        again after the backoff, or DEAD
                                                         once it is `max_age` old, or (if
                                                         set) `max_attempts` were made

A delivery's give-up point is a time: one whose event was committed at `created_at` and
that is not delivered by `created_at + max_age` is dead, however many attempts that took;
`max_attempts` (0: no limit) may end it sooner. Its age is measured when an attempt ends,
so a delivery is always tried at least once, however late its first attempt. An
operator's retry counts the attempts anew, not the age: a dead delivery retried past its
`max_age` has one attempt.

The backoff after the n-th failed attempt is the shared one (`supervisor.core.backoff`)
doubling from `base`: `min(cap, base * 2 ** (n - 1))`, with full jitter on its upper half
(so that deliveries held back by one outage do not all come back at the same instant): a
wait in [d / 2, d]. The jitter is a number in [0, 1] the caller passes in. A wait that
would end past the delivery's `max_age` ends there instead: its last attempt is made at
its deadline, so a target that comes back just before it still gets it.

The signature is `sha256=` and the HMAC-SHA256, hex, of `<timestamp>.<body>` with the
target's secret: the receiver recomputes it from the timestamp header and the raw body,
and refuses a timestamp too far from its clock (a replay).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.core.backoff import Backoff
from supervisor.core.vocabulary import DeliveryKind, EventType

SIGNATURE_HEADER = "X-Turnkeeper-Signature"
TIMESTAMP_HEADER = "X-Turnkeeper-Timestamp"
DEFAULT_KINDS = (DeliveryKind.ANSWER, DeliveryKind.NOTICE)
_KINDS = frozenset(DeliveryKind)


def kind_of(event_type: str, payload: Mapping[str, Any]) -> DeliveryKind | None:
    """What a target could be sent of this event, if anything: `answer` for a turn's
    answer to the user (a `model_response` asking for no tool: its final answer, what
    recovery calls an answered tail, or a part of it cut by the token limit, which its
    continuation goes on from in the next `answer`), the event type for the other kinds,
    else None."""
    if event_type == EventType.MODEL_RESPONSE:
        return None if payload.get("tool_calls") else DeliveryKind.ANSWER
    # Every append asks: a set lookup, not an exception for the types that are not kinds.
    return DeliveryKind(event_type) if event_type in _KINDS else None


def text_of(kind: str, payload: Mapping[str, Any]) -> str:
    """The text a delivery carries: a `turn_ended`'s outcome (completed, failed,
    truncated...); else the event's `text`, else its `summary`, else empty."""
    keys = ("outcome",) if kind == DeliveryKind.TURN_ENDED else ("text", "summary")
    for key in keys:
        value = payload.get(key)
        if isinstance(value, str):
            return value
    return ""


def body(
    delivery_id: str, session: str, seq: int, kind: str, text: str, created_at: float
) -> bytes:
    """The JSON a target is sent (compact, keys in a fixed order: what is signed)."""
    document = {
        "delivery_id": delivery_id,
        "session": session,
        "seq": seq,
        "type": kind,
        "text": text,
        "created_at": created_at,
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


class Verdict(enum.Enum):
    """What one attempt's answer means for its delivery."""

    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD = "dead"


RETRYABLE_4XX = frozenset({408, 429})


def verdict(status: int | None) -> Verdict:
    """The verdict on an attempt answered with HTTP `status` (None: no answer at all)."""
    if status is not None and 200 <= status < 300:
        return Verdict.DELIVERED
    if status is not None and 400 <= status < 500 and status not in RETRYABLE_4XX:
        return Verdict.DEAD
    return Verdict.RETRY


@dataclass(frozen=True)
class Policy:
    """`delivery.max_attempts` (0: no limit), `delivery.backoff` (base) and
    `delivery.backoff_cap` (cap), and `delivery.max_age`, in seconds."""

    max_attempts: int = 0
    base: float = 5.0
    cap: float = 600.0
    max_age: float = 86400.0

    def __post_init__(self) -> None:
        if not (self.max_attempts >= 0 and 0 < self.base <= self.cap and self.max_age > 0):
            raise ValueError(f"need max_attempts >= 0, 0 < base <= cap and max_age > 0: {self}")

    def delay(self, failed: int, jitter: float) -> float:
        """Seconds to wait after the `failed`-th failed attempt (at least 1), with `jitter`
        in [0, 1]: a wait in [d / 2, d] for the doubling, capped, delay d."""
        if failed < 1 or not 0.0 <= jitter <= 1.0:
            raise ValueError(f"need failed >= 1 and 0 <= jitter <= 1: {failed}, {jitter}")
        return Backoff(initial=self.base, factor=2.0, cap=self.cap).jittered(failed, jitter)

    def next_in(self, failed: int, jitter: float, age: float) -> float:
        """Seconds to wait after the `failed`-th failed attempt of a delivery `age` seconds
        old (one not given up: `age` below `max_age`): the backoff, ending no later than
        the delivery's deadline."""
        if age >= self.max_age:
            raise ValueError(f"need age < max_age: {age} >= {self.max_age}")
        return min(self.delay(failed, jitter), self.max_age - age)

    def after(self, attempts: int, answer: Verdict, age: float) -> tuple[Verdict, str]:
        """The delivery's verdict after `attempts` attempts, the last answered `answer` when
        the delivery was `age` seconds old (since its event's commit); with, for a RETRY
        that is DEAD, why it was given up (else "")."""
        if answer is not Verdict.RETRY:
            return answer, ""
        if age >= self.max_age:
            return (
                Verdict.DEAD,
                f"not delivered within delivery.max_age ({_seconds(self.max_age)} s)",
            )
        if self.max_attempts and attempts >= self.max_attempts:
            return Verdict.DEAD, f"failed delivery.max_attempts ({self.max_attempts}) times"
        return Verdict.RETRY, ""


def _seconds(value: float) -> str:
    """`value` in plain digits, as a configuration file would say it: 86400, 0.5."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def signature(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp` (epoch seconds)."""
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: bytes, timestamp: int, body: bytes, given: str, now: float, skew: float) -> bool:
    """What a receiver checks: the signature matches and the timestamp is within `skew`
    seconds of `now` (compared in constant time)."""
    if abs(now - timestamp) > skew:
        return False
    return hmac.compare_digest(signature(secret, timestamp, body), given)
