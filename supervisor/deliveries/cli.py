"""`turnkeeper deliveries list|retry`: the delivery outbox, through the daemon's API
(`/v1/deliveries`), so a caller sees what its token may: the admin token every delivery,
another token those of a session it may read (`--session`). `retry --all --target T` is
one request (`POST /v1/deliveries/retry`), so the target's deliveries come back to life in
one transaction and go out in the order they were produced.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import connect, emit_json, json_option, reports_errors, table
from supervisor.cli.session_commands import clip
from supervisor.core.vocabulary import DeliveryStatus

if TYPE_CHECKING:
    from supervisor.cli.client import Client

HEADERS = ["ID", "TARGET", "SESSION", "SEQ", "TYPE", "STATUS", "ATTEMPTS", "LAST ERROR"]
ERROR_WIDTH = 20  # at least, however narrow the terminal
STATUS_COLOURS: dict[str, str] = {
    DeliveryStatus.PENDING: "yellow",
    DeliveryStatus.DELIVERED: "green",
    DeliveryStatus.DEAD: "red",
}


def register(group: click.Group) -> None:
    """Add `deliveries` to `group`."""
    group.add_command(deliveries)


# Through the client's plumbing, as `turnkeeper tasks` does: client.py is full.
def list_deliveries(client: Client, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The deliveries of `params` (status, session, limit), newest first, as the API gives them."""
    found: list[dict[str, Any]] = client._json("GET", "/v1/deliveries", params=params)["deliveries"]
    return found


def retry_delivery(client: Client, delivery_id: str) -> dict[str, Any]:
    """Send a delivery again; the API's answer (the delivery, pending)."""
    retried: dict[str, Any] = client._json("POST", f"/v1/deliveries/{delivery_id}/retry")
    return retried


@click.group("deliveries")
def deliveries() -> None:
    """Events pushed to delivery targets (webhooks), through the daemon.

    \b
    A session bound to a target (`deliver_to`, one of the operator's
    [[delivery.targets]]) has its events of the target's kinds POSTed there,
    signed, once each, in order. Each such event is a delivery. STATUS is
      pending    written with its event; sent, or sent again after a backoff
      delivered  the target answered 2xx
      dead       the target refused it (4xx but 408/429), or it was not
                 delivered within delivery.max_age of its event (or in
                 delivery.max_attempts attempts, if set); `retry` sends
                 it again
    Needs the running daemon (exit 3 without it).
    """


@deliveries.command("list")
@click.option(
    "--status",
    type=click.Choice([s.value for s in DeliveryStatus]),
    default=None,
    help="Only deliveries in this status (default: all).",
)
@click.option(
    "--session",
    "session_id",
    default=None,
    metavar="ID",
    help=(
        "Only this session's deliveries. Required unless the token is the admin's: "
        "another principal sees the deliveries of a session it may read."
    ),
)
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="At most this many, the newest.",
)
@json_option
@click.pass_context
@reports_errors
def list_command(
    ctx: click.Context, status: str | None, session_id: str | None, limit: int, as_json: bool
) -> None:
    """List deliveries, newest first.

    SEQ is the event's seq in its session, TYPE what it carries (answer: a
    turn's final answer; else the event type), ATTEMPTS the attempts made
    since it was written or retried, LAST ERROR what the last failed one met.
    """
    params: dict[str, Any] = {"limit": limit}
    if status is not None:
        params["status"] = status
    if session_id is not None:
        params["session"] = session_id
    with connect(ctx) as client:
        found = list_deliveries(client, params)
    if as_json:
        emit_json({"deliveries": found})
    elif not found:
        click.echo("no deliveries" if status is None else f"no {status} deliveries")
    else:
        click.echo("\n".join(delivery_table(found, shutil.get_terminal_size((80, 24)).columns)))


def retry_target(client: Client, target: str) -> dict[str, Any]:
    """Send every dead and pending delivery of `target` again; the API's answer (`target`,
    `revived`, `due`)."""
    retried: dict[str, Any] = client._json("POST", "/v1/deliveries/retry", json={"target": target})
    return retried


@deliveries.command("retry")
@click.argument("delivery_id", metavar="[ID]", required=False)
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Every dead and pending delivery of --target instead of one ID.",
)
@click.option("--target", default=None, metavar="NAME", help="The target of --all.")
@json_option
@click.pass_context
@reports_errors
def retry_command(
    ctx: click.Context, delivery_id: str | None, every: bool, target: str | None, as_json: bool
) -> None:
    """Send delivery ID, or every delivery of a target, again now (admin token).

    A dead delivery is pending again, its attempts counted from 0; a pending
    one is due at once. A delivered one is refused (exit 1): it is not sent
    twice. Its age still counts from its event: one older than
    delivery.max_age is tried once, and is dead again if that fails.

    \b
    With --all --target NAME, every dead and pending delivery of target NAME
    (but those being sent right now), at once: they go out in the order they
    were produced, each session's in seq order, the oldest first.
    """
    if every and target is not None and delivery_id is None:
        with connect(ctx) as client:
            done = retry_target(client, target)
        if as_json:
            emit_json(done)
        else:
            click.echo(
                f"target {done['target']}: {done['revived']} dead and {done['due']} pending "
                "deliveries sent again now, in the order they were produced"
            )
        return
    if delivery_id is None or every or target is not None:
        raise click.UsageError("give either ID, or --all --target NAME")
    with connect(ctx) as client:
        retried = retry_delivery(client, delivery_id)
    if as_json:
        emit_json(retried)
    else:
        click.echo(
            f"delivery {retried['id']} to {retried['target']}: {retried['status']}, "
            f"attempts {retried['attempts']}; it is sent now"
        )


def delivery_table(found: list[dict[str, Any]], columns: int) -> list[str]:
    """One row a delivery, coloured by status on a terminal; the last error fills what is
    left of `columns` (at least ERROR_WIDTH)."""
    from supervisor.cli.store_commands import paint

    rows = [
        [
            d["id"],
            d["target"],
            d["session"],
            str(d["seq"]),
            d["kind"],
            d["status"],
            str(d["attempts"]),
            "",
        ]
        for d in found
    ]
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS) - 1)]
    room = max(columns - sum(widths) - 2 * len(widths), ERROR_WIDTH)
    for row, d in zip(rows, found, strict=True):
        row[-1] = clip(" ".join(str(d["last_error"]).split()) or "-", room)
    return paint(table(HEADERS, rows), "STATUS", lambda s: STATUS_COLOURS.get(s)).split("\n")
