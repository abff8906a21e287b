"""What an interrupted session waits for: its next continuation attempt and when.

Recovery's own rule (`supervisor.core.recovery`), read from the session's row and its
latest events, so `sessions show` and the API (`GET /v1/sessions`, the console) say the
same thing.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from supervisor.core import recovery
from supervisor.core.tail import ENDED_TAILS
from supervisor.core.vocabulary import SessionStatus

if TYPE_CHECKING:
    from supervisor.store import Store
    from supervisor.store.session_info import SessionInfo

WAIT_EVENTS = 200  # latest events read to tell what an interrupted session waits for


def may_wait(info: SessionInfo, now: float) -> bool:
    """Whether the session may wait for a continuation attempt at all (no read needed to
    rule the others out): open, a turn in it, no input pending, and no live lease."""
    if info.status != SessionStatus.OPEN or not info.active_turn_id or info.pending:
        return False
    return info.lease_expires_at is None or info.lease_expires_at < now


def waiting_for(store: Store, info: SessionInfo, delays: tuple[float, ...]) -> str | None:
    """What an interrupted session waits for, if it waits for a continuation attempt:
    `continuation attempt 3 of 3 at 12:01:07` (local time). None for a turn still running
    (its lease is live) or none at all."""
    now = store.now()
    if not may_wait(info, now):
        return None
    events = store.events.read(info.id, after=max(0, info.last_seq - WAIT_EVENTS))
    facts = recovery.interruption(
        info,
        events,
        recovery.Trigger.BOOT_SCAN,
        now,
        host_prefix="",
        last_attempt_at=None,
        died=False,
    )
    if facts.tail in ENDED_TAILS or facts.attempts >= len(delays):
        return None
    since = facts.last_attempt_at if facts.last_attempt_at is not None else facts.interrupted_at
    due = recovery.next_attempt_at(facts.attempts, since, delays)
    if due is None:
        return None
    at = datetime.fromtimestamp(due).strftime("%H:%M:%S")
    return f"continuation attempt {facts.attempts + 1} of {len(delays)} at {at}"
