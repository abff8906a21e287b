"""A continuation attempt that is due at time T is made at T (within a second) after a
restart in place, not at the next retry sweep; `sessions show` says what the session
waits for meanwhile."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from supervisor.store import EventRecord, Store
from tests.daemon import Daemon, daemons, events, turnkeeper, wait_until
from tests.restart_harness import inject, new_session, status

__all__ = ["daemons"]

# The third attempt is due 20 s after the second began: long enough that a restart in
# place on a busy machine (8 s has been seen in CI) ends before it is due, so the
# session is seen waiting for it.
DELAYS = [0.0, 1.0, 20.0]


def notes(store: Store, session: str) -> list[EventRecord]:
    return [e for e in events(store, session) if e.type == "continuation"]


@pytest.mark.timeout(180)
def test_a_continuation_due_after_a_restart_is_made_on_time(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons(recovery={"attempt_delays": DELAYS, "retry_interval": 300}).start()
    boot = daemon.status()["boot"]["id"]
    store = Store(daemon.url, migrate=False)
    session = new_session(daemon.client, "crashes")
    inject(daemon.client, session, "/crash")  # its worker dies on every attempt
    second = wait_until(lambda: notes(store, session)[1:2], 60, "the second attempt")[0]
    wait_until(lambda: store.sessions.get(session).attempt_count >= 2, 30, "its charge")
    restart = turnkeeper(daemon, "restart", "--drain", "0", "--reason", "timers")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert status(daemon.client)["boot"]["id"] != boot
    shown = turnkeeper(daemon, "sessions", "show", session)
    assert "waiting: continuation attempt 3 of 3 at" in shown.stdout, shown.stdout
    with daemon.client() as http:  # the API says the same
        answered = http.get(f"/v1/sessions/{session}").json()["waiting"]
        listed = http.get("/v1/sessions", params={"q": session}).json()["sessions"]
    assert answered == shown.stdout.split("waiting: ", 1)[1].split("\n", 1)[0], answered
    assert [s["waiting"] for s in listed] == [answered]

    third = wait_until(lambda: notes(store, session)[2:3], 60, "the third attempt")[0]
    late = third.created_at - (second.created_at + DELAYS[2])
    assert -0.5 < late < 1.0, late
    store.close()
