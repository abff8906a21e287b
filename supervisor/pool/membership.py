"""This daemon among the others on the database: its host row, held, renewed, left.

At start the daemon takes its `daemon.host_id` (`join`); a live daemon holding the id
already makes it refuse to start, naming that one, unless that one is a process of this
machine that is gone (a crash a moment ago: a restart must not wait for the row to run
out). While it runs, `run` renews the row every `RENEW` seconds and reads every host's,
so the pool knows which daemons are alive (adoption is spread over them) and learns at
once when one is lost. A renewal that finds the row held by another boot means this host
was taken over while it was away: it stops (exit non-zero), as a second daemon with its
id must not write beside the first. At a clean stop, `leave` says goodbye and lets this
boot's leases run out, so the others adopt its interrupted turns without waiting.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from supervisor import __version__
from supervisor.contract import reaper
from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.contract.paths import machine_id
from supervisor.pool.counting import Counts
from supervisor.runtime.bus import Bus, HostsLost, Stopping
from supervisor.runtime.loops import QUIET, Wake, reconcile
from supervisor.runtime.service import Service, Steps
from supervisor.store import Host, HostTaken, Me, SingleHost, Store
from supervisor.teardown import BOOT_ROW, PEER_DEREGISTRATION

RENEW = 1.0  # seconds between renewals of the host row (its time to live: lease.stale_after)
FORGET_AFTER = 86400.0  # a host gone this long leaves the list (as boot rows do)


class Fenced(Exception):
    """Another boot holds this daemon's host id now: this one must stop."""


class Membership(Service):
    """This daemon's host row and its view of the others; as a service, also its boot row:
    both taken first at the start (the host id before the boot row: a daemon that may not
    run writes no boot row of that host) and given back last at the stop."""

    name = "host"
    needs = ("store",)

    def __init__(
        self,
        config: Config,
        store: Store,
        boot_id: str,
        host_id: str,
        *,
        bus: Bus | None = None,
        metrics: Counts | None = None,
        ending: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.bus = bus if bus is not None else Bus()
        self.metrics = metrics
        self.ending = ending  # blocking: ends the boot row with the stop's outcome
        self.ttl = config.lease.stale_after
        self.host_id = host_id
        self.boot_id = boot_id
        pid = os.getpid()
        self.me = Me(
            host_id=host_id,
            boot_id=boot_id,
            hostname=socket.gethostname(),
            machine=machine_id(),
            pid=pid,
            pid_started=psutil.Process(pid).create_time(),
            version=__version__,
        )
        self.live: tuple[str, ...] = (host_id,)  # the live hosts' ids, this one included
        self._lost_before: set[str] | None = None  # None: not read yet (lost long ago: no news)
        self.adopting = True  # False once this daemon stops: it takes no other host's session
        self.bus.subscribe(Stopping, self._stopping)
        # A thread of its own: the renewal never waits behind the pool's database work.
        self._renewer = ThreadPoolExecutor(1, "turnkeeper-hosts")
        self.log = log("hosts")

    # --- the service ----------------------------------------------------------------

    async def start(self) -> None:
        """The host id (HostTaken, SingleHost: exit 78), the boot row, the previous stop's
        step durations as gauges, and the processes earlier boots left running swept."""
        await asyncio.to_thread(self.join)
        await asyncio.to_thread(
            self.store.boots.begin, self.host_id, os.getpid(), __version__, self.boot_id
        )
        if self.metrics is not None:
            await asyncio.to_thread(previous_stop, self.store, self.boot_id, self.metrics)
        await asyncio.to_thread(self.sweep)

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"hosts": self.run()}

    def _stopping(self, _: Stopping) -> None:
        self.adopting = False  # another host's sessions are for the others

    async def stop(self, steps: Steps) -> None:
        """After the descendants stop: the hosts' table left (the others adopt this boot's
        sessions at once), then the boot row ended."""
        await steps.run(
            "peer deregistration", PEER_DEREGISTRATION, lambda: asyncio.to_thread(self.leave)
        )
        if self.ending is not None:
            await steps.run("boot row", BOOT_ROW, lambda: asyncio.to_thread(self.ending))  # type: ignore[arg-type]

    # --- the host row ------------------------------------------------------------------

    def join(self) -> None:
        """Take the host id (blocking: run in a thread). HostTaken if a live daemon has it.

        A holder whose process is gone from this machine but whose row was renewed within
        `2 * RENEW` is waited for that long and looked at again: a daemon on a clone of
        this machine (the same machine id and hostname) renews it meanwhile and is refused,
        where a crash here a moment ago is not.
        """
        single = self.store.backend == "sqlite"
        try:
            before = self.store.hosts.register(self.me, self.ttl, self._gone, single=single)
        except (HostTaken, SingleHost) as exc:
            if not self._here_and_dead(exc.holder):
                raise
            SYSTEM.sleep_blocking(
                max(0.0, 2 * RENEW - (exc.holder.now - exc.holder.last_seen)) + 0.1
            )
            before = self.store.hosts.register(self.me, self.ttl, self._gone, single=single)
        if before is not None and before.live:
            self.log.warning(
                "took over host id {} from pid {} (boot {}), which is no longer running",
                self.host_id,
                before.pid,
                before.boot_id[:8],
            )
        self.log.info("host id {} (lease.stale_after {:.0f} s)", self.host_id, self.ttl)
        forgotten = self.store.hosts.prune(FORGET_AFTER)
        if forgotten:
            self.log.info("forgot {} hosts gone for more than 24 h", forgotten)

    def _gone(self, holder: Host) -> bool:
        """Whether the live holder of our id is a process of this machine that is gone, and
        has not renewed its row for `2 * RENEW` (so it is no clone of this machine)."""
        return self._here_and_dead(holder) and holder.now - holder.last_seen >= 2 * RENEW

    def _here_and_dead(self, holder: Host) -> bool:
        """Whether the holder's process was one of this machine's and is gone."""
        same_machine = holder.machine == self.me.machine if self.me.machine else True
        if not same_machine or holder.hostname != self.me.hostname:
            return False
        try:
            return abs(psutil.Process(holder.pid).create_time() - holder.pid_started) > 0.01
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False

    async def run(self) -> None:
        """Renew the row and read the others', every `RENEW` s, until cancelled; a renewal
        that finds the row another boot's raises Fenced (the daemon stops)."""
        self._lost_before = None
        await reconcile(
            "hosts",
            self._renew,
            interval=lambda: RENEW,
            wake=Wake(),
            clock=SYSTEM,
            observer=self.metrics if self.metrics is not None else QUIET,
            fatal=(Fenced,),
        )

    async def _renew(self) -> float:
        loop = asyncio.get_running_loop()
        overdue = await loop.run_in_executor(
            self._renewer, self.store.hosts.renew, self.host_id, self.boot_id, self.ttl
        )
        hosts = await loop.run_in_executor(self._renewer, self.store.hosts.all)
        if overdue is None:
            raise Fenced(
                f"host id {self.host_id} is held by another boot now (this daemon was "
                "paused or cut off from the database past lease.stale_after, and another "
                "daemon started with its id): stopping"
            )
        if overdue > 0:
            self.log.warning(
                "this host was away {:.1f} s past its lease.stale_after (paused, or cut "
                "off from the database): sessions the others adopted meanwhile are "
                "dropped; their leases fence out whatever this host still had in flight",
                overdue,
            )
        self.live = tuple(h.host_id for h in hosts if h.live) or (self.host_id,)
        lost = {h.host_id for h in hosts if not h.live and h.host_id != self.host_id}
        if self._lost_before is not None and lost - self._lost_before:
            for host in sorted(lost - self._lost_before):
                row = next(h for h in hosts if h.host_id == host)
                self.log.warning(
                    "host {} {} ({:.1f} s since it was last seen): its sessions are "
                    "adopted as their leases run out",
                    host,
                    "left" if row.state == "left" else "stopped renewing",
                    row.now - row.last_seen,
                )
            self.bus.publish(HostsLost(tuple(sorted(lost - self._lost_before))))
        self._lost_before = lost
        return RENEW

    def sweep(self) -> None:
        """Kill processes an earlier boot of this host left running, unless their pid was
        reused (blocking). SQLite serves one host; on a server database only this host's
        rows are its business: another host's pids name another machine's processes.

        Left alone: the task runners (and their commands) that a restart in place left
        running, still this very process's descendants; the task keeper adopts them."""
        host = None if self.store.backend == "sqlite" else self.host_id
        children = self.store.children
        rows = children.of_other_boots(self.boot_id, host, (self.me.hostname,))
        adopted = reaper.own_tasks([(r.pid, r.create_time) for r in rows if r.kind == "task"])
        rows = [r for r in rows if r.pid not in adopted]
        if adopted:
            log("recovery").info(
                "{} processes of task runners a restart in place left running: adopted",
                len(adopted),
            )
        if not rows:
            return
        report = reaper.sweep([(r.pid, r.create_time) for r in rows])
        children.forget([r.id for r in rows])
        log("recovery").info(
            "swept {} processes of earlier boots: {} killed, {} gone, {} pid reused",
            len(rows),
            len(report.killed),
            len(report.gone),
            len(report.reused),
        )

    def leave(self) -> None:
        """A clean stop (blocking): the row says so, this boot's leases run out now."""
        prefix = f"{self.host_id}/{self.boot_id[:8]}"
        self._renewer.shutdown(wait=False)
        expired = self.store.hosts.leave(self.host_id, self.boot_id, prefix)
        self.log.info("left the database's hosts; {} leases handed back", expired)


def previous_stop(store: Store, boot_id: str, metrics: Counts) -> None:
    """The previous boot's stop step durations, as gauges."""
    for boot in store.boots.recent(2):
        if boot.boot_id != boot_id and boot.breaker:
            for step, seconds in (boot.breaker.get("shutdown_steps") or {}).items():
                metrics.shutdown_steps.labels(step).set(float(seconds))
            return
