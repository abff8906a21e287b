"""Subagent registry rows: their shapes, and the writes inside an open transaction that
end a child (its one `subagent_result`) or cancel a parent's children.

Used by `supervisor.store.subagents` (which opens the transactions) and by `sessions.py`
(an interrupt or a close cancels the children in its own transaction). Rows are locked
parent session first, then registry row, then child session, everywhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import peewee

from supervisor.core.vocabulary import (
    EventType,
    SessionStatus,
    SubagentStatus,
    Writer,
)
from supervisor.store import lifecycle
from supervisor.store.claims import Claims
from supervisor.store.eventlog import EventRecord, make_request
from supervisor.store.models import Event, Session, Subagent
from supervisor.subagents import rules

OUTCOME_EVENTS = 50  # a child's latest events read for its outcome: its last turn's end
CLAIMS = Claims(Subagent)


@dataclass(frozen=True)
class SubagentInfo:
    """A registry row as the rest of turnkeeper sees it."""

    id: str
    parent: str
    depth: int
    task: str
    title: str
    agent: str
    status: str
    call_id: str | None
    spawned_seq: int
    result_seq: int | None
    summary: str
    created_at: float
    ended_at: float | None

    def to_dict(self) -> dict[str, Any]:
        """The API shape of a subagent."""
        return {
            "id": self.id,
            "parent": self.parent,
            "depth": self.depth,
            "task": self.task,
            "title": self.title,
            "agent": self.agent,
            "status": self.status,
            "created_at": self.created_at,
            "ended_at": self.ended_at,
            "result": self.summary if self.status != SubagentStatus.RUNNING else None,
        }


def info_of(row: Subagent) -> SubagentInfo:
    return SubagentInfo(
        id=row.id,
        parent=row.parent,
        depth=int(row.depth),
        task=row.task,
        title=row.title,
        agent=row.agent,
        status=row.status,
        call_id=row.call_id,
        spawned_seq=int(row.spawned_seq),
        result_seq=None if row.result_seq is None else int(row.result_seq),
        summary=row.summary,
        created_at=row.created_at,
        ended_at=row.ended_at,
    )


@dataclass(frozen=True)
class Spawned:
    """A child started (or found: the same tool call spawned it before)."""

    child: SubagentInfo
    spawned_seq: int  # the parent's `subagent_spawned`
    task_seq: int  # the child's first user message
    new: bool  # False: an earlier spawn by the same call, returned again


@dataclass(frozen=True)
class Reported:
    """A child's outcome committed to its parent."""

    child: str
    parent: str
    status: SubagentStatus
    seq: int  # the parent's `subagent_result`
    woke: bool  # the result marks the parent pending (not a cancellation)
    cancelled: tuple[str, ...] = ()  # its own subagents, cancelled with it


def finish(
    db: peewee.Database,
    row: Subagent,
    child: Session | None,
    status: SubagentStatus,
    text: str,
    writer: str,
    *,
    wake: bool = True,
) -> Reported:
    """Inside the open transaction, the rows locked: the row's final state, the
    parent's `subagent_result`, and the child session closed for good, its own running
    children cancelled first (their results would go to a session that reads none).
    `wake`: the result makes the parent pending (not for a cascade of cancellations)."""
    cascade = cancel_within(db, row.id, writer, "its parent ended")
    parent = Session.get(Session.id == row.parent)
    payload = {
        "subagent": row.id,
        "status": status.value,
        "text": text[: rules.RESULT_MAX],
        "title": row.title,
        "task": row.task[:200],
    }
    (seq,) = lifecycle.append_all(
        db, [make_request(row.parent, EventType.SUBAGENT_RESULT, payload, writer=writer)]
    )
    if not wake:  # a cancellation is history for the parent's next turn, not a turn
        Session.update(pending=parent.pending).where(Session.id == row.parent).execute()
    Subagent.update(
        CLAIMS.cleared(),
        status=status,
        ended_at=time.time(),
        summary=" ".join(text.replace("\x00", "").split())[: rules.SUMMARY_MAX],
        result_seq=seq,
    ).where(Subagent.id == row.id).execute()
    if child is not None:
        changes = lifecycle.revoked() | {
            Session.status: SessionStatus.CLOSED,
            Session.pending: False,
        }
        Session.update(changes).where(Session.id == row.id).execute()
    cancelled = tuple(c for done in cascade for c in (done.child, *done.cancelled))
    return Reported(row.id, row.parent, status, seq, wake, cancelled)


# --- cancel ---------------------------------------------------------------------


def cancel_within(db: peewee.Database, parent_id: str, by: str, why: str) -> list[Reported]:
    """Inside the caller's open transaction (the parent row locked): cancel the
    parent's running children, theirs first; each is reported once, without waking the
    parent: `cancelled`, or what it came to if its run was over already (not reported yet).

    Their turns in flight end `interrupted_by_operator` and their leases are revoked:
    the workers running them can commit nothing more (the caller stops them).
    """
    reported: list[Reported] = []
    ids = [
        row.id
        for row in Subagent.select(Subagent.id).where(
            (Subagent.parent == parent_id) & (Subagent.status == SubagentStatus.RUNNING)
        )
    ]
    for child_id in sorted(ids):
        row = locked(child_id)
        if row is None or row.status != SubagentStatus.RUNNING:
            continue
        child = lifecycle.locked_row_if_any(child_id)
        status, text = SubagentStatus.CANCELLED, why
        facts = rules.Child.of(child, running_children(child_id))
        over = facts.status == SessionStatus.OPEN and rules.reconcile(facts) is rules.Step.REPORT
        if over:  # its run had ended, unreported: that is its result
            status, text = rules.outcome(facts.status, latest(child_id))
        if child is not None and child.active_turn_id:
            lifecycle.interrupt(db, child_id, by)
            child = Session.get(Session.id == child_id)
        done = finish(db, row, child, status, text, Writer.SUPERVISOR, wake=False)
        reported.append(done)
    return reported


def running_children(session_id: str) -> int:
    """How many subagents of the session are running."""
    return int(
        Subagent.select()
        .where((Subagent.parent == session_id) & (Subagent.status == SubagentStatus.RUNNING))
        .count()
    )


def descendants(session_id: str) -> list[str]:
    """Every subagent of the session, theirs, and so on (`subagents.max_depth` levels)."""
    found: list[str] = []
    level = [session_id]
    while level:
        level = [row.id for row in Subagent.select(Subagent.id).where(Subagent.parent.in_(level))]
        found += level
    return found


def locked(child_id: str) -> Subagent | None:
    """The registry row, locked for the open transaction on the server databases."""
    query = Subagent.select().where(Subagent.id == child_id)
    if Subagent._meta.database.for_update:
        query = query.for_update()
    row: Subagent | None = query.first()
    return row


def latest(session_id: str) -> list[EventRecord]:
    """The session's latest events, oldest first."""
    query = (
        Event.select()
        .where(Event.session_id == session_id)
        .order_by(Event.seq.desc())
        .limit(OUTCOME_EVENTS)
    )
    rows = [
        EventRecord(
            session_id=e.session_id,
            seq=int(e.seq),
            type=e.type,
            turn_id=e.turn_id,
            payload=json.loads(e.payload),
            created_at=e.created_at,
            writer=e.writer,
        )
        for e in query
    ]
    return rows[::-1]
