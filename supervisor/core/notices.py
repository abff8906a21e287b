"""What recovery tells the user when it ends a turn instead of continuing it.

Pure code: the decision and its facts in, the notice's text, outcome and reason out. The
text says truthfully what happened and asks the user to resend: never silence.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from supervisor.core.recovery import Action, Decision, Interruption
from supervisor.core.vocabulary import Cause
from supervisor.subagents.rules import AUTO_CONTINUE_OFF

RESEND = "Please send your message again."


@dataclass(frozen=True)
class Notice:
    """A turn ended by recovery: what the user reads, and how it is counted and stored."""

    text: str
    outcome: str  # the metric's outcome: finalized, quarantined, noticed
    reason: str  # the session row's reason: stale, quarantined, unsafe_tail


def notice(decision: Decision, facts: Interruption, session_id: str) -> Notice:
    """The notice for a FINALIZE_STALE or NOTICE_RESEND decision."""
    cause = _cause_text(facts.cause)
    if decision.action is Action.FINALIZE_STALE:
        return Notice(
            f"This turn was interrupted ({cause}) at {_when(facts.interrupted_at)}, "
            f"longer ago than recovery continues turns by itself. {RESEND}",
            "finalized",
            "stale",
        )
    if decision.quarantine:
        return Notice(
            f"This turn was interrupted ({cause}) and each of the "
            f"{facts.attempts} attempts to continue it failed, so this session is "
            "quarantined: it will not be run again by itself. An operator can lift this "
            f"with `turnkeeper sessions release {session_id}`; then {RESEND[0].lower()}"
            f"{RESEND[1:]}",
            "quarantined",
            "quarantined",
        )
    return Notice(
        f"This turn was interrupted ({cause}) at a point where going "
        f"on by itself would not be safe. {RESEND}",
        "noticed",
        "unsafe_tail",
    )


def subagent_notice(decision: Decision, facts: Interruption) -> Notice:
    """The notice that ends a subagent's turn instead of continuing it; its outcome is
    the subagent's final status (`supervisor.subagents.rules.final_status`)."""
    cause = _cause_text(facts.cause)
    if decision.action is Action.FINALIZE_STALE:
        return Notice(
            f"This subagent's turn was interrupted ({cause}) at {_when(facts.interrupted_at)}, "
            "longer ago than subagents.freshness: it was finalized, not resumed.",
            "finalized",
            "stale",
        )
    if decision.quarantine:
        return Notice(
            f"This subagent's turn was interrupted ({cause}) and each of the "
            f"{facts.attempts} attempts to continue it failed: it is wedged and will not "
            "be run again.",
            "wedged",
            "wedged",
        )
    if decision.reason == AUTO_CONTINUE_OFF:
        return Notice(
            f"This subagent's turn was interrupted ({cause}); recovery.auto_continue is off, "
            "so it is not resumed: it ended without a result.",
            "failed",
            "auto_continue_off",
        )
    return Notice(
        f"This subagent's turn was interrupted ({cause}) at a point where going on by "
        "itself would not be safe: it ended without a result.",
        "failed",
        "unsafe_tail",
    )


def _cause_text(cause: str) -> str:
    try:
        return Cause(cause).text
    except ValueError:
        return cause


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
