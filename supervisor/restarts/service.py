"""Requested restarts (docs/how-to/restart.md): admitted as a row, begun when due,
carried out by a re-exec in place, settled once by the next boot.

- Admitted: an operator's `POST /v1/restart` through `Restarter.request`, an agent's turn
  through its worker (`workers.restarting`); either way a `restart_request` row is committed
  before anything stops, at most one live per host (`supervisor.store.restarts`).
- Begun: at once for an operator; for an agent, once the turn that asked has ended (at most
  `restart.turn_wait` later). The configuration on disk is loaded first: one that would not
  start is refused, and the request settled `failed` at once, the session told. Otherwise
  the daemon stops as for SIGTERM (intake refuses, the drain, the teardown, the boot row
  ended clean), then `reexec` replaces the process with a new start of the same command:
  the same pid, so neither systemd nor supervisord sees an exit.
- Settled: each boot first settles its host's earlier requests (`settle_earlier`): the
  outcome, a `notice` and a `restart_result` for the session that asked (whose next turn
  reads it), in one transaction. A crash before that leaves it to the next boot; a second
  settlement writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any

from supervisor import __version__
from supervisor.contract import fdlimit
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config, ConfigError, resolve_paths, resolved_host_id
from supervisor.contract.errors import PluginError
from supervisor.contract.logs import log
from supervisor.core.vocabulary import EventType, RestartState
from supervisor.notify import Notifier
from supervisor.restarts.rules import RestartRefused, clean_reason, wait_left
from supervisor.runtime.bus import Bus, Published
from supervisor.runtime.loops import MAX_REST, Wake, reconcile
from supervisor.runtime.service import Service
from supervisor.store import Admitted, RestartInfo, SessionNotFound, Settled, Store

POLL = 5.0  # a request a worker committed but could not announce is found this soon
# Read for every committed event (`heard`): module names, not enum member lookups.
_REQUESTED, _ENDED = EventType.RESTART_REQUESTED, EventType.TURN_ENDED
FRESH_CHECK = 2.0  # seconds a check made at admission stands for the restart's begin

Load = Callable[[], Config]


class Restarter(Service):
    """This daemon's restart requests: the API's desk, and the loop that begins them."""

    name = "restarter"
    needs = ("store", "pool", "reloader")
    takes = ("restart",)

    def __init__(
        self,
        store: Store,
        *,
        host: str,
        boot_id: str,
        config: Callable[[], Config],
        load: Load,
        version: Callable[[], str],
        begin: Callable[[RestartInfo], None],
        committed: Callable[[str, int, str], None],
        stopping: Callable[[], bool],
        hold: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        bus: Bus | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.store = store
        self.host = host
        self.boot_id = boot_id
        self._config = config  # the configuration in force (a reload may replace it)
        self._load = load  # the configuration on disk, checked as a start checks it
        self._version = version  # the version of the configuration in force
        self._begin = begin  # the daemon's stop for a restart
        self._committed = committed  # the pool: an event was committed (wakes input)
        self._stopping = stopping  # the daemon is stopping (for SIGTERM, or this restart)
        self._hold = hold  # the pool reaps no orphan meanwhile: the check's child is ours
        self.begun: RestartInfo | None = None
        self._waiting: str | None = None  # the session whose turn the pending request waits on
        self._waiting_for: str | None = None  # the request that said so in the log
        self._checked: tuple[str, float] = ("", 0.0)  # the request checked at admission
        self._due = Wake()
        self.clock = clock
        self.log = log("restart")
        if bus is not None:
            bus.subscribe(Published, self._published)

    # --- the API's desk -------------------------------------------------------------

    async def request(self, *, by: str, reason: str, drain: float | None) -> Admitted:
        """An operator's request: the one in progress, or a new one if the configuration on
        disk loads. Raises RateLimited or RestartRefused."""
        live = await asyncio.to_thread(self.store.restarts.active, self.host)
        if live is None and self._stopping():
            raise RestartRefused("the daemon is stopping; start it again instead")
        if live is None:
            await self._loadable()
        admitted: Admitted = await asyncio.to_thread(
            self.store.restarts.request,
            host=self.host,
            boot=self.boot_id,
            pid=os.getpid(),
            by=by,
            reason=clean_reason(reason),
            drain=drain,
            version=__version__,
            config=self._version(),
            min_interval=self._config().restart.min_interval,
        )
        if admitted.new:
            self._checked = (admitted.info.id, self.clock.monotonic())
            self.log.info(
                "restart {} requested by {}: {}",
                admitted.info.id,
                by,
                admitted.info.reason or "no reason given",
            )
            self._due.wake()
        return admitted

    async def _loadable(self) -> Config:
        """The configuration the next start would run with; RestartRefused if it would not
        start, or would start as another daemon (whose requests this one's are not)."""
        try:
            with self._hold():
                config = await asyncio.to_thread(self._load)
        except (ConfigError, PluginError) as exc:
            raise RestartRefused(
                f"the configuration does not load, so the daemon would not come back: {exc}"
            ) from None
        moved = moved_keys(self._config(), config)
        if moved:
            raise RestartRefused(
                f"{' and '.join(moved)} changed: the next start would be another daemon, which "
                "would never settle this request; restart through the service manager instead"
            )
        return config

    # --- what the pool hears --------------------------------------------------------

    def _published(self, event: Published) -> None:
        self.heard(event.session, event.event)

    def heard(self, session_id: str, event: dict[str, Any]) -> None:
        """An event was committed: a request, or the end of the turn a request waits for
        (no other turn's end costs a look)."""
        kind = event.get("type")
        if kind == _REQUESTED or (kind == _ENDED and session_id == self._waiting):
            self._due.wake()

    # --- the loop -------------------------------------------------------------------

    async def start(self) -> None:
        """The requests an earlier boot of this host left: settled."""
        await asyncio.to_thread(
            settle_earlier, self.store, self.host, self.boot_id, self._version()
        )

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """Begin this host's pending request when it is due; then only wait for the stop.
        A look that fails (a database gone for a while) is tried again after POLL."""
        return {
            "restarts": reconcile(
                "restarts",
                self._pass,
                interval=lambda: POLL,
                wake=self._due,
                clock=self.clock,
                retry=POLL,
            )
        }

    async def _pass(self) -> float:
        if self.begun is not None:
            return MAX_REST  # begun: the stop cancels the loop
        return await self._look()

    async def _look(self) -> float:
        """Begin the live request if it is due; the seconds until the next look."""
        self._waiting = None
        info = await asyncio.to_thread(self.store.restarts.active, self.host)
        if info is None or info.state != RestartState.PENDING or self._stopping():
            return POLL
        left = await asyncio.to_thread(self._left, info)
        if left > 0:
            if self._waiting_for != info.id:
                self._waiting_for = info.id
                self.log.info(
                    "restart {} waits up to {:.0f} s for the turn that asked ({}) to end",
                    info.id,
                    left,
                    info.turn_id,
                )
            self._waiting = info.session
            return min(POLL, left)
        await self._start(info)
        return POLL

    def _left(self, info: RestartInfo) -> float:
        """Seconds the request still waits for the turn that asked (the database clock)."""
        asking = False
        if info.session is not None and info.turn_id is not None:
            try:
                active = self.store.sessions.get(info.session).active_turn_id
            except SessionNotFound:
                active = None
            asking = active == info.turn_id
        turn_wait = self._config().restart.turn_wait
        return wait_left(info.requested_at, self.store.restarts.now(), turn_wait, asking)

    async def _start(self, info: RestartInfo) -> None:
        checked_id, checked_at = self._checked
        try:
            if checked_id != info.id or self.clock.monotonic() - checked_at > FRESH_CHECK:
                await self._loadable()  # an agent's request, or one that waited
        except RestartRefused as exc:
            self.log.error("restart {} refused: {}", info.id, exc)
            settled = await asyncio.to_thread(
                self.store.restarts.settle,
                info.id,
                boot=self.boot_id,
                version=__version__,
                config=self._version(),
                refused=str(exc),
            )
            self._announce(settled)
            return
        begun = await asyncio.to_thread(
            self.store.restarts.begin,
            info.id,
            boot=self.boot_id,
            version=__version__,
            config=self._version(),
        )
        if begun is not None:
            self.begun = begun
            self._begin(begun)

    def cancelled(self, boot_id: str, why: str) -> None:
        """The stop for the begun restart became a plain stop (SIGTERM during it): settle
        it `failed` now, while the database is open (blocking; from the stop's steps)."""
        if self.begun is None:
            return
        settled = self.store.restarts.settle(
            self.begun.id, boot=boot_id, version=__version__, config=self._version(), refused=why
        )
        if settled is not None:
            self.log.warning("restart {} did not happen: {}", self.begun.id, why)

    def _announce(self, settled: Settled | None) -> None:
        """Tell the pool of a settlement's events: the attach streams, the session's turn."""
        if settled is None or settled.info.session is None:
            return
        if settled.notice_seq is not None:
            self._committed(settled.info.session, settled.notice_seq, EventType.NOTICE)
        if settled.result_seq is not None:
            self._committed(settled.info.session, settled.result_seq, EventType.RESTART_RESULT)


def moved_keys(running: Config, loaded: Config) -> list[str]:
    """The keys that would make the next start another daemon on another database: a
    request settled by it would never reach this one's row."""
    moved = []
    if resolved_host_id(running) != resolved_host_id(loaded):
        moved.append("daemon.host_id")
    if resolve_paths(running).db_url != resolve_paths(loaded).db_url:
        moved.append("store.url")
    return moved


def settle_earlier(store: Store, host: str, boot_id: str, config_version: str) -> list[Settled]:
    """At a boot, before the pool starts: settle the host's requests of earlier boots
    (blocking). Their sessions are pending from then on: the first dispatch runs them."""
    settled = []
    say = log("restart")
    for info in store.restarts.unsettled(host):
        if info.boot == boot_id:
            continue
        done = store.restarts.settle(
            info.id, boot=boot_id, version=__version__, config=config_version
        )
        if done is None:
            continue  # settled meanwhile (another daemon of this host id, before it was fenced)
        settled.append(done)
        say.log(
            "INFO" if done.info.outcome == "ok" else "WARNING",
            "restart {} settled {} after {:.1f} s: {}",
            info.id,
            done.info.outcome,
            done.info.seconds or 0.0,
            done.info.detail or "the daemon came back",
        )
    return settled


def reexec(notifier: Notifier) -> None:
    """Replace this process with a new start of the same command (the same pid).

    Returns only if the exec failed; the caller then exits non-zero, and the service
    manager starts the daemon again as after any exit.
    """
    env = {**os.environ, **notifier.environ()}
    argv = list(sys.orig_argv)
    log("restart").info("re-executing in place: {}", " ".join(argv))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.closerange(3, _max_fd())  # nothing of this boot leaks into the next
    fdlimit.give_back()  # the new start raises the soft limit from where the first did
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        log("restart").critical("could not re-execute {}: {}", sys.executable, exc)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 65536
