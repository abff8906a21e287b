"""The reaper under real processes: groups, sessions, signals, pid reuse and PDEATHSIG."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from supervisor.contract.reaper import (
    REAP_BUDGET,
    ProcessId,
    classify,
    descendants,
    exit_if_orphaned,
    set_pdeathsig,
    sweep,
    terminate,
    terminate_tree,
)
from tests.conftest import PYTHON, REPO, python_env

SLEEPER = """
import signal, sys, time
if "stubborn" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""

# Starts a sleeper child (with the given preexec_fn, if any) and prints its pid.
PARENT = """
import subprocess, sys, time
import supervisor.contract.reaper as reaper
preexec = getattr(reaper, sys.argv[1]) if len(sys.argv) > 1 else None
code = "print('ready', flush=True); import time; time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         preexec_fn=preexec)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""

# Leaves the caller's session (or only its group), forks a grandchild that prints its pid
# and sleeps, and exits: the grandchild is adopted by init.
DOUBLE_FORK = """
import os, sys, time
if sys.argv[1] == "setsid":
    os.setsid()
else:
    os.setpgid(0, 0)
if os.fork() == 0:
    if sys.argv[1] == "setsid":
        os.setpgid(0, 0)  # only its session still links it to the recorded id
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
os._exit(0)
"""

# A child that leaves an exited grandchild unreaped: a zombie that is not ours.
ZOMBIE_PARENT = """
import os, time
pid = os.fork()
if pid == 0:
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""

# Its own group leader, with a sleeper grandchild in that group.
GROUP_LEADER = """
import subprocess, sys, time
code = "print('ready', flush=True); import time; time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


class Kids:
    """Processes a test starts; every one of them, and every pid tracked, ends with it."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[str]] = []
        self.tracked: list[ProcessId] = []

    def start(self, code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [PYTHON, "-c", code, *args],
            cwd=REPO,
            env=python_env(),
            stdout=subprocess.PIPE,
            text=True,
            **kwargs,
        )
        self.popens.append(proc)
        self.track(proc.pid)
        return proc

    def line(self, proc: subprocess.Popen[str]) -> str:
        """The next line `proc` prints (blocking; pytest-timeout bounds it)."""
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"process {proc.pid} ended without printing"
        return line.strip()

    def sleeper(self, stubborn: bool = False, **kwargs: Any) -> subprocess.Popen[str]:
        proc = self.start(SLEEPER, *(["stubborn"] if stubborn else []), **kwargs)
        assert self.line(proc) == "ready"
        return proc

    def track(self, pid: int) -> int:
        ident = ProcessId.of(pid)
        if ident is not None:
            self.tracked.append(ident)
        return pid

    def close(self) -> None:
        # Kill by identity, so that a pid reused since is left alone.
        for ident in self.tracked:
            proc = ident.process()
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        for popen in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
            if popen.stdout is not None:
                popen.stdout.close()


@pytest.fixture
def kids() -> Iterator[Kids]:
    k = Kids()
    try:
        yield k
    finally:
        k.close()


def gone(pid: int) -> bool:
    """No such process, or only a zombie that init has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_classify_table() -> None:
    assert classify(1000.0, None) == "gone"
    assert classify(1000.0, 1000.0) == "kill"
    assert classify(1000.0, 1000.01) == "kill"
    assert classify(1000.0, 999.995) == "kill"
    assert classify(1000.0, 1000.02) == "reused"
    assert classify(1000.0, 999.98) == "reused"
    assert classify(1000.0, 1500.0) == "reused"


@pytest.mark.timeout(30)
def test_process_id_matches_only_the_same_live_process(kids: Kids) -> None:
    child = kids.sleeper()
    ident = ProcessId.of(child.pid)
    assert ident is not None and ident.matches()
    proc = ident.process()
    assert proc is not None and proc.pid == child.pid
    # Same pid, another create_time: what a reused pid looks like.
    assert not ProcessId(child.pid, ident.create_time + 1.0).matches()
    assert ProcessId(child.pid, ident.create_time + 1.0).process() is None
    child.kill()
    child.wait()
    assert not ident.matches()
    assert ident.process() is None
    assert ProcessId.of(child.pid) is None


@pytest.mark.timeout(30)
def test_descendants_finds_children_and_grandchildren_only(kids: Kids) -> None:
    parent = kids.start(PARENT)
    grandchild = kids.track(int(kids.line(parent)))
    unrelated = kids.sleeper()
    found = {p.pid for p in descendants(parent.pid)}
    assert found == {grandchild}
    mine = {p.pid for p in descendants(os.getpid())}
    assert {parent.pid, grandchild, unrelated.pid} <= mine
    assert os.getpid() not in mine


@pytest.mark.timeout(30)
@pytest.mark.parametrize("leave", ["setsid", "setpgid"])
def test_descendants_finds_an_adopted_grandchild_by_its_recorded_group(
    kids: Kids, leave: str
) -> None:
    child = kids.start(DOUBLE_FORK, leave)
    grandchild = kids.track(int(kids.line(child)))
    assert child.wait(timeout=5) == 0
    assert psutil.Process(grandchild).ppid() != child.pid
    unrelated = kids.sleeper()

    assert grandchild not in {p.pid for p in descendants(os.getpid())}
    found = {p.pid for p in descendants(os.getpid(), [child.pid])}
    assert grandchild in found
    assert unrelated.pid in found  # our own child, as any descendant
    assert {p.pid for p in descendants(unrelated.pid, [child.pid])} == {grandchild}

    report = terminate_tree(unrelated.pid, 2.0, [child.pid])
    assert report.terminated == [grandchild] and not report.survivors
    assert wait_for(lambda: gone(grandchild), 2)


@pytest.mark.timeout(30)
def test_descendants_never_returns_the_caller_or_its_ancestors(kids: Kids) -> None:
    own = {os.getpgid(0), os.getsid(0)}
    found = {p.pid for p in descendants(kids.sleeper().pid, own)}
    assert os.getpid() not in found
    assert not found & {p.pid for p in psutil.Process().parents()}


@pytest.mark.timeout(30)
def test_terminate_signals_all_at_once_and_kills_the_stubborn_at_one_deadline(
    kids: Kids,
) -> None:
    stubborn = [kids.sleeper(stubborn=True) for _ in range(8)]
    polite = [kids.sleeper() for _ in range(4)]
    procs = [psutil.Process(p.pid) for p in stubborn + polite]
    grace = 1.0

    start = time.monotonic()
    report = terminate(procs, grace)
    elapsed = time.monotonic() - start

    assert sorted(report.killed) == sorted(p.pid for p in stubborn)
    assert sorted(report.terminated) == sorted(p.pid for p in polite)
    assert report.survivors == [] and report.zombies == []
    # One shared deadline: eight stubborn processes cost one grace, not eight.
    assert grace <= elapsed < grace + 1.0
    assert grace <= report.seconds <= elapsed
    for popen in stubborn + polite:
        assert not psutil.pid_exists(popen.pid), "left a zombie of ours"
    assert all(
        c.status() != psutil.STATUS_ZOMBIE for c in psutil.Process().children() if c.is_running()
    )


@pytest.mark.timeout(30)
def test_terminate_returns_as_soon_as_everyone_exited(kids: Kids) -> None:
    polite = [kids.sleeper() for _ in range(4)]
    start = time.monotonic()
    report = terminate([psutil.Process(p.pid) for p in polite], 3.0)
    assert time.monotonic() - start < 0.5
    assert report.terminated == [p.pid for p in polite]
    assert report.killed == [] and report.survivors == []


@pytest.mark.timeout(30)
def test_terminate_handles_zombies_and_vanished_processes(kids: Kids) -> None:
    exited = kids.start("print('bye')")
    assert kids.line(exited) == "bye"
    zombie = psutil.Process(exited.pid)
    assert wait_for(lambda: zombie.status() == psutil.STATUS_ZOMBIE, 5)

    vanished_popen = kids.sleeper()
    vanished = psutil.Process(vanished_popen.pid)
    vanished_popen.kill()
    vanished_popen.wait()

    keeper = kids.start(ZOMBIE_PARENT)
    foreign = int(kids.line(keeper))
    assert wait_for(lambda: psutil.Process(foreign).status() == psutil.STATUS_ZOMBIE, 5)

    live = kids.sleeper()
    procs = [zombie, vanished, psutil.Process(foreign), psutil.Process(live.pid)]
    report = terminate(procs, 3.0)

    assert report.terminated == [exited.pid, vanished.pid, foreign, live.pid]
    assert report.killed == [] and report.survivors == []
    assert report.zombies == [foreign]
    assert report.seconds < 1.0
    assert not psutil.pid_exists(exited.pid), "our zombie was not reaped"
    assert not psutil.pid_exists(live.pid)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


class FakeProcess:
    """Exits on the signals in `dies_on`; records when each signal came."""

    def __init__(self, pid: int, clock: FakeClock, dies_on: set[int]) -> None:
        self.pid, self.clock, self.dies_on = pid, clock, dies_on
        self.signals: list[tuple[float, int]] = []
        self.alive = True

    def send_signal(self, sig: int) -> None:
        if not self.alive:
            raise psutil.NoSuchProcess(self.pid)
        self.signals.append((self.clock.now, sig))
        self.alive = sig not in self.dies_on

    def wait(self, timeout: float | None = None) -> None:
        if self.alive:
            raise psutil.TimeoutExpired(timeout or 0, self.pid)

    def status(self) -> str:
        return psutil.STATUS_SLEEPING

    def ppid(self) -> int:
        return os.getpid()


def test_terminate_deadline_and_bounded_reap_on_a_fake_clock() -> None:
    clock = FakeClock()
    polite = FakeProcess(1, clock, {signal.SIGTERM})
    stubborn = FakeProcess(2, clock, {signal.SIGKILL})
    unkillable = FakeProcess(3, clock, set())  # e.g. stuck in uninterruptible sleep
    fakes: list[Any] = [polite, stubborn, unkillable]
    report = terminate(fakes, 3.0, clock=clock, sleep=clock.sleep)

    assert (report.terminated, report.killed, report.survivors) == ([1], [2], [3])
    assert [s for _, s in polite.signals] == [signal.SIGTERM]
    for fake in (stubborn, unkillable):
        terms = [t for t, s in fake.signals if s == signal.SIGTERM]
        kills = [t for t, s in fake.signals if s == signal.SIGKILL]
        assert terms == [0.0]
        assert kills == [pytest.approx(3.0)]
    assert report.seconds == pytest.approx(3.0 + REAP_BUDGET)


def test_set_pdeathsig_rejects_an_invalid_signal() -> None:
    with pytest.raises(OSError) as err:
        set_pdeathsig(9999)
    assert err.value.errno == errno.EINVAL


@pytest.mark.timeout(30)
def test_exit_if_orphaned(kids: Kids) -> None:
    code = "import os, sys\nfrom supervisor.contract.reaper import exit_if_orphaned\n"
    code += "exit_if_orphaned(os.getppid() + int(sys.argv[1]))\nprint('alive', flush=True)"
    stays = kids.start(code, "0")
    assert kids.line(stays) == "alive" and stays.wait(timeout=5) == 0
    leaves = kids.start(code, "1")
    assert leaves.wait(timeout=5) == 1
    assert leaves.stdout is not None and leaves.stdout.read() == ""
    exit_if_orphaned(os.getppid())  # does not exit this process


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("preexec", "dies"), [("new_group_with_pdeathsig", True), (None, False)])
def test_a_child_with_pdeathsig_dies_with_its_parent(
    kids: Kids, preexec: str | None, dies: bool
) -> None:
    parent = kids.start(PARENT, *([preexec] if preexec else []))
    child = kids.track(int(kids.line(parent)))
    if preexec:
        assert os.getpgid(child) == child
    parent.kill()
    parent.wait()
    if dies:
        assert wait_for(lambda: gone(child), 10.0)
    else:
        # Nothing to poll for: the control case is a child that stays.
        time.sleep(0.5)
        assert not gone(child)


@pytest.mark.timeout(30)
def test_a_child_that_sets_pdeathsig_itself_dies_with_its_parent(kids: Kids) -> None:
    setup = "from supervisor.contract.reaper import set_pdeathsig; set_pdeathsig(); "
    code = PARENT.replace('code = "', 'code = "' + setup)
    parent = kids.start(code)
    child = kids.track(int(kids.line(parent)))
    parent.kill()
    parent.wait()
    assert wait_for(lambda: gone(child), 10.0)


@pytest.mark.timeout(30)
def test_sweep_kills_matches_and_spares_reused_pids(kids: Kids) -> None:
    leader = kids.start(GROUP_LEADER, process_group=0)
    member = kids.track(int(kids.line(leader)))
    spared = kids.sleeper()
    ended = kids.sleeper()
    ended_id = ProcessId.of(ended.pid)
    assert ended_id is not None
    ended.kill()
    ended.wait()
    leader_id, spared_id = ProcessId.of(leader.pid), ProcessId.of(spared.pid)
    assert leader_id is not None and spared_id is not None

    report = sweep(
        [
            (leader.pid, leader_id.create_time),
            (spared.pid, spared_id.create_time - 5.0),
            (ended.pid, ended_id.create_time),
        ]
    )

    assert report.killed == [leader.pid]
    assert report.reused == [spared.pid]
    assert report.gone == [ended.pid]
    assert leader.wait(timeout=2) == -signal.SIGKILL
    assert wait_for(lambda: gone(member), 2.0), "the leader's group was not killed"
    assert spared.poll() is None and spared_id.matches()


def test_sweep_kills_only_what_classify_says() -> None:
    killed: list[int] = []
    me = ProcessId.of(os.getpid())
    assert me is not None
    report = sweep([(me.pid, me.create_time + 1.0)], kill=killed.append)
    assert report.reused == [me.pid] and killed == []
    report = sweep([(me.pid, me.create_time)], kill=killed.append)
    assert report.killed == [me.pid] and killed == [me.pid]
