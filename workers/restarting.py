"""Restart requests from inside a turn: the `request_restart` tool and `turn.request_restart`.

Only where the operator allows it (`restart.agent_may_request`), and only for the sessions
of the principals the operator lists (`restart.agent_principals`: the session's creator,
or its tree's for a subagent; the admin alone by default). A request is one
transaction of the store (`supervisor.store.restarts`): the restart's row and the
session's `restart_requested`, written with the turn's lease token before anything
stops, so a turn fenced out asks for nothing. The supervisor restarts once the turn
ends (or `restart.turn_wait` has passed) and, once it is back, tells the session the
outcome (`restart_result`, which the session's next turn reads).

Answered, in words the model can act on: refused (an error result of the tool, or
`RestartRefused` from `turn.request_restart`) while agents may not ask, within
`restart.min_interval` of the last request (with the seconds to wait), or for a reason
that is not a string; a restart already in progress, whoever asked, is the answer to a
request meanwhile: no second one is made. A tool call that asked before a crash asks
again for nothing when its turn is continued and the call is made again: the call id is
kept with the request.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import supervisor
from supervisor.contract.config import Config, config_version
from supervisor.contract.spawn import WorkerSpec
from supervisor.core.vocabulary import EventType, RestartState
from supervisor.restarts.rules import clean_reason
from supervisor.store import Store
from supervisor.store.restarts import Admitted, RateLimited, RestartInfo
from workers.desk import Notify, SessionDesk
from workers.models import ToolSpec
from workers.tools import ToolOutcome

__all__ = [
    "OFF",
    "SPEC",
    "TOOL",
    "Requester",
    "RestartRefused",
    "RestartScope",
    "repaired",
    "requested",
]

TOOL = "request_restart"
OFF = "agents may not ask for a restart here (restart.agent_may_request is false)"
BY = "agent"  # `requested_by` of every request a turn makes

SPEC = ToolSpec(
    TOOL,
    "Ask for a restart of the daemon that runs this conversation: it stops and starts "
    "again in place, with its code and configuration read anew. It restarts after this "
    "turn ends; do not wait for it: the outcome arrives here as a message once the daemon "
    "is back. Give the reason, which the operator reads. Refused within the operator's "
    "minimum interval of the last restart asked for.",
    {
        "type": "object",
        "properties": {
            "reason": {
                "type": "string",
                "description": "why the daemon should restart (at most 500 characters)",
            },
        },
        "required": ["reason"],
    },
)


class RestartRefused(Exception):
    """A restart may not be asked for now; the message says why (and when it may)."""


@dataclass(frozen=True)
class RestartScope:
    """The daemon a request asks to restart, as its worker knows it, and `[restart]`'s
    rules for agents. The default asks for nothing (agents may not)."""

    host: str = ""
    boot: str = ""
    pid: int = 0  # the supervisor's, not the worker's
    config: str = ""  # `config_version` of the configuration it runs
    enabled: bool = False
    min_interval: float = 60.0
    principals: tuple[str, ...] = ("admin",)  # whose sessions may ask

    @classmethod
    def of(cls, spec: WorkerSpec, config: Config) -> RestartScope:
        """The worker's daemon: its host, boot and pid, and the configuration it runs."""
        return cls(
            host=spec.host_id,
            boot=spec.boot_id,
            pid=spec.parent_pid,
            config=config_version(config),
            enabled=config.restart.agent_may_request,
            min_interval=config.restart.min_interval,
            principals=tuple(config.restart.agent_principals),
        )


class Requester(SessionDesk):
    """Asks for restarts for one session's turns, with the lease token they write with."""

    def __init__(
        self,
        session_id: str,
        store: Store,
        token: Callable[[], int],
        notify: Notify,
        daemon: RestartScope,
    ) -> None:
        super().__init__(session_id, store, token, notify)
        self.daemon = daemon
        self.spec = SPEC

    @property
    def enabled(self) -> bool:
        """Agents may ask for a restart: the tool is offered."""
        return self.daemon.enabled

    async def request(self, reason: Any, turn_id: str, *, call_id: str | None) -> RestartInfo:
        """Ask for a restart; the request's row: the new one, the one this call made
        before, or the one in progress. RestartRefused saying why it may not be asked for."""
        return (await self._admit(reason, turn_id, call_id)).info

    async def request_once(self, reason: str, turn_id: str, number: int) -> str:
        """`turn.request_restart`: the `number`-th request with this reason in a run of the
        turn; the request's id. A continued turn runs its agent from the top: the same
        requests, in the same order, get the rows they made before, not new ones."""
        digest = hashlib.sha256(str(reason).encode("utf-8", "replace")).hexdigest()[:16]
        info = await self.request(
            reason, turn_id, call_id=f"turn.request_restart:{number}:{digest}"
        )
        return info.id

    async def call(self, arguments: dict[str, Any], turn_id: str, call_id: str) -> ToolOutcome:
        """The `request_restart` tool: an error result the model reads when refused."""
        try:
            admitted = await self._admit(arguments.get("reason"), turn_id, call_id)
        except RestartRefused as exc:
            return ToolOutcome(f"no restart requested: {exc}", is_error=True)
        info = admitted.info
        if admitted.new or admitted.seq is not None:  # this call's own request
            return ToolOutcome(requested(info.id, info.reason, info.state, info.outcome))
        return ToolOutcome(in_progress(info))

    async def _admit(self, reason: Any, turn_id: str, call_id: str | None) -> Admitted:
        if not self.enabled:
            raise RestartRefused(OFF)
        try:
            text = clean_reason(reason)
        except ValueError as exc:
            raise RestartRefused(f"{exc} (the tool's `reason`)") from exc
        daemon = self.daemon
        session = await asyncio.to_thread(self._store.sessions.get, self.session_id)
        if session.principal not in daemon.principals:
            raise RestartRefused(
                f"this session's principal ({session.principal or 'unknown'}) is not one "
                "whose agents may ask for a restart (restart.agent_principals)"
            )
        try:
            admitted: Admitted = await asyncio.to_thread(
                self._store.restarts.request,
                host=daemon.host,
                boot=daemon.boot,
                pid=daemon.pid,
                by=BY,
                reason=text,
                drain=None,
                version=supervisor.__version__,
                config=daemon.config,
                min_interval=daemon.min_interval,
                session=self.session_id,
                token=self._token(),
                turn_id=turn_id,
                call_id=call_id,
            )
        except RateLimited as exc:
            raise RestartRefused(str(exc)) from exc
        if admitted.new:
            # A signal only: the supervisor reads the row and restarts once the turn ends.
            await self._committed(self.session_id, admitted.seq, EventType.RESTART_REQUESTED)
        return admitted


def requested(
    restart: str, reason: str, state: str = RestartState.PENDING, outcome: str | None = None
) -> str:
    """The tool's result for a request it made (also what a repaired call says)."""
    if state == RestartState.DONE:
        return (
            f"restart {restart} (reason: {reason or '-'}) was requested by this call and is "
            f"over ({outcome}); its outcome arrives in this conversation as a message"
        )
    return (
        f"restart {restart} requested (reason: {reason or '-'}); the daemon restarts after "
        "this turn ends, and its outcome will arrive in this conversation as a message when "
        "it is back"
    )


def repaired(payload: dict[str, Any]) -> str:
    """What a `request_restart` call cut before its result did, from the
    `restart_requested` it committed: the request (see `workers.history`)."""
    return requested(str(payload.get("restart")), str(payload.get("reason") or ""))


def in_progress(info: RestartInfo) -> str:
    """The tool's result while another request is live: it is the answer, none is made."""
    return (
        f"no second restart requested: restart {info.id} is already in progress, asked for "
        f"by {info.requested_by} (reason: {info.reason or '-'}); the daemon restarts shortly"
    )
