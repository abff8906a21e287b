"""`turnkeeper deliveries list|retry` against a real daemon: the table, the filters, the JSON,
the retry (of one delivery, and of a target's) and its refusals, each answered as the API
answers it.

The daemon is tests/deliveries/test_deliveries_api.py's: target `bridge` refuses every connection
and `delivery.max_attempts` is 1, so its delivery is dead after one attempt; target
`sink` answers 204, so its delivery is delivered.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.daemon import Daemon, daemons, turnkeeper, wait_until
from tests.deliveries.test_deliveries_api import (
    Sink,
    dead,
    deliveries,
    delivery_config,
    sink,
    start,
)
from tests.http.test_api import Api, create_session, free_port, inject

__all__ = ["daemons", "sink", "start"]  # the fixtures


def rows(output: str) -> list[list[str]]:
    """The table's lines, split on runs of spaces (the last column may hold spaces: it is
    the rest of the line)."""
    return [line.split(maxsplit=7) for line in output.strip().splitlines()]


def outbox(api: Api, sink: Sink) -> tuple[dict[str, Any], dict[str, Any]]:
    """A dead delivery (to bridge) and, newer, a delivered one (to sink), both alice's."""
    admin, alice = api.client("admin"), api.client("alice")
    refused = create_session(alice, deliver_to="bridge")
    inject(alice, refused, "hello")
    gone = dead(admin, refused)
    taken = create_session(alice, deliver_to="sink")
    inject(alice, taken, "hello")
    done: dict[str, Any] = wait_until(
        lambda: deliveries(admin, session=taken, status="delivered"), 30, "the sink's delivery"
    )[0]
    return gone, done


def test_list_shows_the_outbox_as_a_table_or_json(start: Callable[..., Api], sink: Sink) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    gone, done = outbox(api, sink)

    listed = turnkeeper(api.daemon, "deliveries", "list")
    assert listed.returncode == 0, listed.stderr
    header, *table = rows(listed.stdout)
    assert header == ["ID", "TARGET", "SESSION", "SEQ", "TYPE", "STATUS", "ATTEMPTS", "LAST ERROR"]
    assert [row[0] for row in table] == [done["id"], gone["id"]]  # newest first
    assert table[0][1:7] == ["sink", done["session"], str(done["seq"]), "answer", "delivered", "1"]
    assert table[0][7] == "-"
    assert table[1][1:7] == ["bridge", gone["session"], str(gone["seq"]), "answer", "dead", "1"]
    assert table[1][7] == " ".join(gone["last_error"].split())

    only_dead = turnkeeper(api.daemon, "deliveries", "list", "--status", "dead")
    assert [row[0] for row in rows(only_dead.stdout)[1:]] == [gone["id"]]
    of_session = turnkeeper(api.daemon, "deliveries", "list", "--session", done["session"])
    assert [row[0] for row in rows(of_session.stdout)[1:]] == [done["id"]]
    newest = turnkeeper(api.daemon, "deliveries", "list", "--limit", "1")
    assert [row[0] for row in rows(newest.stdout)[1:]] == [done["id"]]
    none = turnkeeper(api.daemon, "deliveries", "list", "--status", "pending")
    assert none.returncode == 0 and none.stdout.strip() == "no pending deliveries"

    as_json = turnkeeper(api.daemon, "deliveries", "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"deliveries": deliveries(api.client("admin"))}

    bad = turnkeeper(api.daemon, "deliveries", "list", "--status", "lost")
    assert bad.returncode == 2 and "--status" in bad.stderr


def test_a_principal_that_is_not_admin_lists_the_deliveries_of_its_sessions(
    start: Callable[..., Api], sink: Sink
) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    gone, _ = outbox(api, sink)
    alice = {"TURNKEEPER_TOKEN": api.tokens["alice"]}
    bob = {"TURNKEEPER_TOKEN": api.tokens["bob"]}

    every = turnkeeper(api.daemon, "deliveries", "list", **alice)
    assert every.returncode == 1 and every.stdout == ""
    assert "only the admin principal may list every delivery" in every.stderr
    assert "(HTTP 403)" in every.stderr and len(every.stderr.strip().splitlines()) == 1
    mine = turnkeeper(api.daemon, "deliveries", "list", "--session", gone["session"], **alice)
    assert mine.returncode == 0, mine.stderr
    assert [row[0] for row in rows(mine.stdout)[1:]] == [gone["id"]]
    theirs = turnkeeper(api.daemon, "deliveries", "list", "--session", gone["session"], **bob)
    assert theirs.returncode == 1 and "(HTTP 404)" in theirs.stderr


def test_retry_sends_a_dead_delivery_again_and_refuses_what_it_cannot(
    start: Callable[..., Api], sink: Sink
) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    gone, done = outbox(api, sink)

    twice = turnkeeper(api.daemon, "deliveries", "retry", done["id"])
    assert twice.returncode == 1 and twice.stdout == ""
    assert "already delivered" in twice.stderr and "(HTTP 409)" in twice.stderr
    unknown = "d" + "0" * 32
    missing = turnkeeper(api.daemon, "deliveries", "retry", unknown)
    assert missing.returncode == 1 and f"no delivery '{unknown}'" in missing.stderr
    assert "(HTTP 404)" in missing.stderr
    not_admin = turnkeeper(
        api.daemon, "deliveries", "retry", gone["id"], TURNKEEPER_TOKEN=api.tokens["alice"]
    )
    assert not_admin.returncode == 1 and "(HTTP 403)" in not_admin.stderr

    retried = turnkeeper(api.daemon, "deliveries", "retry", gone["id"])
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.strip() == (
        f"delivery {gone['id']} to bridge: pending, attempts 0; it is sent now"
    )
    again = dead(api.client("admin"), gone["session"])  # sent, and failed, once more
    assert again["attempts"] == 1 and again["updated_at"] > gone["updated_at"]

    as_json = turnkeeper(api.daemon, "deliveries", "retry", gone["id"], "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["status"] == "pending"
    assert json.loads(as_json.stdout)["attempts"] == 0


def test_retry_all_sends_a_target_s_deliveries_again(start: Callable[..., Api], sink: Sink) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    gone, _ = outbox(api, sink)
    for wrong in ([], ["--all"], ["--target", "bridge"], [gone["id"], "--all", "--target", "x"]):
        usage = turnkeeper(api.daemon, "deliveries", "retry", *wrong)
        assert usage.returncode == 2 and "ID" in usage.stderr, (wrong, usage.stderr)

    retried = turnkeeper(api.daemon, "deliveries", "retry", "--all", "--target", "bridge")
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.strip() == (
        "target bridge: 1 dead and 0 pending deliveries sent again now, "
        "in the order they were produced"
    )
    again = dead(api.client("admin"), gone["session"])  # sent, and failed, once more
    assert again["attempts"] == 1 and again["updated_at"] > gone["updated_at"]
    as_json = turnkeeper(api.daemon, "deliveries", "retry", "--all", "--target", "bridge", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"target": "bridge", "revived": 1, "due": 0}

    unknown = turnkeeper(api.daemon, "deliveries", "retry", "--all", "--target", "nowhere")
    assert unknown.returncode == 1 and "(HTTP 409)" in unknown.stderr
    assert "'nowhere' is not configured" in unknown.stderr
    alice = {"TURNKEEPER_TOKEN": api.tokens["alice"]}
    not_admin = turnkeeper(
        api.daemon, "deliveries", "retry", "--all", "--target", "bridge", **alice
    )
    assert not_admin.returncode == 1 and "(HTTP 403)" in not_admin.stderr
    assert sink.hits == 1  # the delivered one was not sent again


def test_without_a_daemon_the_commands_exit_3(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons(delivery=delivery_config(free_port()))  # configured, never started
    for args in (("list",), ("retry", "d" + "0" * 32)):
        answer = turnkeeper(daemon, "deliveries", *args, TURNKEEPER_TOKEN="t")
        assert answer.returncode == 3, answer.stderr
        assert len(answer.stderr.strip().splitlines()) == 1


def test_new_deliver_to_binds_the_session_and_an_unknown_target_is_refused(
    start: Callable[..., Api], sink: Sink
) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    made = turnkeeper(api.daemon, "new", "--deliver-to", "sink", "--json")
    assert made.returncode == 0, made.stderr
    session = json.loads(made.stdout)
    assert session["deliver_to"] == "sink"
    inject(api.client("admin"), session["id"], "hello")
    wait_until(
        lambda: deliveries(api.client("admin"), session=session["id"], status="delivered"),
        30,
        "the bound session's answer delivered",
    )
    unknown = turnkeeper(api.daemon, "new", "--deliver-to", "nowhere")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert "deliver_to" in unknown.stderr and "nowhere" in unknown.stderr
