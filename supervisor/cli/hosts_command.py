"""`turnkeeper hosts`: the daemons sharing this database, read from it directly (so it
works while this machine's daemon is down); and the hosts part of `turnkeeper status`."""

from __future__ import annotations

import re
from typing import Any

import click

from supervisor.cli.common import colour, json_option, table
from supervisor.cli.store_commands import duration, paint

STATE_COLOURS = {"live": "green", "lost": "red"}
HEADERS = ["ID", "HOSTNAME", "STATE", "SEEN", "SESSIONS", "PID", "VERSION"]
MACHINE_ID = re.compile(r"[0-9a-f]{32}")


def register(group: click.Group) -> None:
    """Add `hosts` to `group`."""
    group.add_command(hosts)


@click.command("hosts")
@json_option
@click.pass_context
def hosts(ctx: click.Context, as_json: bool) -> None:
    """List the daemons that share this database, by daemon.host_id.

    \b
    STATE is
      live  it renews its row on the database, so its leases are its own;
      left  it stopped cleanly and let its sessions go: the live ones took them;
      lost  it stopped renewing (killed, hung, paused or cut off): once its
            leases run out (lease.stale_after) the live daemons adopt its
            sessions; if it comes back, it is fenced and drops them.
    SEEN is how long ago it last renewed, SESSIONS how many sessions its
    workers hold a live lease on, both by the database's clock. This
    machine's host is marked *.
    """
    from supervisor.cli.common import emit_json, load, open_store
    from supervisor.contract.config import resolved_host_id
    from supervisor.http.hosts import read

    me = resolved_host_id(load(ctx))
    with open_store(ctx, migrate=False) as store:
        rows = read(store)
    if as_json:
        emit_json({"host": {"id": me}, "hosts": rows})
    elif not rows:
        click.echo("no hosts registered (a daemon registers itself when it starts)")
    else:
        click.echo("\n".join(hosts_table(rows, me)))
        if any(h["id"] == me for h in rows):
            click.echo("* this machine's daemon.host_id")


def hosts_table(rows: list[dict[str, Any]], me: str) -> list[str]:
    """One line a host, coloured by state on a terminal; fits 80 columns for machine ids
    (shortened to 12 characters, as `boots` shortens boot ids) and short hostnames."""
    cells = [
        [
            _short(h["id"]) + ("*" if h["id"] == me else ""),
            h["hostname"].split(".", 1)[0][:20],
            h["state"],
            f"{duration(h['seen_ago'])} ago",
            str(h["sessions"]),
            str(h["pid"]),
            h["version"],
        ]
        for h in rows
    ]
    text = paint(table(HEADERS, cells), "STATE", lambda s: STATE_COLOURS.get(s))
    return text.split("\n")


def _short(host_id: str) -> str:
    return host_id[:12] if MACHINE_ID.fullmatch(host_id) else host_id


def status_lines(data: dict[str, Any]) -> list[str]:
    """The hosts part of `turnkeeper status`: this daemon's host id, then every host on
    the database when there are several, and why they could not be read if they could not.
    """
    me = (data.get("host") or {}).get("id")
    if not me:
        return []  # a daemon that does not say (older, or not wired)
    rows: list[dict[str, Any]] = data.get("hosts") or []
    lines = [f"host {me}"]
    if data.get("hosts_error"):
        lines.append(colour(f"hosts: {data['hosts_error']}", "yellow"))
    if len(rows) > 1:
        states = [h["state"] for h in rows]
        lines.append(
            f"hosts {states.count('live')} live, {states.count('lost')} lost, "
            f"{states.count('left')} left"
        )
        lines += hosts_table(rows, me)
    return lines
