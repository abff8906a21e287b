"""The subagent registry: spawn a child session, report its outcome to its parent once,
cancel a parent's children, and the claims of the daemons that reconcile them.

The rules are `supervisor.subagents.rules`'s. Every write here is one transaction: a
spawn writes the parent's `subagent_spawned`, the child session (its ACL copied from the
parent's, its task as its first user message) and the registry row together; a report
writes the row's final state and the parent's `subagent_result` together, and only while
the row is `running`, so a child is reported once whatever crashes in between.

`finish` and `cancel_within` write inside a transaction their caller opened: this
module's, or `sessions.py`'s (an interrupt or a close cancels the session's children in
its own transaction).

Rows are locked parent session first, then registry row, then child session, everywhere,
so that two daemons (or a report and a cancel) take turns instead of deadlocking.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import peewee

from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import (
    EventType,
    SessionKind,
    SessionStatus,
    SubagentStatus,
    TurnOutcome,
    Writer,
)
from supervisor.store import lifecycle
from supervisor.store.claims import Claims
from supervisor.store.db import db_now, run_write
from supervisor.store.errors import LeaseLost
from supervisor.store.eventlog import EventRecord, make_request
from supervisor.store.events import call_key
from supervisor.store.models import Event, Session, SessionACL, Subagent
from supervisor.subagents import rules

__all__ = ["Reported", "Spawned", "SubagentInfo", "Subagents", "cancel_within", "descendants"]

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


class Subagents:
    """The registry of subagents."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    # --- spawn ----------------------------------------------------------------------

    def spawn(
        self,
        parent_id: str,
        task: str,
        *,
        token: int,
        turn_id: str | None,
        max_depth: int,
        max_children: int,
        max_per_root: int = 0,
        title: str = "",
        agent: str | None = None,
        call_id: str | None = None,
    ) -> Spawned:
        """Start a child session for `task`, as the parent's turn holding `token`.

        LeaseLost if the token is not the parent's; `rules.Refused` (saying why) past the
        limits; ValueError for a bad task. With `call_id`, a second spawn by the same tool
        call of the same turn (a continued turn making the call again) returns the first
        child instead of starting another.
        """
        task = rules.check_task(task)
        key = call_key(call_id)
        title = (title or " ".join(task.split())[:80]).replace("\x00", "")[:200]

        def work() -> Spawned:
            parent = lifecycle.locked_row(parent_id)
            if parent.lease_token != token:
                raise LeaseLost(parent_id, token, parent.lease_token)
            if key is not None:
                earlier = Subagent.get_or_none(
                    (Subagent.parent == parent_id)
                    & (Subagent.call_id == key)
                    & (Subagent.turn_id == turn_id)
                )
                if earlier is not None:
                    return Spawned(info_of(earlier), int(earlier.spawned_seq), 1, False)
            if parent.status != SessionStatus.OPEN:
                raise rules.Refused(f"this session is {parent.status}: it starts no subagent")
            depth = self._depth(parent_id)
            running = (
                Subagent.select()
                .where((Subagent.parent == parent_id) & (Subagent.status == SubagentStatus.RUNNING))
                .count()
            )
            why = rules.refusal(depth, running, max_depth=max_depth, max_children=max_children)
            root = self._root(parent_id)
            if why is None and max_per_root:
                why = rules.tree_refusal(self._open_in_tree(root), max_per_root)
            if why is not None:
                raise rules.Refused(why)
            child_id = uuid.uuid4().hex
            now = SYSTEM.time()
            child_agent = parent.agent if agent is None else agent
            Session.insert(
                id=child_id,
                kind=SessionKind.SUBAGENT,
                parent=parent_id,
                title=title,
                agent=child_agent,
                created_at=now,
                updated_at=now,
                principal=parent.principal,
            ).execute()
            acl = SessionACL.select(SessionACL.principal, SessionACL.permission).where(
                SessionACL.session == parent_id
            )
            found: list[tuple[str, str]] = list(acl.tuples())  # type: ignore[arg-type]
            rows = [(child_id, principal, permission) for principal, permission in found]
            if rows:
                SessionACL.insert_many(
                    rows, fields=[SessionACL.session, SessionACL.principal, SessionACL.permission]
                ).execute()
            spawned = {
                "subagent": child_id,
                "task": task,
                "title": title,
                "agent": child_agent,
                "depth": depth + 1,
                "call_id": call_id,
            }
            first = {"text": task, "subagent_of": parent_id}
            spawned_seq, task_seq = lifecycle.append_all(
                self._db,
                [
                    make_request(
                        parent_id, EventType.SUBAGENT_SPAWNED, spawned, token=token, turn_id=turn_id
                    ),
                    make_request(child_id, EventType.USER_MESSAGE, first),
                ],
            )
            Subagent.insert(
                id=child_id,
                parent=parent_id,
                depth=depth + 1,
                task=task,
                title=title,
                agent=child_agent,
                status=SubagentStatus.RUNNING,
                call_id=key,
                turn_id=turn_id,
                spawned_seq=spawned_seq,
                created_at=now,
                root=root,
            ).execute()
            row = Subagent.get(Subagent.id == child_id)
            return Spawned(info_of(row), spawned_seq, task_seq, True)

        result: Spawned = run_write(self._db, work)
        return result

    @staticmethod
    def _root(session_id: str) -> str:
        """The top session of the tree `session_id` is in (itself, for a top session)."""
        root = Subagent.select(Subagent.root).where(Subagent.id == session_id).scalar()
        return str(root or session_id)

    @staticmethod
    def _open_in_tree(root: str) -> int:
        """The subagents under `root` still running (a child's session is closed, for
        good, in the transaction that ends its row)."""
        query = Subagent.select().where(
            (Subagent.root == root) & (Subagent.status == SubagentStatus.RUNNING)
        )
        return int(query.count())

    @staticmethod
    def _depth(session_id: str) -> int:
        """How deep the session is: 0 for a top session, its registry row's depth else."""
        depth = Subagent.select(Subagent.depth).where(Subagent.id == session_id).scalar()
        return int(depth or 0)

    # --- reading --------------------------------------------------------------------

    def get(self, child_id: str) -> SubagentInfo | None:
        """The registry row of a child, or None."""
        row = Subagent.get_or_none(Subagent.id == child_id)
        return None if row is None else info_of(row)

    def children(self, parent_id: str, limit: int = 1000) -> list[SubagentInfo]:
        """The children of a session, oldest first."""
        query = (
            Subagent.select()
            .where(Subagent.parent == parent_id)
            .order_by(Subagent.created_at, Subagent.id)
            .limit(limit)
        )
        return [info_of(row) for row in query]

    def counts(self) -> dict[str, int]:
        """Subagents by status (every status, 0 included)."""
        counts = {status.value: 0 for status in SubagentStatus}
        query = Subagent.select(Subagent.status, peewee.fn.COUNT(Subagent.id)).group_by(
            Subagent.status
        )
        found: list[tuple[str, int]] = list(query.tuples())  # type: ignore[arg-type]
        for status, number in found:
            counts[str(status)] = int(number)
        return counts

    def running(self, limit: int = 1000) -> list[SubagentInfo]:
        """Running rows, oldest first."""
        query = (
            Subagent.select()
            .where(Subagent.status == SubagentStatus.RUNNING)
            .order_by(Subagent.created_at, Subagent.id)
            .limit(limit)
        )
        return [info_of(row) for row in query]

    # --- claims ---------------------------------------------------------------------

    def claim(
        self, owner: str, ttl: float, limit: int = 500, mine: str | None = None
    ) -> list[SubagentInfo]:
        """Claim running rows for `owner` ("<host>/<boot8>") until `ttl` seconds from now by
        the database clock, and return every row it holds: its own are renewed, and at
        most `limit` more are taken, oldest first, of the unclaimed ones, those whose claim
        ran out and, with `mine` ("<host>/"), those of this host's earlier boots (one
        daemon holds a host id at a time: they are dead). On the server databases `FOR
        UPDATE SKIP LOCKED`: two daemons claiming at once take different rows; SQLite's
        `BEGIN IMMEDIATE` serializes them."""

        def work() -> list[SubagentInfo]:
            now = db_now(self._db)
            running = Subagent.status == SubagentStatus.RUNNING
            mine_now = Subagent.select(Subagent.id).where(running & CLAIMS.held_by(owner))
            if self._db.for_update:  # a row being finished is locked: it needs no renewal
                mine_now = mine_now.order_by(Subagent.id).for_update(skip_locked=True)
            CLAIMS.renew([row.id for row in mine_now], owner, now + ttl)
            query = (
                Subagent.select(Subagent.id)
                .where(running & CLAIMS.free(now, owner, mine) & CLAIMS.not_held_by(owner))
                .order_by(Subagent.created_at, Subagent.id)
                .limit(limit)
            )
            if self._db.for_update:
                query = query.for_update(skip_locked=True)
            CLAIMS.take([row.id for row in query], owner, now + ttl, now, mine)
            held = Subagent.select().where(running & CLAIMS.held_by(owner))
            return [info_of(row) for row in held.order_by(Subagent.created_at, Subagent.id)]

        result: list[SubagentInfo] = run_write(self._db, work)
        return result

    def release_claims(self, owner: str) -> int:
        """Give up `owner`'s claims (a clean stop): another daemon may take them at once."""
        return int(
            run_write(
                self._db,
                lambda: CLAIMS.release(owner),
            )
        )

    # --- the one result -------------------------------------------------------------

    def report(self, child_id: str, writer: str = Writer.SUPERVISOR) -> Reported | None:
        """If the child's run is over, commit its outcome to its parent; else None.

        None too if it was reported already: its row is no longer `running`.
        """

        def work() -> Reported | None:
            row = Subagent.get_or_none(Subagent.id == child_id)
            if row is None or row.status != SubagentStatus.RUNNING:
                return None
            lifecycle.locked_row(row.parent)
            row = locked(child_id)
            if row is None or row.status != SubagentStatus.RUNNING:
                return None
            child = lifecycle.locked_row_if_any(child_id)
            facts = rules.Child.of(child, running_children(child_id))
            if rules.reconcile(facts) is not rules.Step.REPORT:
                return None
            status, text = rules.outcome(facts.status, latest(child_id))
            return finish(self._db, row, child, status, text, writer)

        result: Reported | None = run_write(self._db, work)
        return result

    def finalize(
        self,
        child_id: str,
        turn_id: str,
        status: SubagentStatus,
        reason: str,
        notice: str,
        *,
        token: int | None = None,
    ) -> Reported | None:
        """Recovery gives up on a child's interrupted turn: end it with a `notice`, and
        report `status` to the parent, in one transaction.

        Nothing is done (None) unless `turn_id` is still the child's active turn and, with
        `token`, its lease token is still that one (recovery judged a read that may be old).
        """

        def work() -> Reported | None:
            row = Subagent.get_or_none(Subagent.id == child_id)
            if row is None or row.status != SubagentStatus.RUNNING:
                return None
            lifecycle.locked_row(row.parent)
            row = locked(child_id)
            child = lifecycle.locked_row_if_any(child_id)
            if row is None or row.status != SubagentStatus.RUNNING or child is None:
                return None
            if child.active_turn_id != turn_id or token not in (None, child.lease_token):
                return None
            lifecycle.append_all(
                self._db,
                [
                    make_request(
                        child_id,
                        EventType.NOTICE,
                        {"text": notice, "reason": reason},
                        turn_id=turn_id,
                        writer=Writer.SUPERVISOR,
                    ),
                    make_request(
                        child_id,
                        EventType.TURN_ENDED,
                        {"outcome": TurnOutcome.FAILED, "reason": reason},
                        turn_id=turn_id,
                        writer=Writer.SUPERVISOR,
                    ),
                ],
            )
            return finish(self._db, row, child, status, notice, Writer.SUPERVISOR)

        result: Reported | None = run_write(self._db, work)
        return result

    def descendants(self, session_id: str) -> list[str]:
        """Every child of the session, their children, and so on."""
        return descendants(session_id)


# --- inside an open transaction -------------------------------------------------


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
        ended_at=SYSTEM.time(),
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
