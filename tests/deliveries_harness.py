"""The harness of tests/deliveries/test_deliveries_daemon.py: a daemon with delivery targets that
point at real receivers on loopback (`tests.deliveries_receiver`), and what the tests read
back from the database, the API, the CLI and /metrics."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from supervisor.store import DeliveryInfo, EventRecord, Store
from tests.daemon import Daemon, events
from tests.deliveries_receiver import Receiver

Daemons = Callable[..., Daemon]
Receivers = Callable[[str], Receiver]

FAST = {"backoff": 0.2, "backoff_cap": 1.0, "poll_interval": 0.2}
# A target's timeout; a claim lasts longer (timeout + courier.CLAIM_MARGIN).
CLAIMED = 40.0


def secret_of(target: str) -> str:
    return f"secret-of-{target}"


def env_of(target: str) -> str:
    return f"TK_TEST_DELIVERY_SECRET_{target.upper()}"


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    """Make receivers, each verifying with its target's secret; all closed at the end."""
    made: list[Receiver] = []

    def make(target: str) -> Receiver:
        receiver = Receiver(secret_of(target)).start()
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.close()


def delivering(
    daemons: Daemons, targets: dict[str, Receiver], timeout: float = 5.0, **sections: Any
) -> Daemon:
    """A daemon whose `[[delivery.targets]]` are `targets` (name: receiver), each with its
    own secret in the daemon's environment."""
    delivery = {**FAST, **sections.pop("delivery", {})}
    delivery["targets"] = [
        {"name": name, "url": r.url, "secret_env": env_of(name), "timeout": timeout}
        for name, r in targets.items()
    ]
    daemon = daemons(delivery=delivery, **sections)
    daemon.env.update({env_of(name): secret_of(name) for name in targets})
    return daemon


def bound(daemon: Daemon, target: str) -> str:
    """A new session bound to `target` (`POST /v1/sessions {"deliver_to": ...}`)."""
    with daemon.client() as client:
        made = client.post("/v1/sessions", json={"deliver_to": target})
    assert made.status_code == 201, made.text
    assert made.json()["deliver_to"] == target
    session: str = made.json()["id"]
    return session


def answers(store: Store, session: str) -> list[EventRecord]:
    """The session's final answers: model responses asking for no tool, not cut."""
    return [
        e
        for e in events(store, session)
        if e.type == "model_response"
        and not e.payload.get("tool_calls")
        and e.payload.get("finish_reason") != "length"
    ]


def rows(store: Store, session: str) -> list[DeliveryInfo]:
    return sorted(store.deliveries.list(session=session, limit=1000), key=lambda d: d.seq)


def settled(store: Store, sessions: list[str], status: str = "delivered") -> bool:
    """Every delivery of `sessions` is in `status`, and each has one."""
    found = [rows(store, s) for s in sessions]
    return all(found) and all(d.status == status for per in found for d in per)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text `text`, 0 if it is absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@contextlib.contextmanager
def explained(daemon: Daemon, store: Store, **receivers: Receiver) -> Iterator[None]:
    """On a failure, note the outbox, the receivers and the daemon's latest words on
    deliveries: what a flake on a loaded machine needs to be understood."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(Exception):
            now = store.deliveries.now()
            found = sorted(
                store.deliveries.list(limit=1000), key=lambda d: (d.status != "pending", d.seq)
            )[:60]
            lines = [f"outbox {store.deliveries.counts()} at {now:.2f}:"]
            lines += [
                f"  {d.id[:9]} {d.session[:6]}/{d.seq} {d.status} attempts={d.attempts} "
                f"code={d.last_code} due_in={d.next_at - now:.2f} by={d.claimed_by} "
                f"{d.last_error[:60]}"
                for d in found
            ]
            lines += [
                f"receiver {name}: running={r.running} answer={r.answer} waiting={r.waiting} "
                f"requests={len(r.records)} keys={len(r.keys())} torn={r.torn}"
                for name, r in receivers.items()
            ]
            said = [
                line
                for line in daemon.log().splitlines()
                if "[deliveries]" in line or "WARNING" in line or "ERROR" in line or "---" in line
            ]
            exc.add_note("\n".join([*lines, "daemon log:", *said[-30:]]))
        raise


def kill_and_restart(daemon: Daemon) -> None:
    """SIGKILL the supervisor and every process under it, then boot on the same state."""
    daemon.kill_everything()
    daemon.start()
