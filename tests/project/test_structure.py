"""The structure drawn from the code: one composition root, services that reach into no
other's attributes, no task created outside the one helper, and the architecture page's
table of services as the code declares it. And the service frame itself (`Root`, the bus,
the reconcile loop) in-process, with fakes and a moved clock."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from supervisor.composition import Hooks, build, draw
from supervisor.contract.background import run_loops
from supervisor.contract.config import Config
from supervisor.http.auth import Tokens
from supervisor.runtime.bus import Bus, Committed, Stopping
from supervisor.runtime.loops import Wake, reconcile
from supervisor.runtime.root import Root, order
from supervisor.runtime.service import Service
from supervisor.store import Store
from tests.clock import SteppingClock

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "supervisor", ROOT / "workers"]
HELPER = ROOT / "supervisor" / "contract" / "background.py"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- services:begin -->\n", "<!-- services:end -->\n"


def modules() -> Iterator[tuple[Path, ast.Module]]:
    for top in SOURCES:
        for path in sorted(top.rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def test_no_task_is_created_outside_the_one_helper() -> None:
    found = []
    for path, tree in modules():
        if path == HELPER:
            continue
        for node in ast.walk(tree):
            # `ensure_future` of the clock seam's own race (sleep_unless) is left: the seam
            # imports nothing of the project, so the command line's start stays light.
            names = (
                ("create_task",) if path.name == "clock.py" else ("create_task", "ensure_future")
            )
            if isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.attr}")
    assert found == [], "use supervisor.contract.background (spawn, Background, run_loops)"


def tree_of(tmp_path: Path) -> Any:
    store = Store(f"sqlite:///{tmp_path / 'structure.db'}")
    hooks = Hooks(lambda: None, lambda _: None, lambda: False, lambda _: None)
    return store, build(
        Config(),
        None,
        store,
        Tokens({}),
        hooks,
        boot_id="b" * 32,
        host="host",
        runtime_dir=tmp_path,
        state_dir=tmp_path,
    )


def test_the_architecture_page_draws_the_services_as_the_code_declares_them(
    tmp_path: Path,
) -> None:
    store, tree = tree_of(tmp_path)
    with store:
        drawn = draw(tree)
    text = PAGE.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    if os.environ.get("TURNKEEPER_STRUCTURE_UPDATE") == "1":
        PAGE.write_text(f"{head}{BEGIN}{drawn}{END}{tail}")
        return
    assert rest.split(END)[0] == drawn, (
        "docs/architecture.md's table of services is not the code's: run this test with "
        "TURNKEEPER_STRUCTURE_UPDATE=1 to draw it again"
    )


def service_classes() -> dict[str, type[Service]]:
    def below(cls: type) -> Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from below(sub)

    return {c.__name__: c for c in below(Service) if c.__module__.startswith("supervisor.")}


def test_there_is_one_composition_root() -> None:
    """Services and the Root are built in supervisor/composition.py only."""
    names = {*service_classes(), "Root"}
    found = []
    for path, tree in modules():
        if path.name == "composition.py" and path.parent.name == "supervisor":
            continue
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in names:  # type: ignore[attr-defined]
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(...)")  # type: ignore[attr-defined]
    assert found == []


def test_no_service_reaches_into_another_s_attributes() -> None:
    """A class given a service in its constructor (`self.x = x`, annotated with a service
    class) calls its methods and reads its properties; it reads or writes no data attribute
    of it. Found from the source, checked against the classes."""
    services = service_classes()
    found = []
    for path, tree in modules():
        for cdef in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            found += reaches(cdef, services, path)
    assert found == []


def reaches(cdef: ast.ClassDef, services: dict[str, type], path: Path) -> list[str]:
    inits = [n for n in cdef.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    init = inits[0] if inits else None
    if init is None:
        return []
    arguments = init.args.args + init.args.kwonlyargs
    annotated = {
        a.arg: ast.unparse(a.annotation).split("|")[0].strip() for a in arguments if a.annotation
    }
    held: dict[str, type] = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            kind = services.get(annotated.get(node.value.id, ""))
            for target in node.targets:
                mine = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                if kind is not None and mine and target.value.id == "self":  # type: ignore[attr-defined]
                    held[target.attr] = kind  # type: ignore[attr-defined]
    found = []
    for node in ast.walk(cdef):
        inner = node.value if isinstance(node, ast.Attribute) else None
        if not (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)):
            continue
        if inner.value.id != "self" or inner.attr not in held:
            continue
        assert isinstance(node, ast.Attribute)
        member = inspect.getattr_static(held[inner.attr], node.attr, None)
        if callable(member) or isinstance(member, property | staticmethod | classmethod):
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: self.{inner.attr}.{node.attr}")
    return found


def test_the_reach_check_finds_a_reach(tmp_path: Path) -> None:
    """The check above is not vacuous: a class that reads a pool's data attribute is found."""
    source = (
        "class Spy:\n"
        "    def __init__(self, pool: Pool) -> None:\n"
        "        self.pool = pool\n"
        "    def peek(self) -> object:\n"
        "        self.pool.wake('s')\n"
        "        return self.pool.workers\n"
    )
    cdef = ast.parse(source).body[0]
    assert isinstance(cdef, ast.ClassDef)
    found = reaches(cdef, service_classes(), ROOT / "supervisor" / "spy.py")
    assert found == ["supervisor/spy.py:6: self.pool.workers"]


# --- the frame: Root, bus, reconcile loop ------------------------------------------------


class Fake(Service):
    """A service that records what the root did with it, in one shared journal."""

    journal: ClassVar[list[str]] = []

    def __init__(self, name: str, needs: tuple[str, ...] = (), drains: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.needs = needs  # type: ignore[misc]
        self.drains = drains  # type: ignore[misc]
        self.fail = False

    async def start(self) -> None:
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.journal.append(f"start {self.name}")

    def loops(self) -> dict[str, Any]:
        return {f"{self.name}-loop": self._loop()}

    async def _loop(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.journal.append(f"loop ended {self.name}")

    async def drain(self, deadline: float) -> None:
        self.journal.append(f"drain {self.name}")

    async def stop(self, steps: Any) -> None:
        self.journal.append(f"stop {self.name}")


class Steps:
    async def run(self, name: str, cap: float, work: Callable[[], Any]) -> None:
        await asyncio.wait_for(work(), cap)


def test_the_root_orders_by_needs_and_refuses_a_cycle_or_a_missing_need() -> None:
    a, b, c = Fake("a", ("b",)), Fake("b"), Fake("c", ("a", "b"))
    assert [s.name for s in order([c, a, b])] == ["b", "a", "c"]
    with pytest.raises(ValueError, match="need each other"):
        order([Fake("x", ("y",)), Fake("y", ("x",))])
    with pytest.raises(ValueError, match="needs z, which is not built"):
        order([Fake("x", ("z",))])


def test_a_start_that_fails_stops_what_started_in_reverse() -> None:
    Fake.journal = []
    a, b, c = Fake("a"), Fake("b", ("a",)), Fake("c", ("b",))
    b.fail = True
    with pytest.raises(RuntimeError, match="b cannot start"):
        asyncio.run(Root([a, b, c]).start(Steps()))
    assert Fake.journal == ["start a", "stop a"]


def test_the_stop_is_in_reverse_with_the_drain_before_the_first_that_drains() -> None:
    Fake.journal = []

    async def scenario() -> None:
        root = Root([Fake("store"), Fake("pool", ("store",), True), Fake("late", ("pool",))])
        await root.start(Steps())
        ended: list[str] = []
        root.run(lambda name, _: ended.append(name))
        await asyncio.sleep(0)

        async def drain(drains: Callable[[float], Any]) -> None:
            Fake.journal.append("drain step")
            await drains(asyncio.get_running_loop().time() + 1.0)

        await root.stop(Steps(), drain)
        assert ended == []  # cancelled by their stop: no service ended by itself

    asyncio.run(scenario())
    assert Fake.journal == [
        "start store",
        "start pool",
        "start late",
        "loop ended late",
        "stop late",
        "drain step",
        "drain pool",
        "drain store",
        "loop ended pool",
        "stop pool",
        "loop ended store",
        "stop store",
    ]


def test_a_loop_that_raises_ends_its_service_and_the_root_says_so() -> None:
    class Broken(Fake):
        async def _loop(self) -> None:
            raise OSError("disk on fire")

    async def scenario() -> list[str]:
        root = Root([Broken("broken")])
        await root.start(Steps())
        ended: list[str] = []
        root.run(lambda name, task: ended.append(f"{name}: {task.exception()!r}"))
        for _ in range(10):
            await asyncio.sleep(0)
        await root.stop(Steps())
        return ended

    assert asyncio.run(scenario()) == [
        "broken: LoopDied(\"task broken-loop died: OSError('disk on fire')\")"
    ]


def test_a_handler_that_raises_does_not_keep_the_event_from_the_others() -> None:
    bus, heard = Bus(), []

    def broken(_: Committed) -> None:
        raise RuntimeError("bug")

    bus.subscribe(Committed, broken)
    bus.subscribe(Committed, lambda e: heard.append(e.session))
    bus.subscribe(Stopping, lambda e: heard.append("wrong type"))
    bus.committed("s1", 3, "user_message")
    assert heard == ["s1"]


class Passes:
    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes
        self.seen: list[str] = []

    def loop_pass(self, loop: str, ok: bool) -> None:
        self.seen.append(f"{loop} {'ok' if ok else 'failed'}")

    async def step(self) -> float | None:
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_the_reconcile_loop_survives_failing_passes_logging_once_per_streak(
    caplog_lines: list[str],
) -> None:
    clock, wake = SteppingClock(), Wake()
    passes = Passes([OSError("gone"), OSError("gone"), 7.0, None])

    async def scenario() -> None:
        loop = asyncio.ensure_future(run_loops({"t": reconcile(
            "tasks", passes.step, interval=lambda: 30.0, wake=wake, clock=clock, retry=1.0,
            observer=passes,
        )}))  # fmt: skip
        while len(passes.seen) < 5:
            await asyncio.sleep(0)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(scenario())
    assert passes.seen[:4] == ["tasks failed", "tasks failed", "tasks ok", "tasks ok"]
    assert clock.slept[:4] == [1.01, 1.01, 7.01, 30.01]  # retry, retry, asked, interval
    failures = [line for line in caplog_lines if "a pass failed" in line]
    assert len(failures) == 1 and any("passes work again" in line for line in caplog_lines)
    assert not any("Traceback" in line for line in caplog_lines)  # at DEBUG only


@pytest.fixture
def caplog_lines() -> Iterator[list[str]]:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO")
    yield lines
    logger.remove(sink)


def test_a_wake_during_a_pass_cuts_the_next_rest_short() -> None:
    clock, wake = SteppingClock(), Wake()

    async def scenario() -> list[float]:
        async def step() -> float:
            if len(clock.slept) == 0:
                wake.wake()  # woken while the pass runs: the rest after it is cut
            return 60.0

        loop = asyncio.ensure_future(run_loops({"w": reconcile(
            "w", step, interval=lambda: 60.0, wake=wake, clock=RealSleep(clock),
        )}))  # fmt: skip
        for _ in range(50):
            await asyncio.sleep(0)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return clock.slept

    slept = asyncio.run(scenario())
    assert len(slept) >= 2  # the first rest did not wait its 60 s out


class RealSleep:
    """A clock whose sleeps never end by themselves (only a wake ends a rest)."""

    def __init__(self, clock: SteppingClock) -> None:
        self.clock = clock

    def monotonic(self) -> float:
        return self.clock.now

    def time(self) -> float:
        return self.clock.now

    async def sleep(self, seconds: float) -> None:
        self.clock.slept.append(seconds)
        await asyncio.Event().wait()
