"""Which daemon adopts a session another host's lease no longer holds: pure code.

When a host dies its sessions' leases run out one by one. Every other daemon sees them at
about the same time; rendezvous hashing over the live hosts (the lost owner left out)
picks one adopter per session, so a lost host's sessions spread evenly over the others
without any talk between them. The daemon the hash picks takes the session at once; any
other one after `ADOPT_GRACE`, in case the one picked is gone too. Correctness does not
rest on this: the grant is a compare-and-set on the lease token, so of several daemons
that go for one session exactly one gets it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

# Seconds after another host's lease ran out before a daemon the hash did not pick adopts
# the session too.
ADOPT_GRACE = 1.0


class Leased(Protocol):
    """What adoption reads of a session row (`engine.SessionView` has it)."""

    @property
    def id(self) -> str: ...
    @property
    def owner(self) -> str | None: ...  # "<host>/<boot>/<worker>"
    @property
    def lease_expires_at(self) -> float | None: ...  # database time


def adopts(
    session: Leased,
    host: str,
    live_hosts: Iterable[str],
    now: float,
    grace: float = ADOPT_GRACE,
) -> bool:
    """Whether `host` adopts the session (its lease ran out) at database time `now`."""
    lost = (session.owner or "").split("/", 1)[0]
    hosts = {h for h in live_hosts if h != lost} | {host}
    picked = max(sorted(hosts), key=lambda h: _weight(h, session.id))
    expired = session.lease_expires_at if session.lease_expires_at is not None else now
    return picked == host or now >= expired + grace


def next_adoption(
    sessions: Iterable[Leased],
    host: str,
    live_hosts: Iterable[str],
    now: float,
    grace: float = ADOPT_GRACE,
) -> float | None:
    """The database time of the next adoption `host` may make: when the first live lease
    of another host's session runs out (for a session the hash gives another host,
    `grace` later). None if there is none to watch."""
    live = tuple(live_hosts)
    due: float | None = None
    for s in sessions:
        if not s.owner or s.owner.startswith(host + "/"):
            continue
        if s.lease_expires_at is None or s.lease_expires_at < now:
            continue
        at = s.lease_expires_at
        if not adopts(s, host, live, at, grace):
            at += grace
        due = at if due is None else min(due, at)
    return due


def _weight(host: str, session_id: str) -> bytes:
    return hashlib.blake2b(f"{host}\0{session_id}".encode(), digest_size=8).digest()
