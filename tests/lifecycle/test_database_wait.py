"""A database server that is not there yet at the start (`store.connect_timeout`): the
daemon waits for it, tells systemd, logs a line every 10 s and starts as soon as it
answers; past the timeout it exits 1 with one line; a SIGTERM during the wait stops it.

The server is reached through a TCP relay of the test's on 127.0.0.1 whose port refuses
connections (bound, not listening) until it opens, as a server's does before it is up.
"""

from __future__ import annotations

import configparser
import contextlib
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, turnkeeper, wait_until
from tests.lifecycle.test_deploy import Supervisord, wait_ready
from tests.restarts.test_restart_daemon import NotifyListener

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
LATE = 5.0  # seconds before the relay accepts connections


class LateRelay:
    """A TCP relay on 127.0.0.1 to `target`: its port refuses connections (bound, not
    listening) until `open`, then forwards each connection's bytes both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._open = False
        self._timer: threading.Timer | None = None
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []

    def url(self, base: str) -> str:
        """`base` (a server's URL) with its host and port this relay's."""
        parts = urlsplit(base)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    def open_after(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self.open)
        self._timer.daemon = True
        self._timer.start()

    def open(self) -> None:
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
        self.sock.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def relay() -> Iterator[Callable[[str], LateRelay]]:
    """Make relays to the server at a URL; each is closed after the test."""
    made: list[LateRelay] = []

    def make(base: str) -> LateRelay:
        parts = urlsplit(base)
        port = parts.port or (3306 if parts.scheme == "mysql" else 5432)
        made.append(LateRelay((parts.hostname or "127.0.0.1", port)))
        return made[-1]

    yield make
    for each in made:
        each.close()


def waiting_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.log().splitlines() if "waiting for the database" in line]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("db_url", ["postgresql", "mysql"], indirect=True)
def test_the_daemon_waits_for_a_database_that_comes_up_late(
    daemons: Daemons, relay: Callable[[str], LateRelay], tmp_path: Path, db_url: str
) -> None:
    late = relay(db_url)
    url = late.url(db_url)
    daemon = daemons(store={"url": url}, pool={"workers": 1})
    notify = NotifyListener(tmp_path / "notify.sock")
    daemon.env = {"NOTIFY_SOCKET": str(notify.path)}
    try:
        late.open_after(LATE)
        daemon.start()  # ready: it waited, then started
        assert late.accepted > 0
        # One line at the first refusal; the tries after it (about 5 in 5 s) log none
        # until 10 s have passed. The URL is the relay's, its password masked.
        lines = waiting_lines(daemon)
        assert len(lines) == 1, daemon.log()
        assert "WARNING" in lines[0] and "[store]" in lines[0], lines
        assert f"127.0.0.1:{late.port}" in lines[0] and "store.connect_timeout 120 s" in lines[0]
        assert "refused" in lines[0].lower(), lines
        assert "answered after" in daemon.log()
        # systemd heard what the start waits for, with more time for it, before READY=1.
        received = notify.received
        ready = next(i for i, m in enumerate(received) if "READY=1" in m)
        waiting = [m for m in received[:ready] if "STATUS=waiting for the database" in m]
        assert waiting, received
        extend = next(
            line for line in waiting[0].splitlines() if line.startswith("EXTEND_TIMEOUT_USEC=")
        )
        assert int(extend.split("=")[1]) > 100 * 1_000_000, waiting
        # An ordinary boot: its row, and the breaker clear.
        with Store(url, migrate=False) as store:
            assert store.boots.recent(1)[0].pid == daemon.pid
        assert turnkeeper(daemon, "breaker", "status").returncode == 0
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.log()
    finally:
        notify.close()


@pytest.mark.timeout(120)
def test_past_the_connect_timeout_the_start_exits_1_with_one_line(
    daemons: Daemons, relay: Callable[[str], LateRelay]
) -> None:
    never = relay("postgresql://tk@127.0.0.1:5432/tk")  # never opened: refused to the end
    daemon = daemons(store={"url": never.url("postgresql://tk:s3cr3t@x/tk"), "connect_timeout": 3})
    daemon.start(wait=False)
    assert daemon.wait(60) == 1, daemon.log()
    errors = [line for line in daemon.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1, daemon.log()
    assert "cannot start: the database postgresql://tk:***@127.0.0.1:" in errors[0], errors
    assert "did not answer within store.connect_timeout (3 s)" in errors[0], errors
    assert "Traceback" not in daemon.log() and "s3cr3t" not in daemon.log()
    assert waiting_lines(daemon), daemon.log()


@pytest.mark.timeout(120)
def test_a_sigterm_during_the_wait_stops_the_daemon(
    daemons: Daemons, relay: Callable[[str], LateRelay], tmp_path: Path
) -> None:
    never = relay("postgresql://tk@127.0.0.1:5432/tk")
    daemon = daemons(store={"url": never.url("postgresql://tk@x/tk")})  # waits up to 120 s
    notify = NotifyListener(tmp_path / "notify.sock")
    daemon.env = {"NOTIFY_SOCKET": str(notify.path)}
    try:
        daemon.start(wait=False)
        wait_until(lambda: waiting_lines(daemon), 60, "the daemon to wait for the database")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, daemon.log()  # not at the end of store.connect_timeout
        assert "stopped while waiting for the database" in daemon.log()
        assert any("STOPPING=1" in m for m in notify.received), notify.received
    finally:
        notify.close()


@pytest.mark.timeout(120)
def test_status_and_stop_during_the_wait_know_the_daemon_runs(
    daemons: Daemons, relay: Callable[[str], LateRelay]
) -> None:
    """A daemon waiting for its database holds its lock but does not listen yet: `status`
    says it runs and does not answer (exit 1), never "not running" (3); `stop` stops it."""
    never = relay("postgresql://tk@127.0.0.1:5432/tk")
    daemon = daemons(store={"url": never.url("postgresql://tk@x/tk")})  # waits up to 120 s
    daemon.start(wait=False)
    wait_until(lambda: waiting_lines(daemon), 60, "the daemon to wait for the database")
    status = turnkeeper(daemon, "status")
    assert status.returncode == 1, status
    assert f"the daemon (pid {daemon.pid}) runs but does not answer" in status.stderr, status
    assert "not running" not in status.stderr, status
    stop = turnkeeper(daemon, "stop")
    assert stop.returncode == 0, stop
    assert f"stopped (pid {daemon.pid})" in stop.stdout, stop
    assert daemon.wait(30) == 0, daemon.log()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_database_that_refuses_what_the_url_names_is_a_configuration_error(
    daemons: Daemons, db_url: str
) -> None:
    """No wait for a server that answers and refuses: exit 78 naming store.url."""
    parts = urlsplit(db_url)
    daemon = daemons(store={"url": urlunsplit(parts._replace(path="/no_such_database_tk"))})
    daemon.start(wait=False)
    assert daemon.wait(30) == 78, daemon.log()
    assert not waiting_lines(daemon), daemon.log()
    assert "store.url: the database server refuses it" in daemon.log()
    assert 'database "no_such_database_tk" does not exist' in daemon.log()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_under_supervisord_a_database_up_late_is_waited_for_not_fatal(
    relay: Callable[[str], LateRelay], tmp_path: Path, db_url: str
) -> None:
    """The shipped program file: the daemon waiting for its database counts as started
    (RUNNING after startsecs), where exiting at once would be retried into FATAL."""
    if shutil.which("supervisord") is None or shutil.which("supervisorctl") is None:
        pytest.skip("supervisord is not installed")
    late = relay(db_url)
    sup = Supervisord(tmp_path)
    conf = configparser.ConfigParser(interpolation=None)
    conf.read(sup.conf)
    program = conf["program:turnkeeper"]
    url = late.url(db_url).replace("%", "%%")  # supervisord expands %(...)s
    program["environment"] += f',TURNKEEPER_STORE__URL="{url}"'
    with sup.conf.open("w") as f:
        conf.write(f)
    sup.start()
    try:
        status = wait_until(
            lambda: (s := sup.ctl("status", "turnkeeper").stdout).split()[1:2] == ["RUNNING"] and s,
            60,
            "supervisord to count the waiting daemon as started",
        )
        pid = int(status.split("pid ", 1)[1].split(",")[0])
        assert "waiting for the database" in sup.log_path.read_text(), sup.logs()
        assert not sup.ready()
        late.open()
        wait_ready(sup, "the daemon to start once its database answers")
        assert f"pid {pid}," in sup.ctl("status", "turnkeeper").stdout  # never restarted
    finally:
        sup.stop()
