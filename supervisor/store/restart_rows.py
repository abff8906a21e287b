"""The restart requests' rows as the rest of turnkeeper sees them (the API's shape), what a
request and a settlement return, the row lock, and the registry's reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import peewee

from supervisor.core.vocabulary import RestartState
from supervisor.store.models import RestartRequest

LIVE = (RestartState.PENDING, RestartState.RESTARTING)
LIST_MAX = 1000


@dataclass(frozen=True)
class RestartInfo:
    """A restart request's row."""

    id: str
    host: str
    boot: str
    pid: int
    session: str | None
    turn_id: str | None
    call_id: str | None
    requested_by: str
    reason: str
    drain: float | None
    state: str
    active_host: str | None
    requested_at: float
    started_at: float | None
    settled_at: float | None
    version_before: str
    config_before: str
    outcome: str | None
    detail: str
    boot_after: str | None
    version_after: str | None
    config_after: str | None
    seconds: float | None
    request_seq: int | None
    notice_seq: int | None
    result_seq: int | None

    def as_dict(self) -> dict[str, Any]:
        """For the API and `--json` (every value is JSON's already)."""
        return asdict(self)


FIELDS = tuple(RestartInfo.__dataclass_fields__)


def info_of(row: RestartRequest) -> RestartInfo:
    return RestartInfo(**{name: getattr(row, name) for name in FIELDS})


@dataclass(frozen=True)
class Admitted:
    """What `request` answered: a new row (`new`), the live one of the host, or the row the
    same tool call made before. `seq`: the session's `restart_requested`, if any."""

    info: RestartInfo
    new: bool
    seq: int | None


@dataclass(frozen=True)
class Settled:
    """A request settled now: its row, and the seqs of what its session was told (None:
    no session, or a closed one)."""

    info: RestartInfo
    notice_seq: int | None
    result_seq: int | None


class RateLimited(Exception):
    """A restart was requested less than restart.min_interval ago; `retry_after` seconds."""

    def __init__(self, last: RestartInfo, ago: float, min_interval: float, retry_after: float):
        wait = math.ceil(retry_after * 10) / 10
        super().__init__(
            f"a restart was requested {ago:.1f} s ago ({last.id}); restart.min_interval is "
            f"{min_interval:g} s: try again in {wait:.1f} s"
        )
        self.last = last
        self.retry_after = retry_after


def locked(restart_id: str) -> RestartRequest | None:
    """The row, locked for the open write transaction (after its session's: the order)."""
    query = RestartRequest.select().where(RestartRequest.id == restart_id)
    if RestartRequest._meta.database.for_update:
        query = query.for_update()
    row: RestartRequest | None = query.first()
    return row


class Reading:
    """The registry read: a request, a host's live one and unsettled ones, the counts and
    the list."""

    def get(self, restart_id: str) -> RestartInfo | None:
        """The row of a request, or None."""
        row = RestartRequest.get_or_none(RestartRequest.id == restart_id)
        return None if row is None else info_of(row)

    def active(self, host: str) -> RestartInfo | None:
        """The host's live request (pending or restarting), if any: at most one."""
        row = RestartRequest.get_or_none(RestartRequest.active_host == host)
        return None if row is None else info_of(row)

    def unsettled(self, host: str) -> list[RestartInfo]:
        """The host's requests not settled yet, oldest first: what its next boot settles."""
        query = (
            RestartRequest.select()
            .where((RestartRequest.host == host) & RestartRequest.state.in_(list(LIVE)))
            .order_by(RestartRequest.requested_at, RestartRequest.id)
        )
        return [info_of(row) for row in query]

    def counts(self) -> dict[str, int]:
        """Requests by state (every state, 0 if none)."""
        query = (
            RestartRequest.select(RestartRequest.state, peewee.fn.COUNT(RestartRequest.id))
            .group_by(RestartRequest.state)
            .tuples()
        )
        found: dict[str, int] = {str(row[0]): int(row[1]) for row in query.iterator()}
        return {state.value: found.get(state.value, 0) for state in RestartState}

    def list(self, *, host: str | None = None, limit: int = 50) -> list[RestartInfo]:
        """Requests newest first; of one `host`."""
        query = RestartRequest.select()
        if host is not None:
            query = query.where(RestartRequest.host == host)
        query = query.order_by(RestartRequest.requested_at.desc(), RestartRequest.id.desc())
        return [info_of(row) for row in query.limit(max(1, min(limit, LIST_MAX)))]
