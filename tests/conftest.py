"""Shared fixtures: a store on each backend, each test in its own schema or database."""

from __future__ import annotations

import fcntl
import inspect
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background of a shell without job control (`.ci/run &`, a CI
# runner's script) inherits SIGINT ignored, and every command a test starts would too:
# the tests that end one with Ctrl-C would wait for ever, where a user's terminal never
# ignores it. Handled as Python does by default, the commands start with it at its default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
BACKENDS = ("sqlite", "postgresql", "mysql")
URL_VARS = {"postgresql": "TURNKEEPER_TEST_POSTGRES_URL", "mysql": "TURNKEEPER_TEST_MYSQL_URL"}


def _with_path(url: str, path: str, query: str = "") -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


@contextmanager
def private_database(kind: str, base: str) -> Iterator[str]:
    """A schema (PostgreSQL) or database (MySQL) of its own on the server at `base`: its
    URL, dropped after."""
    name = f"tk_{uuid.uuid4().hex[:12]}"
    if kind == "postgresql":
        import psycopg2

        conn = psycopg2.connect(base)
        conn.autocommit = True
        conn.cursor().execute(f"CREATE SCHEMA {name}")
        try:
            yield _with_path(base, urlsplit(base).path, f"options=-csearch_path%3D{name}")
        finally:
            conn.cursor().execute(f"DROP SCHEMA {name} CASCADE")
            conn.close()
    else:
        import pymysql

        parts = urlsplit(base)
        conn = pymysql.connect(
            host=parts.hostname,
            port=parts.port or 3306,
            user=parts.username or "root",
            password=parts.password or "",
            autocommit=True,
        )
        conn.cursor().execute(f"CREATE DATABASE {name}")
        try:
            yield _with_path(base, f"/{name}")
        finally:
            conn.cursor().execute(f"DROP DATABASE {name}")
            conn.close()


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL for the backend in `request.param`, private to this test."""
    kind = getattr(request, "param", "sqlite")
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}"
        return
    base = os.environ.get(URL_VARS[kind])
    if not base:
        pytest.skip(f"{URL_VARS[kind]} is not set; .ci/run sets it to the local {kind} server")
    with private_database(kind, base) as url:
        yield url


@pytest.fixture
def store(db_url: str) -> Iterator[object]:
    from supervisor.store import Store

    s = Store(db_url)
    try:
        yield s
    finally:
        s.close()


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process that imports this checkout."""
    env = dict(os.environ)
    # Hundreds of daemons, workers and commands start in a run: each would compile the
    # checkout anew from source (about 0.2 s of CPU) if bytecode were never written.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


PYTHON = sys.executable


def this_host_id() -> str:
    """The host id a daemon with the default `daemon.host_id` has on this machine."""
    from supervisor.contract.config import Config, resolved_host_id

    return resolved_host_id(Config())


# Tests that run several daemons on one server database (three daemons and their workers
# load a 2-core machine on their own) take turns: `xdist_group("cluster")` keeps them on
# one xdist worker, and an exclusive file lock keeps two test runs on one machine from
# running clusters at the same time.
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "turnkeeper-tests-cluster.lock"
CLUSTER_WAIT = 300  # seconds a cluster test may wait for its turn: add it to its timeout


@pytest.fixture
def cluster_turn() -> Iterator[None]:
    """Hold the machine's one cluster turn for the test (see CLUSTER_LOCK)."""
    with CLUSTER_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# What code that starts processes (a daemon, the CLI, a model server, a worker, a
# supervisord, a task runner) names: a test whose body, fixtures or test helpers (followed
# through the names they use) name one gets the `daemon` mark, and `pytest -m "not daemon"`
# runs the in-process rest, the fast tier.
PROCESS_WORDS = (
    "subprocess",
    "Popen",
    "sys.executable",
    "PYTHON",
    "Process(",
    "os.fork",
    "spawn_context",
    "get_context(",
    "multiprocess",
    "supervisord",
    "ModelServer",
    "McpTools(",  # starts each MCP server it is given
)
_STARTS: dict[object, bool] = {}


def _starts_processes(target: Any, seen: set[int] | None = None) -> bool:
    """Whether `target` (a function or class of the tests), or a test helper it names,
    names a way to start a process. Cached by object."""
    if target in _STARTS:
        return _STARTS[target]
    seen = set() if seen is None else seen
    if id(target) in seen:
        return False
    seen.add(id(target))
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = ""
    found = any(word in source for word in PROCESS_WORDS)
    if not found:
        found = any(_starts_processes(helper, seen) for helper in _helpers(target))
    _STARTS[target] = found
    return found


def _helpers(target: Any) -> list[Any]:
    """The functions and classes of the tests that `target` names."""
    if inspect.isclass(target):
        functions = [v for v in vars(target).values() if inspect.isfunction(v)]
    elif inspect.isfunction(target):
        functions = [target]
    else:
        return []
    found: list[Any] = []
    for function in functions:
        names: set[str] = set()
        codes = [function.__code__]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if inspect.iscode(c))
        for name in names:
            value = function.__globals__.get(name)
            module = getattr(value, "__module__", "") or ""
            if (inspect.isfunction(value) or inspect.isclass(value)) and module.startswith("tests"):
                found.append(value)
    return found


def mark_daemon_tests(items: list[pytest.Item]) -> None:
    """The `daemon` mark on every test whose body or fixtures start processes."""
    for item in items:
        if item.get_closest_marker("daemon") is not None:
            continue
        function = getattr(item, "function", None)
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        found = function is not None and _starts_processes(function)
        found = found or any(
            _starts_processes(definition.func)
            for name, definitions in fixtures.items()
            if name != "_in_process_only"  # the guard below names what it refuses
            for definition in definitions
        )
        if found:
            item.add_marker(pytest.mark.daemon)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Any:
    """Mark the tests that start processes (`daemon`), run the `slow` ones first, and make
    `--dist loadgroup` keep an `xdist_group` on one xdist worker again.

    pytest-xdist names a test's group by appending `@group` to `item._nodeid`, which
    pytest 9.2 no longer reads (the node id comes from `item._id`); the scheduler then
    sees no groups. Set the id it reads, on the workers where xdist would have.
    """
    mark_daemon_tests(items)
    # The longest tests first: xdist hands tests out in this order, and one of a minute or
    # two handed out last would end the run that much after the others.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    result = yield
    if getattr(config.option, "loadgroup", False):
        try:
            from _pytest.nodeid import coerce_node_id
        except ImportError:  # an older pytest reads `_nodeid` itself
            return result
        for item in items:
            groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
            if groups and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
    return result


@pytest.fixture(autouse=True)
def _in_process_only(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test without the `daemon` mark starts no process: the fast tier stays in process.
    One that does fails here, naming what to do."""
    if request.node.get_closest_marker("daemon") is not None:
        yield
        return
    import subprocess

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(
            "a test without the `daemon` mark started a process: name what starts it in "
            "tests/conftest.py's PROCESS_WORDS, or mark the test `pytest.mark.daemon`"
        )

    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    subprocess.Popen._execute_child = refuse  # type: ignore[attr-defined]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = original  # type: ignore[attr-defined]
