"""The restart requests: admit one before anything stops, begin it, settle it once after.

The rules are `supervisor.restarts.rules`'s. Every write is one transaction:
- `request` writes the row, `pending`, and for an agent's request its session's
  `restart_requested` (with the turn's lease token: a turn fenced out asks for nothing);
  a live request of the host, or one made under restart.min_interval ago (database clock),
  writes nothing;
- `begin` moves a pending row to `restarting` (compare and set);
- `settle`, by the boot after the stop, writes the outcome (`done`) and, if the row has a
  session that is not closed, its `notice` and `restart_result`, once: a second call
  writes nothing.

At most one request per host is live: `active_host` is unique, so of two concurrent
inserts one fails; `run_write` runs it again, and it then reads the winner's row as live.
Rows are locked session first, then request row. The reads: a request, a host's live one
and unsettled ones, the counts and the list.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import peewee

from supervisor.core.vocabulary import EventType, RestartState, SessionStatus, Writer
from supervisor.restarts import rules
from supervisor.store import lifecycle
from supervisor.store.db import db_now, run_write
from supervisor.store.errors import LeaseLost
from supervisor.store.eventlog import make_request
from supervisor.store.events import AppendRequest, call_key
from supervisor.store.models import AgentBootLog, RestartRequest

__all__ = ["Admitted", "RateLimited", "RestartInfo", "Restarts", "Settled"]

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


class Restarts:
    """The registry of restart requests (see the module's docstring)."""

    def __init__(self, db: peewee.Database) -> None:
        self._db = db

    def now(self) -> float:
        """The database clock, which requests are timed by."""
        return db_now(self._db)

    # --- reading --------------------------------------------------------------------

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

    # --- admit ----------------------------------------------------------------------

    def request(
        self,
        *,
        host: str,
        boot: str,
        pid: int,
        by: str,
        reason: object,
        drain: float | None,
        version: str,
        config: str,
        min_interval: float,
        session: str | None = None,
        token: int | None = None,
        turn_id: str | None = None,
        call_id: str | None = None,
    ) -> Admitted:
        """Ask `host`'s daemon (boot `boot`, pid `pid`) to restart, for `by`.

        With `session` (an agent's turn): LeaseLost unless `token` is the session's, and the
        same tool call (`call_id`) made again gets the row it made. A live request of the
        host is the answer (`new` False, nothing written); one requested under
        `min_interval` seconds ago raises RateLimited. ValueError for a reason that is not
        a string.
        """
        reason = rules.clean_reason(reason)
        key = call_key(call_id) if session is not None else None

        def work() -> Admitted:
            if session is not None:
                row = lifecycle.locked_row(session)
                if row.lease_token != token:
                    raise LeaseLost(session, token, row.lease_token)
                if key is not None:
                    earlier = _made_by(session, key, turn_id)
                    if earlier is not None:
                        return Admitted(info_of(earlier), False, earlier.request_seq)
            now = db_now(self._db)
            live = RestartRequest.get_or_none(RestartRequest.active_host == host)
            last = (
                RestartRequest.select()
                .where(RestartRequest.host == host)
                .order_by(RestartRequest.requested_at.desc(), RestartRequest.id.desc())
                .first()
            )
            last_at = None if last is None else float(last.requested_at)
            admission = rules.admit(live is not None, last_at, now, min_interval)
            if admission.verdict == "in_progress":
                assert live is not None
                return Admitted(info_of(live), False, None)
            if admission.verdict == "rate_limited":
                assert last is not None and last_at is not None
                raise RateLimited(info_of(last), now - last_at, min_interval, admission.retry_after)
            restart_id = uuid.uuid4().hex
            seq = None
            if session is not None:
                payload = {"restart": restart_id, "reason": reason, "by": by}
                (seq,) = lifecycle.append_all(
                    self._db,
                    [
                        make_request(
                            session,
                            EventType.RESTART_REQUESTED,
                            payload,
                            token=token,
                            turn_id=turn_id,
                        )
                    ],
                )
            RestartRequest.insert(
                id=restart_id,
                host=host,
                boot=boot,
                pid=pid,
                session=session,
                turn_id=turn_id,
                call_id=key,
                requested_by=by,
                reason=reason,
                drain=drain,
                state=RestartState.PENDING,
                active_host=host,
                requested_at=now,
                version_before=version,
                config_before=config,
                request_seq=seq,
            ).execute()
            return Admitted(info_of(RestartRequest.get(RestartRequest.id == restart_id)), True, seq)

        result: Admitted = run_write(self._db, work)
        return result

    # --- the daemon stops for it ----------------------------------------------------

    def begin(self, restart_id: str, *, boot: str, version: str, config: str) -> RestartInfo | None:
        """The daemon begins to stop for the request: `restarting` from now (database
        clock), with the version and configuration it runs. Its boot (`boot`, the one that
        admitted it, as a rule) is the one whose end decides the outcome. None if the row
        is not pending."""

        def work() -> RestartInfo | None:
            now = db_now(self._db)
            changed = (
                RestartRequest.update(
                    state=RestartState.RESTARTING,
                    started_at=now,
                    boot=boot,
                    version_before=version,
                    config_before=config,
                )
                .where(
                    (RestartRequest.id == restart_id)
                    & (RestartRequest.state == RestartState.PENDING)
                )
                .execute()
            )
            return info_of(RestartRequest.get(RestartRequest.id == restart_id)) if changed else None

        result: RestartInfo | None = run_write(self._db, work)
        return result

    # --- the boot after -------------------------------------------------------------

    def settle(
        self,
        restart_id: str,
        *,
        boot: str,
        version: str,
        config: str,
        refused: str | None = None,
    ) -> Settled | None:
        """Settle a live request, once, as boot `boot` (running `version` and `config`):
        its outcome by how the boot it names ended (the boot log), or failed when
        `refused` says why the daemon refused to begin. Its session, unless closed, gets a
        `notice` and a `restart_result` (which makes its next turn run). None if the
        request is settled already (or there is none): nothing is written."""

        def work() -> Settled | None:
            row = RestartRequest.get_or_none(RestartRequest.id == restart_id)
            if row is None or row.state == RestartState.DONE:
                return None
            session = lifecycle.locked_row_if_any(row.session)
            row = locked(restart_id)
            if row is None or row.state == RestartState.DONE:
                return None
            ended = (
                AgentBootLog.select(AgentBootLog.outcome)
                .where(AgentBootLog.boot_id == row.boot)
                .scalar()
            )
            settlement = rules.settle(row.state, ended, refused)
            now = db_now(self._db)
            since = row.started_at if row.started_at is not None else row.requested_at
            seconds = max(0.0, now - since)
            notice_seq = result_seq = None
            if session is not None and session.status != SessionStatus.CLOSED:
                notice_seq, result_seq = lifecycle.append_all(
                    self._db, _told(session.id, row, settlement, seconds, version, config)
                )
            RestartRequest.update(
                state=RestartState.DONE,
                active_host=None,
                settled_at=now,
                seconds=seconds,
                outcome=settlement.outcome,
                detail=settlement.detail,
                boot_after=boot,
                version_after=version,
                config_after=config,
                notice_seq=notice_seq,
                result_seq=result_seq,
            ).where(RestartRequest.id == restart_id).execute()
            info = info_of(RestartRequest.get(RestartRequest.id == restart_id))
            return Settled(info, notice_seq, result_seq)

        result: Settled | None = run_write(self._db, work)
        return result


def _made_by(session: str, key: str, turn_id: str | None) -> RestartRequest | None:
    """The request the same tool call of the same turn of `session` made, if any (a
    later turn's call with the same id, or the same reason, is a new request)."""
    row: RestartRequest | None = (
        RestartRequest.select()
        .where(
            (RestartRequest.session == session)
            & (RestartRequest.call_id == key)
            & (RestartRequest.turn_id == turn_id)
        )
        .order_by(RestartRequest.requested_at)
        .first()
    )
    return row


def _told(
    session_id: str,
    row: RestartRequest,
    settlement: rules.Settlement,
    seconds: float,
    version: str,
    config: str,
) -> list[AppendRequest]:
    """What the session is told of a settlement: a `notice` for the user, and the
    `restart_result` its next turn reads."""
    text = rules.notice_text(
        settlement.outcome,
        seconds,
        settlement.detail,
        row.version_before,
        version,
        row.config_before,
        config,
    )
    result = {
        "restart": row.id,
        "outcome": settlement.outcome,
        "detail": settlement.detail,
        "seconds": seconds,
        "reason": row.reason,
        "version_before": row.version_before,
        "version_after": version,
        "config_before": row.config_before,
        "config_after": config,
    }
    notice = {"text": text, "restart": row.id, "outcome": settlement.outcome}
    return [
        make_request(session_id, EventType.NOTICE, notice, writer=Writer.SUPERVISOR),
        make_request(session_id, EventType.RESTART_RESULT, result, writer=Writer.SUPERVISOR),
    ]
