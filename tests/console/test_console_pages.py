"""Every page of the console with real data in it: opened at its own address, drawn at a
laptop's and a phone's width (light, and dark for a few), keyboard-navigable, and light
enough to load: the page and its files weigh under 200 KB transferred.

The screenshots are the README's images when made with
`TURNKEEPER_SCREENSHOTS=docs/images/console`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Store
from tests.console.conftest import Browser
from tests.daemon import Daemon, daemons, turn_ended, wait_until
from tests.deliveries_harness import delivering, receivers
from tests.deliveries_receiver import Receiver
from tests.support import free_port

__all__ = ["daemons", "receivers"]  # the fixtures

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(300)]

MAX_PAGE_BYTES = 200 * 1024
REPORT = ["sh", "-c", 'echo "building the report"; echo "rows: 1024"; echo "done"']


def seeded(daemons: Callable[..., Daemon], hook: Receiver) -> tuple[Daemon, str]:
    """A daemon on a loopback port with something on every page: sessions (one with a
    conversation, a tool call and a task; one quarantined), a dead delivery, a schedule."""
    port = free_port()
    hook.answer = 500
    daemon = delivering(
        daemons,
        {"hook": hook},
        delivery={"max_attempts": 1},
        http={"listen": f"127.0.0.1:{port}"},
        tasks={"kinds": [{"name": "report", "command": REPORT}]},
    ).start()
    with daemon.client() as client, Store(daemon.url, migrate=False) as store:

        def session(title: str, *messages: str, **body: Any) -> str:
            sid: str = client.post("/v1/sessions", json={"title": title, **body}).json()["id"]
            for text in messages:
                seq = client.post(f"/v1/sessions/{sid}/inject", json={"text": text}).json()["seq"]
                wait_until(lambda seq=seq: turn_ended(store, sid, seq), 30, f"a turn of {title}")
            return sid

        main = session(
            "Nightly sales report",
            "Summarise yesterday's orders",
            '/tool echo {"text": "orders: 1024, refunds: 3"}',
            "/task report {}",
        )
        session("Inbox triage", "Sort the new tickets by urgency")
        session("Webhook relay", "Send the summary on", deliver_to="hook")
        poisoned = client.post("/v1/sessions", json={"title": "Flaky migration"}).json()["id"]
        client.post(f"/v1/sessions/{poisoned}/inject", json={"text": "/crash"})
        wait_until(
            lambda: store.sessions.get(poisoned).status == "quarantined", 60, "the quarantine"
        )
        wait_until(lambda: store.deliveries.counts().get("dead", 0) >= 1, 30, "a dead delivery")
        made = client.post(
            "/v1/schedules",
            json={"cron": "0 7 * * 1-5", "text": "Start the nightly report", "session": main},
        )
        assert made.status_code == 201, made.text
    return daemon, main


def test_every_page_at_a_laptop_and_a_phone_width(
    daemons: Callable[..., Daemon],
    receivers: Callable[[str], Receiver],
    browser: Browser,
) -> None:
    daemon, main = seeded(daemons, receivers("hook"))
    base = f"http://{daemon.listen}"
    token = (daemon.state / "admin.token").read_text().strip()
    pages = {
        "overview": ("/ui/", "#slots table"),
        "sessions": ("/ui/sessions", "a[data-session]"),
        "session": (f"/ui/sessions/{main}", '#transcript [data-type="tool_call"]'),
        "deliveries": ("/ui/deliveries", "button[data-action^=retry-]"),
        "tasks": ("/ui/tasks", "main table"),
        "schedules": ("/ui/schedules", "button[data-action^=pause-]"),
        "boots": ("/ui/boots", "main table"),
    }
    browser.open(base, "/ui/", token)
    browser.find("#nav a")
    made: list[Path] = []
    for name, (path, ready) in pages.items():
        browser.open(base, path)  # each address opened directly, as a bookmark is
        browser.find(ready)
        if name == "overview":  # two polls (5 s apart): the charts have a line to draw
            browser.until(
                lambda: browser.js(
                    "return document.querySelector('[data-chart] polyline')"
                    ".getAttribute('points').includes(' ')"
                ),
                "a chart's line (two points)",
            )
        made += browser.screenshots(name)
        if name in ("overview", "session", "sessions"):
            browser.dark(True)
            made += browser.screenshots(name, dark=True)
            assert (
                browser.js("return getComputedStyle(document.body).backgroundColor")
                != "rgb(246, 247, 248)"
            )  # the dark palette is in force
            browser.dark(False)
    assert len(made) == 2 * len(pages) + 2 * 3
    assert all(p.stat().st_size > 2000 for p in made)


def test_every_action_is_reachable_by_keyboard_with_a_visible_focus(
    daemons: Callable[..., Daemon], browser: Browser
) -> None:
    port = free_port()
    daemon = daemons(http={"listen": f"127.0.0.1:{port}"}).start()
    token = (daemon.state / "admin.token").read_text().strip()
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={"title": "keyboard"}).json()["id"]
    browser.open(f"http://127.0.0.1:{port}", f"/ui/sessions/{sid}", token)
    browser.find("#message")
    wanted = {"close", "send"}
    reached: set[str] = set()
    from selenium.webdriver.common.keys import Keys

    body = browser.find("body")
    for _ in range(60):
        body.send_keys(Keys.TAB)
        focused = browser.js(
            "const e = document.activeElement; const s = getComputedStyle(e);"
            "return [e.dataset.action || e.id || e.tagName, s.outlineStyle, s.outlineWidth]"
        )
        name, style, width = focused
        if name in wanted:
            assert style != "none" and width != "0px", focused  # the focus can be seen
            reached.add(name)
        if reached == wanted:
            break
        body = browser.driver.switch_to.active_element
    assert reached == wanted


def test_the_page_weighs_under_200_kb(daemons: Callable[..., Daemon], browser: Browser) -> None:
    port = free_port()
    daemon = daemons(http={"listen": f"127.0.0.1:{port}"}).start()
    token = (daemon.state / "admin.token").read_text().strip()
    browser.open(f"http://127.0.0.1:{port}", "/ui/", token)
    browser.find("#slots table")
    entries = json.loads(
        browser.js(
            "return JSON.stringify(performance.getEntriesByType('navigation')"
            ".concat(performance.getEntriesByType('resource'))"
            ".map((e) => [new URL(e.name).origin, new URL(e.name).pathname, e.transferSize]))"
        )
    )
    page = [(path, size) for _, path, size in entries if path.startswith("/ui")]
    assert {p for p, _ in page} >= {"/ui/"}
    assert any(p.endswith(".js") for p, _ in page) and any(p.endswith(".css") for p, _ in page)
    weight = sum(size for _, size in page)
    print(json.dumps({"page_bytes_transferred": weight, "files": page}))
    assert 0 < weight < MAX_PAGE_BYTES, page
    # Nothing was asked of another origin.
    assert {origin for origin, _, _ in entries} == {f"http://127.0.0.1:{port}"}
