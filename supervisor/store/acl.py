"""Who may read, write or administer a session: its access control list."""

from __future__ import annotations

import peewee

from supervisor.core.vocabulary import EventType, Permission, Writer
from supervisor.store import lifecycle
from supervisor.store.db import run_write
from supervisor.store.eventlog import make_request, write_events
from supervisor.store.models import SessionACL, Subagent

PERMISSIONS = tuple(Permission)  # each includes the ones before it


class Acl:
    """Who may read, write or administer a session."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def grant(self, session_id: str, principal: str, permission: str, *, by: str = "") -> int:
        """Set `principal`'s permission; records an `acl` event in the same transaction.

        Returns the seq of that event.
        """
        if permission not in PERMISSIONS:
            raise ValueError(f"permission must be one of {', '.join(PERMISSIONS)}")
        return self._change(session_id, principal, permission, by)

    def revoke(self, session_id: str, principal: str, *, by: str = "") -> int:
        """Remove `principal`'s permission; records an `acl` event. Returns its seq."""
        return self._change(session_id, principal, None, by)

    def _change(self, session_id: str, principal: str, permission: str | None, by: str) -> int:
        """The change on the session and on its subagents (they inherit its ACL), each
        with its `acl` event, in one transaction; the seq of the session's own event."""
        payload = {"principal": principal, "permission": permission, "by": by}

        def work() -> int:
            # The rows locked level by level, parent first (as a spawn locks its parent
            # before it copies the ACL): no child is spawned half-way through the change.
            lifecycle.locked_row(session_id)
            sessions, level = [session_id], [session_id]
            while level := [
                row.id for row in Subagent.select(Subagent.id).where(Subagent.parent.in_(level))
            ]:
                for child in sorted(level):
                    lifecycle.locked_row(child)
                sessions += level
            SessionACL.delete().where(
                SessionACL.session.in_(sessions) & (SessionACL.principal == principal)
            ).execute()
            if permission is not None:
                SessionACL.insert_many(
                    [(sid, principal, permission) for sid in sessions],
                    fields=[SessionACL.session, SessionACL.principal, SessionACL.permission],
                ).execute()
            events = [
                make_request(sid, EventType.ACL, payload, writer=Writer.SUPERVISOR)
                for sid in sessions
            ]
            seqs = []
            for outcome in write_events(self._db, events):
                if isinstance(outcome, Exception):
                    raise outcome
                seqs.append(outcome)
            return seqs[0]

        return run_write(self._db, work)

    def permission(self, session_id: str, principal: str) -> str | None:
        """`principal`'s permission on the session, or None."""
        value: str | None = (
            SessionACL.select(SessionACL.permission)
            .where((SessionACL.session == session_id) & (SessionACL.principal == principal))
            .scalar()
        )
        return value

    def entries(self, session_id: str) -> dict[str, str]:
        """Every principal's permission on the session."""
        query = SessionACL.select().where(SessionACL.session == session_id)
        return {row.principal: row.permission for row in query}
