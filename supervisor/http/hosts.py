"""The daemons on this database as an operator sees them: `/v1/status`, `/metrics` and
`turnkeeper hosts` all show these rows, read in one go from the host registry.

A host is `live` (renewing its row), `left` (stopped cleanly: its leases were let go) or
`lost` (stopped renewing: the others adopt its sessions once their leases run out).
`sessions` counts the live leases its workers hold; every time is the database's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.store import Host, Store

STATES = ("live", "left", "lost")


def row(host: Host, sessions: int) -> dict[str, Any]:
    """One host as /v1/status and `turnkeeper hosts --json` give it."""
    return {
        "id": host.host_id,
        "hostname": host.hostname,
        "state": host.state,
        "last_seen": host.last_seen,
        "seen_ago": round(max(0.0, host.now - host.last_seen), 3),
        "sessions": sessions,
        "pid": host.pid,
        "version": host.version,
        "boot": host.boot_id,
    }


def read(store: Store) -> list[dict[str, Any]]:
    """Every registered host, by id, with the sessions it holds a live lease on."""
    hosts = store.hosts.all()
    owned = store.hosts.owned()
    return [row(h, owned.get(h.host_id, 0)) for h in hosts]


def seen(store: Store, host_id: str) -> dict[str, Any]:
    """The hosts part of /v1/status: this daemon's id and every host on the database.

    A failed read does not fail the status: `hosts` is then empty and `hosts_error` says
    why (the rest of the status is still worth having while the database struggles).
    """
    try:
        rows, error = read(store), None
    except Exception as exc:
        rows, error = [], f"the host registry could not be read: {exc}".splitlines()[0][:300]
    return {"host": {"id": host_id}, "hosts": rows, "hosts_error": error}
