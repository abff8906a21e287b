"""The clock seam has no way around it: outside `supervisor/contract/clock.py` no code of
supervisor/ or workers/ reads the time or waits on its own, and the fake clock stays in tests.

Pure: the sources are parsed with `ast`, nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

SEAM = Path("supervisor/contract/clock.py")
ROOTS = ("supervisor", "workers")

# time.<name>: readings of a clock and the blocking sleep.
TIME_CALLS = {
    "time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
    "sleep", "clock_gettime", "clock_gettime_ns",
}  # fmt: skip
# time.<name>() with no moment given reads the time too.
NOW_WITHOUT_ARGUMENT = {"localtime", "gmtime", "ctime", "asctime"}
# datetime.<name>() / date.<name>(): the present moment.
DATETIME_NOW = {"now", "utcnow", "today"}
LOOP_GETTERS = {"get_running_loop", "get_event_loop"}


def _terminal(node: ast.expr) -> str:
    """The last name of `a.b.c` or `c` ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


class _Finder(ast.NodeVisitor):
    """The bypasses of the clock seam in one module, and where `FakeClock` appears."""

    def __init__(self, check_time: bool) -> None:
        self.check_time = check_time
        self.found: list[tuple[int, str]] = []
        self.time_modules: set[str] = set()  # names bound to the module time
        self.asyncio_modules: set[str] = set()
        self.datetime_modules: set[str] = set()
        self.datetime_classes: set[str] = set()  # datetime.datetime and datetime.date

    def _say(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            if alias.name == "time":
                self.time_modules.add(bound)
            elif alias.name == "asyncio":
                self.asyncio_modules.add(bound)
            elif alias.name == "datetime":
                self.datetime_modules.add(bound)
            elif alias.name == "tests.clock" or alias.name == "tests":
                self._say(node, f"import {alias.name} (the fake clock is the tests' own)")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            if alias.name == "FakeClock" or module == "tests.clock":
                self._say(node, f"from {module} import {alias.name} (the tests' fake clock)")
            elif module == "tests" and alias.name == "clock":
                self._say(node, "from tests import clock (the tests' fake clock)")
            elif not self.check_time:
                continue
            elif module == "time" and alias.name in TIME_CALLS | NOW_WITHOUT_ARGUMENT:
                self._say(node, f"from time import {alias.name}")
            elif module == "asyncio" and alias.name == "sleep":
                self._say(node, "from asyncio import sleep")
            elif module == "datetime" and alias.name in ("datetime", "date"):
                self.datetime_classes.add(alias.asname or alias.name)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name == "FakeClock":
            self._say(node, "class FakeClock (the fake clock is the tests' own)")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # A reference is a bypass too (`sleep=time.sleep`), called or not.
        if self.check_time and isinstance(node.value, ast.Name):
            owner = node.value.id
            if owner in self.time_modules and node.attr in TIME_CALLS:
                self._say(node, f"{owner}.{node.attr}")
            elif owner in self.asyncio_modules and node.attr == "sleep":
                self._say(node, f"{owner}.sleep")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if self.check_time and isinstance(func, ast.Attribute):
            owner, name, given = func.value, func.attr, len(node.args) + len(node.keywords)
            if name == "time" and not given and self._is_loop(owner):
                self._say(node, "the event loop's time()")
            elif (
                isinstance(owner, ast.Name)
                and owner.id in self.time_modules
                and (
                    (name in NOW_WITHOUT_ARGUMENT and not given)
                    or (name == "strftime" and len(node.args) < 2)
                )
            ):
                self._say(node, f"{owner.id}.{name} of the present moment")
            elif name in DATETIME_NOW and self._is_datetime_class(owner):
                self._say(node, f"{_terminal(owner)}.{name}()")
        self.generic_visit(node)

    def _is_loop(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Call):
            return _terminal(node.func) in LOOP_GETTERS
        return _terminal(node).lower().endswith("loop")

    def _is_datetime_class(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.datetime_classes
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in self.datetime_modules
            and node.attr in ("datetime", "date")
        )


def bypasses(source: str, where: str, *, check_time: bool = True) -> list[str]:
    """Each bypass of the seam in `source` (the module at `where`), as `where:line: what`."""
    finder = _Finder(check_time)
    finder.visit(ast.parse(source, filename=where))
    return [f"{where}:{line}: {what}" for line, what in sorted(finder.found)]


def sources() -> list[Path]:
    return sorted(p.relative_to(REPO) for root in ROOTS for p in (REPO / root).rglob("*.py"))


def test_nothing_outside_the_seam_reads_the_time_or_waits_and_no_fake_clock_ships() -> None:
    found = [
        hit
        for path in sources()
        for hit in bypasses((REPO / path).read_text(), str(path), check_time=path != SEAM)
    ]
    assert sources() and SEAM in sources()
    assert found == [], "go through supervisor.contract.clock instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import time\nx = time.time()",
        "import time\nx = time.monotonic()",
        "import time\ntime.sleep(1)",
        "import time\nx = time.perf_counter()",
        "import time\nx = time.monotonic_ns()",
        "import time as t\nx = t.monotonic()",
        "import time\ndef f(clock=time.monotonic): ...",
        "import time\nstamp = time.strftime('%H:%M')",
        "import time\nnow = time.localtime()",
        "from time import monotonic",
        "from time import sleep as pause",
        "import asyncio\nasync def f():\n    await asyncio.sleep(1)",
        "import asyncio\nasync def f():\n    await asyncio.sleep(0)",
        "from asyncio import sleep",
        "import asyncio\nasync def f():\n    return asyncio.get_running_loop().time()",
        "import asyncio\nasync def f():\n    loop = asyncio.get_event_loop()\n    loop.time()",
        "def f(self):\n    return self._loop.time()",
        "from datetime import datetime\nx = datetime.now()",
        "import datetime\nx = datetime.datetime.now()",
        "from datetime import date\nx = date.today()",
        "class FakeClock:\n    pass",
        "from tests.clock import FakeClock",
        "from somewhere import FakeClock",
        "import tests.clock",
    ],
)
def test_a_bypass_is_named_with_its_file_and_line(source: str) -> None:
    found = bypasses("x = 1\n" + source, "supervisor/somewhere.py")
    assert found and all(hit.startswith("supervisor/somewhere.py:") for hit in found), found
    assert int(found[0].split(":")[1]) >= 2  # the line of the bypass, not the first


@pytest.mark.parametrize(
    "source",
    [
        "from supervisor.contract.clock import SYSTEM\nx = SYSTEM.monotonic()",
        "def f(self):\n    return self.clock.time() + self._clock.monotonic()",
        "import time\nstamp = time.strftime('%H:%M', time.gmtime(0.0))",
        "import time\nx = time.localtime(12.0)",
        "from datetime import UTC, datetime\nx = datetime.fromtimestamp(0.0, UTC)",
        "import asyncio\nasync def f(e):\n    await asyncio.wait_for(e.wait(), 1.0)",
        "import asyncio\nasync def f():\n    asyncio.get_running_loop().call_soon(print)",
    ],
)
def test_what_goes_through_the_seam_or_reads_no_clock_passes(source: str) -> None:
    assert bypasses(source, "supervisor/somewhere.py") == []


def test_the_seam_itself_may_read_the_clocks_but_not_hold_the_fake_one() -> None:
    real = "import time\nimport asyncio\nx = time.monotonic()\n"
    real += "async def f():\n    await asyncio.sleep(9)"
    assert bypasses(real, str(SEAM), check_time=False) == []
    assert bypasses("class FakeClock:\n    pass", str(SEAM), check_time=False) != []
