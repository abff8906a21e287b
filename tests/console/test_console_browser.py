"""The operator console in a real headless Chromium, against a real daemon on loopback.

Sign-in through `#token=` (read, then removed from the address; kept in the tab's
sessionStorage, never in a cookie), a session made through the API seen in the list and
opened at its own address, an answer appearing live while the page stays open (the turn
held by a gate until the page is attached), a quarantined session released, a dead
delivery retried, a read-only principal shown no action and refused (403) by the API when
it forges one, and user text that looks like HTML shown as text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.console.conftest import WAIT_S, Browser
from tests.daemon import Daemon, daemons, wait_until
from tests.deliveries_harness import delivering, receivers, rows, settled
from tests.deliveries_receiver import Receiver
from tests.http.test_api import Api, create_session, grant, inject, start
from tests.support import free_port

__all__ = ["daemons", "receivers", "start"]  # the fixtures

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(180)]


def forged(browser: Browser, method: str, path: str) -> int:
    """The status the API answers a request the page did not offer, sent from the page with
    the token it signed in with."""
    status: int = browser.driver.execute_async_script(
        """
        const [method, path, done] = arguments;
        const token = sessionStorage.getItem("turnkeeper.token");
        fetch(path, {method, headers: {Authorization: "Bearer " + token,
                                       "Content-Type": "application/json"},
                     body: method === "GET" ? undefined : JSON.stringify({text: "forged"})})
          .then((r) => done(r.status), () => done(-1));
        """,
        method,
        path,
    )
    return status


def test_sign_in_from_the_address_and_see_a_session_made_through_the_api(
    start: Callable[..., Api], browser: Browser
) -> None:
    api = start()
    alice = api.client("alice")
    sid = create_session(alice, title="nightly report")
    other = create_session(api.client("bob"), title="bob's own")
    browser.open(api.base_url, "/ui/sessions", api.tokens["alice"])
    row = browser.find(f'a[data-session="{sid}"]')
    assert row.text == "nightly report"
    assert not browser.all(f'a[data-session="{other}"]')  # not alice's to read
    # The token left the address at once, stays in this tab, and is no cookie.
    assert browser.driver.current_url == f"{api.base_url}/ui/sessions"
    assert browser.js("return sessionStorage.getItem('turnkeeper.token')") == api.tokens["alice"]
    assert browser.driver.get_cookies() == []
    row.click()
    browser.find("#session-title")
    assert browser.driver.current_url == f"{api.base_url}/ui/sessions/{sid}"
    assert browser.find("#session-title").text == "nightly report"
    # The session's own address, opened directly (a bookmark) in this tab: still signed in.
    browser.driver.refresh()
    assert browser.find("#session-title").text == "nightly report"
    # Signed out, the page asks for a token, and a wrong one is refused with a reason.
    browser.find("#signout").click()
    browser.find("#token").send_keys("not-a-token")
    browser.find("#signin button[type=submit]").click()
    browser.until(lambda: "Not signed in" in browser.text(), "the refusal")
    assert browser.js("return sessionStorage.getItem('turnkeeper.token')") is None


def test_an_answer_appears_live_while_the_page_stays_open(
    start: Callable[..., Api], browser: Browser, tmp_path: Path
) -> None:
    # The echo model streams its answer word by word over 2 s.
    api = start(model={"delay": 2.0})
    alice = api.client("alice")
    sid = create_session(alice, title="live")
    gate = tmp_path / "gate"
    browser.open(api.base_url, f"/ui/sessions/{sid}", api.tokens["alice"])
    browser.until(lambda: browser.find("#stream-state").text == "live", "the page to attach")
    browser.js("window.stayed = true")  # gone if the page were loaded again
    words = " ".join(f"word{i}" for i in range(30))
    browser.find("#message").send_keys(f"/gate {gate} {words}")
    browser.find('button[data-action="send"]').click()
    browser.find('#transcript [data-type="user_message"]')
    browser.find('#transcript [data-type="turn_started"]')  # the turn is held in flight
    assert not browser.all('#transcript [data-type="model_response"]')
    gate.touch()
    answer = browser.find('#transcript [data-type="model_response"]', timeout=WAIT_S)
    assert f"echo: /gate {gate} {words}" in answer.text
    assert int(browser.js("return document.getElementById('transcript').dataset.deltas || 0")) > 1
    browser.find('#transcript [data-type="turn_ended"]')
    assert browser.js("return window.stayed") is True
    assert not browser.all("[data-streaming]")  # the streamed text gave way to the answer


def test_release_a_quarantined_session(start: Callable[..., Api], browser: Browser) -> None:
    api = start()
    alice = api.client("alice")
    sid = create_session(alice, title="poisoned")
    with api.store() as store:
        inject(alice, sid, "/crash")  # kills its worker on every run
        wait_until(lambda: store.sessions.get(sid).status == "quarantined", 60, "the quarantine")
        browser.open(api.base_url, "/ui/sessions?status=quarantined", api.tokens["alice"])
        browser.find(f'a[data-session="{sid}"]').click()
        browser.find('button[data-action="release"]').click()
        browser.until(lambda: "Released" in browser.text(), "the release to be told")
        assert store.sessions.get(sid).status == "open"
        browser.until(lambda: not browser.all('button[data-action="release"]'), "no release")
        browser.find("#message")  # open again: it takes a message


def test_retry_a_dead_delivery(
    daemons: Callable[..., Daemon],
    receivers: Callable[[str], Receiver],
    browser: Browser,
) -> None:
    hook = receivers("hook")
    hook.answer = 500
    port = free_port()
    daemon = delivering(
        daemons,
        {"hook": hook},
        delivery={"max_attempts": 2},
        http={"listen": f"127.0.0.1:{port}"},
    ).start()
    token = (daemon.state / "admin.token").read_text().strip()
    with daemon.client() as client:
        made = client.post("/v1/sessions", json={"deliver_to": "hook", "title": "hooked"})
        sid = made.json()["id"]
        assert client.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}).status_code == 202
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: settled(store, [sid], "dead"), 30, "the delivery to be dead")
        [dead] = rows(store, sid)
        browser.open(f"http://127.0.0.1:{port}", "/ui/deliveries", token)
        assert "Dead letters (1)" in browser.find("h2").text
        hook.answer = 200
        browser.find(f'button[data-action="retry-{dead.id}"]').click()
        wait_until(lambda: settled(store, [sid], "delivered"), 30, "the retried delivery")
        browser.until(lambda: "Dead letters (0)" in browser.text(), "the page to show it")


def test_a_reader_sees_no_action_and_the_api_refuses_a_forged_one(
    start: Callable[..., Api], browser: Browser
) -> None:
    api = start()
    alice = api.client("alice")
    sid = create_session(alice, title="shared")
    grant(alice, sid, "bob", "read")
    inject(alice, sid, "hello")
    browser.open(api.base_url, f"/ui/sessions/{sid}", api.tokens["bob"])
    browser.find('#transcript [data-type="user_message"]')
    browser.until(lambda: browser.find("#stream-state").text == "live", "the page to attach")
    assert browser.all("#session-actions button") == []
    assert browser.all("#composer *") == []
    for method, path in (
        ("POST", f"/v1/sessions/{sid}/inject"),
        ("POST", f"/v1/sessions/{sid}/interrupt"),
        ("POST", f"/v1/sessions/{sid}/release"),
        ("DELETE", f"/v1/sessions/{sid}"),
        ("POST", "/v1/breaker/reset"),
    ):
        assert forged(browser, method, path) == 403, (method, path)
    # The admin's pages say what they need, and offer nothing.
    for page in ("/ui/", "/ui/deliveries", "/ui/boots"):
        browser.open(api.base_url, page)
        browser.find("main h1")
        assert browser.all("main button") == [], page


def test_text_that_looks_like_html_is_shown_as_text(
    start: Callable[..., Api], browser: Browser
) -> None:
    api = start()
    alice = api.client("alice")
    title = '<img src=x onerror="window.pwned=1">'
    sid = create_session(alice, title=title)
    inject(alice, sid, "<script>window.pwned=2</script><b>bold</b>")
    browser.open(api.base_url, "/ui/sessions", api.tokens["alice"])
    assert browser.find(f'a[data-session="{sid}"]').text == title
    browser.open(api.base_url, f"/ui/sessions/{sid}")
    message = browser.find('#transcript [data-type="user_message"] .text')
    assert message.text == "<script>window.pwned=2</script><b>bold</b>"
    browser.find('#transcript [data-type="model_response"]')
    assert browser.find("#session-title").text == title
    assert browser.all("main img, main script, main b") == []  # no element made of them
    assert browser.js("return window.pwned") is None
