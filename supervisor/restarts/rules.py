"""Restart requests: the rules, as pure code.

An operator or an agent asks the daemon to restart. The request is a row committed before
anything stops (`supervisor.store.restarts`); the boot after the stop settles it, once,
and tells the session that asked (a `notice`, and a `restart_result` its next turn reads).

Admitting a request (`admit`), the host's rows read on the database clock:

  facts                                               verdict
  --------------------------------------------------  ------------------------------------
  a request of the host is live (pending/restarting)  in_progress: answered with that row
  the latest was requested under min_interval ago     rate_limited: retry_after seconds
  otherwise                                           new: the row is written

Settling it (`settle`), by the row's state and how the boot that admitted it ended;
`refused` is why it did not happen (the configuration does not load, the daemon was told
to stop during it):

  refused  state       admitting boot ended  outcome  detail
  -------  ----------  --------------------  -------  ----------------------------------
  yes      any         any                   failed   the restart did not happen: WHY
  no       restarting  clean                 ok       ""
  no       pending     clean                 ok       stopped and started before it began
  no       any         unclean, failed, or   failed   did not stop cleanly, started again
                       never (crash, SIGKILL)
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.core.vocabulary import BootOutcome, RestartOutcome, RestartState

REASON_MAX = 500  # characters of a request's reason, kept
# Dropped from a reason: controls, invisible format characters (bidi overrides) and lone
# surrogates (no database can store them).
_DROPPED = frozenset({"Cc", "Cf", "Cs"})

Verdict = Literal["new", "in_progress", "rate_limited"]


class RestartRefused(Exception):
    """The daemon will not restart now; the message says why in one line."""


def clean_reason(text: object) -> str:
    """A request's reason as stored and shown: control characters dropped, whitespace
    collapsed to single spaces, at most `REASON_MAX` characters. ValueError unless a
    string."""
    if not isinstance(text, str):
        raise ValueError("reason must be a string")
    kept = "".join(
        " " if ch.isspace() else ch
        for ch in text
        if ch.isspace() or unicodedata.category(ch) not in _DROPPED
    )
    return " ".join(kept.split())[:REASON_MAX].rstrip()


@dataclass(frozen=True)
class Admission:
    """What `admit` decided; `retry_after` (seconds) only when rate_limited."""

    verdict: Verdict
    retry_after: float = 0.0


def admit(
    active: bool, last_requested_at: float | None, now: float, min_interval: float
) -> Admission:
    """Whether a new request is admitted (the first table above).

    `active`: the host has a live request; `last_requested_at`: its latest request's time,
    if any; `now`: the database clock. A live request answers before any rate limit. A
    clock stepped back never makes the wait longer than `min_interval`.
    """
    if active:
        return Admission("in_progress")
    if last_requested_at is not None and min_interval > 0:
        ago = now - last_requested_at
        if ago < min_interval:
            return Admission("rate_limited", min(min_interval - ago, min_interval))
    return Admission("new")


def wait_left(requested_at: float, now: float, turn_wait: float, asking: bool) -> float:
    """Seconds an agent's request still waits before the restart begins: while the turn
    that asked is in flight (`asking`), at most `turn_wait` after it was requested; 0 means
    begin now. All times on the database clock."""
    if not asking:
        return 0.0
    return max(0.0, turn_wait - max(0.0, now - requested_at))


@dataclass(frozen=True)
class Settlement:
    """How a request ended, and why in words (empty for a plain success)."""

    outcome: RestartOutcome
    detail: str


REFUSED = "the restart did not happen"
BEFORE_BEGIN = "the daemon was stopped and started again before it began the restart itself"
_UNCLEAN: dict[str | None, str] = {
    BootOutcome.UNCLEAN: "something was left behind when it stopped",
    BootOutcome.STARTUP_FAILED: "it had never become ready",
    None: "it crashed or was killed",
}


def settle(
    state: RestartState | str, admitting_boot_outcome: str | None, refused: str | None = None
) -> Settlement:
    """The outcome of a live request (the second table above). `admitting_boot_outcome`
    is the boot log's outcome of the boot that admitted it (None: it never ended);
    `refused`, why the daemon refused to begin (its configuration does not load ...)."""
    state = RestartState(state)
    if state is RestartState.DONE:
        raise ValueError("this restart request is settled already")
    if refused is not None:
        why = clean_reason(refused)
        return Settlement(RestartOutcome.FAILED, f"{REFUSED}: {why}" if why else REFUSED)
    if admitting_boot_outcome == BootOutcome.CLEAN:
        detail = "" if state is RestartState.RESTARTING else BEFORE_BEGIN
        return Settlement(RestartOutcome.OK, detail)
    known = admitting_boot_outcome in _UNCLEAN
    why = _UNCLEAN[admitting_boot_outcome] if known else f"its boot ended {admitting_boot_outcome}"
    return Settlement(
        RestartOutcome.FAILED,
        f"the daemon did not stop cleanly ({why}) and was started again",
    )


def _seconds(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "an unknown time"
    return f"{value:.1f} s"


def _changes(
    version_before: object, version_after: object, config_before: object, config_after: object
) -> str:
    def known(value: object) -> str:
        return str(value) if value not in (None, "") else "?"

    return (
        f"version {known(version_before)} -> {known(version_after)}, "
        f"configuration {known(config_before)} -> {known(config_after)}"
    )


def notice_text(
    outcome: RestartOutcome | str,
    seconds: float | None,
    detail: str,
    version_before: str | None,
    version_after: str | None,
    config_before: str | None,
    config_after: str | None,
) -> str:
    """The settlement in words for the user (the session's `notice`)."""
    changes = _changes(version_before, version_after, config_before, config_after)
    if outcome == RestartOutcome.OK:
        text = f"The restart this session asked for completed in {_seconds(seconds)}: {changes}."
        return f"{text} Note: {detail}." if detail else text
    return (
        f"The restart this session asked for did not complete cleanly: {detail or 'no detail'}. "
        f"It took {_seconds(seconds)}; {changes}."
    )


def result_text(payload: Mapping[str, Any]) -> str:
    """A `restart_result` as the model reads it; any key may be missing."""
    reason = str(payload.get("reason") or "")
    asked = f" (reason: {reason})" if reason else ""
    changes = _changes(
        payload.get("version_before"),
        payload.get("version_after"),
        payload.get("config_before"),
        payload.get("config_after"),
    )
    detail = str(payload.get("detail") or "")
    head = f"[restart result] The restart you asked for{asked}"
    took = _seconds(payload.get("seconds"))
    if payload.get("outcome") == RestartOutcome.OK:
        text = f"{head} completed in {took}: {changes}."
        return f"{text} Note: {detail}." if detail else text
    return f"{head} did not complete cleanly: {detail or 'no detail'}. It took {took}; {changes}."
