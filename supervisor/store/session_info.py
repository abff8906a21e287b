"""A session row as the rest of turnkeeper sees it (`Sessions` reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.store.models import Session


@dataclass(frozen=True)
class SessionInfo:
    """A session row as the rest of turnkeeper sees it."""

    id: str
    kind: str
    parent: str | None
    title: str
    agent: str
    status: str
    created_at: float
    updated_at: float
    last_seq: int
    owner: str | None
    lease_token: int
    lease_expires_at: float | None
    pending: bool
    active_turn_id: str | None
    attempt_turn_id: str | None
    attempt_count: int
    quarantined_at: float | None
    quarantine_reason: str | None
    resend_requested_at: float | None = None
    deliver_to: str | None = None  # the delivery target it is bound to
    principal: str | None = None  # who it belongs to, for limits (not shown by the API)

    def to_dict(self) -> dict[str, Any]:
        """The API shape of a session."""
        return {
            "id": self.id,
            "kind": self.kind,
            "parent": self.parent,
            "title": self.title,
            "agent": self.agent,
            "status": self.status,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "last_seq": self.last_seq,
            "pending": self.pending,
            "active_turn_id": self.active_turn_id,
            "resend_requested_at": self.resend_requested_at,
            "deliver_to": self.deliver_to,
        }


INFO_FIELDS = tuple(SessionInfo.__dataclass_fields__)


def info_of(row: Session) -> SessionInfo:
    values = {name: getattr(row, name) for name in SessionInfo.__dataclass_fields__}
    values["pending"] = bool(values["pending"])
    return SessionInfo(**values)
