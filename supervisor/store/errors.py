"""Errors the store raises to its callers."""

from __future__ import annotations


class StoreError(Exception):
    """A database operation failed in a way the caller should report."""


class BadStoreURL(StoreError):
    """`store.url` names a database turnkeeper cannot use."""


class NotAnswering(StoreError):
    """The database server is not there yet: the connection was refused or timed out, or
    the server is starting up. A start waits for it (`store.connect_timeout`)."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer turnkeeper than this one."""


class SchemaMissing(StoreError):
    """The database has no (or an older) turnkeeper schema and was opened without migrating."""


class StorageUnavailable(StoreError):
    """The database cannot be written now: disk full, read-only, unreachable, locked.

    Nothing of the failed write was stored; the caller may try again later.
    """


class StoreBusy(StorageUnavailable):
    """The database stayed locked or unreachable past the retry deadline."""


class IdempotencyConflict(StoreError):
    """An idempotency key was used again for a different request."""

    def __init__(self, session_id: str, seq: int) -> None:
        super().__init__(
            f"this Idempotency-Key was first used for a different request (seq {seq}); "
            "use a new key for a new message"
        )
        self.session_id = session_id
        self.seq = seq


class SessionNotFound(StoreError):
    """No session has that id."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r}")
        self.session_id = session_id


class LeaseLost(StoreError):
    """The writer's lease token is no longer the session's current token (fencing).

    The writer must abandon the session: another owner holds it now, and nothing of the
    rejected write was stored.
    """

    def __init__(self, session_id: str, token: int | None, current: int | None) -> None:
        super().__init__(
            f"lease lost on session {session_id!r}: writer holds token {token}, "
            f"current token is {current}"
        )
        self.session_id = session_id
        self.token = token
        self.current = current


class SessionClosed(StoreError):
    """The session is closed: it takes no new message and runs no turn any more."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} is closed: it takes no more messages; create a new session"
        )
        self.session_id = session_id


class TooManySessions(StoreError):
    """A principal has as many open sessions as it may (`auth.max_open_sessions_per_principal`)."""

    def __init__(self, principal: str, limit: int) -> None:
        super().__init__(
            f"{principal!r} has {limit} open sessions, the most a principal may have "
            "(auth.max_open_sessions_per_principal): close one first"
        )
        self.principal = principal
        self.limit = limit
