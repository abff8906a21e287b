"""Finding, stopping and reaping every descendant of turnkeeper.

Shutdown (DESIGN section 7) stops all descendants the same way: SIGTERM to all of them at
once, one shared deadline, SIGKILL to the rest, then a bounded reap so that no zombie of
ours is left. Boot (section 8) sweeps the children an earlier boot recorded as
(pid, create_time): a pid is trusted only while its create_time still matches, because the
kernel reuses pids.

Groups and sessions: MCP children live in their own process group
(`new_group_with_pdeathsig`), so a grandchild reparented to init is still found through its
group. A child that calls setsid() leaves its group for a new session whose id is its own
pid; callers record such pids among the "groups" too, and `descendants` matches each
recorded id against both the process group and the session of every process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import psutil

from supervisor.contract.clock import SYSTEM

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CREATE_TIME_TOLERANCE = 0.01
"""Seconds; psutil's create_time counts in clock ticks (10 ms)."""
REAP_BUDGET = 1.0
"""Seconds `terminate` waits after SIGKILL before it reports survivors."""

Clock = Callable[[], float]
Sleep = Callable[[float], None]
Verdict = Literal["kill", "gone", "reused"]

# Resolved at import: set_pdeathsig runs as a preexec_fn between fork and exec, where
# loading a library could deadlock on a lock another thread held at fork time.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Have Linux send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG).

    The "parent" is the thread that forked this process: the signal also comes when that
    thread exits while the parent process lives on. The setting is cleared by a fork (in
    the new child) and kept across exec. Raises OSError if the kernel refuses.
    """
    if _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def become_subreaper() -> None:
    """Adopt orphaned descendants (prctl PR_SET_CHILD_SUBREAPER).

    A process that leaves its group with setsid() and whose parent then exits would be
    re-parented to init, out of reach of the shutdown; as a subreaper, this process gets
    it instead, so `descendants()` still finds it and it can be reaped.
    """
    if _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def own_children() -> list[int]:
    """The pids of this process's children, exited ones (zombies) included.

    Read from the kernel's own lists, /proc/self/task/<tid>/children (one per thread: a
    child is listed under the thread that forked it, an adopted orphan under the one the
    kernel chose), so the cost is that of our children, never a scan of every process on
    the host. Where the kernel keeps no such list, psutil finds them by a scan.
    """
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        threads = []
    found: list[int] = []
    listed = False
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found += [int(pid) for pid in f.read().split()]
        except OSError:
            continue  # the thread ended meanwhile, or the kernel keeps no list
        listed = True
    if listed:
        return found
    try:
        return [proc.pid for proc in psutil.Process().children()]
    except psutil.Error:
        return []


def reap_orphans(keep: Iterable[int]) -> list[int]:
    """Reap exited children of ours that nobody else waits for; returns their pids.

    `keep` are children whose owner reaps them itself (the pool's workers): their exit
    status is left for it. Cheap enough to run on every SIGCHLD (see `own_children`).
    """
    kept = set(keep)
    reaped: list[int] = []
    for pid in own_children():
        if pid in kept:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
        except ChildProcessError:
            continue  # reaped by its own waiter meanwhile
    return reaped


def exit_if_orphaned(expected_parent: int) -> None:
    """Exit at once (status 1) unless the parent is still `expected_parent`.

    Call it after `set_pdeathsig`: a parent that died before the prctl sends no signal.
    """
    if os.getppid() != expected_parent:
        os._exit(1)


def new_group_with_pdeathsig() -> None:
    """A `preexec_fn` for a child that lives in its own process group and dies with us.

    `subprocess.Popen(..., preexec_fn=new_group_with_pdeathsig)` runs it in the child after
    fork and before exec: the child leads a new process group (so that the group can be
    signalled and swept as one), gets SIGKILL when the thread that started it dies, and
    exits if that parent is already gone. It keeps to calls that are safe after a fork.
    """
    parent = os.getppid()
    os.setpgid(0, 0)
    set_pdeathsig(signal.SIGKILL)
    exit_if_orphaned(parent)


def _same_time(a: float, b: float) -> bool:
    return abs(a - b) <= CREATE_TIME_TOLERANCE


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


@dataclass(frozen=True)
class ProcessId:
    """A process named safely against pid reuse: its pid and its psutil create_time."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """The identity of process `pid` now, or None if there is no such process."""
        created = _create_time(pid)
        return None if created is None else cls(pid, created)

    def process(self) -> psutil.Process | None:
        """A handle on this very process, or None if it is gone or its pid was reused."""
        try:
            proc = psutil.Process(self.pid)
            same = _same_time(proc.create_time(), self.create_time)
        except psutil.NoSuchProcess:
            return None
        return proc if same else None

    def matches(self) -> bool:
        """Whether the pid still names the process it named when this identity was taken."""
        return self.process() is not None


def _in_groups(pid: int, groups: set[int]) -> bool:
    try:
        return os.getpgid(pid) in groups or os.getsid(pid) in groups
    except OSError:
        return False


def descendants(root_pid: int, extra_pgids: Iterable[int] = ()) -> list[psutil.Process]:
    """Every live descendant of `root_pid`, and every process in one of `extra_pgids`.

    A process belongs to a recorded id when its process group or its session has that id;
    this finds daemonized grandchildren that init adopted. Pass only groups turnkeeper
    created. Never returned: root itself, the calling process and its ancestors.
    """
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in psutil.Process(root_pid).children(recursive=True):
            found[proc.pid] = proc
    groups = set(extra_pgids)
    if groups:
        for proc in psutil.process_iter():
            # getpgid(0) and getsid(0) would describe the calling process.
            if proc.pid > 0 and proc.pid not in found and _in_groups(proc.pid, groups):
                found[proc.pid] = proc
    me = psutil.Process()
    for pid in (root_pid, me.pid, *(p.pid for p in me.parents())):
        found.pop(pid, None)
    return list(found.values())


def own_tasks(rows: Iterable[tuple[int, float]]) -> set[int]:
    """The pids of `rows`, recorded as (pid, create_time), that are still the same process
    and a descendant of this one: what a restart in place (the same process, re-executed)
    left running on purpose. A crash's leftovers are init's, never ours."""
    recorded = list(rows)
    if not recorded:
        return set()  # the usual boot: no process tree to walk
    mine = with_descendants([os.getpid()])
    return {
        pid
        for pid, created in recorded
        if pid in mine and classify(created, _create_time(pid)) == "kill"
    }


def with_descendants(pids: Iterable[int]) -> set[int]:
    """`pids` and every live descendant of theirs (a task runner and its command's tree)."""
    found = set(pids)
    for pid in list(found):
        with contextlib.suppress(psutil.Error):
            found.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return found


@dataclass(frozen=True)
class TerminateReport:
    """What `terminate` did; every list holds pids in the order they were given."""

    terminated: list[int]
    """Gone without SIGKILL (including those already gone before the SIGTERM)."""
    killed: list[int]
    """Still alive at the deadline, SIGKILLed, and then gone."""
    survivors: list[int]
    """Still alive after SIGKILL and the reap budget (or not ours to signal)."""
    seconds: float
    zombies: list[int] = field(default_factory=list)
    """Exited, but left as zombies by a parent that is not us; also in the lists above."""


_State = Literal["running", "gone", "zombie"]


def _state(proc: psutil.Process) -> _State:
    try:
        proc.wait(timeout=0)  # reaps it when it is our child
        return "gone"
    except psutil.TimeoutExpired:
        pass
    try:
        if proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid():
            return "zombie"
    except psutil.NoSuchProcess:
        return "gone"
    # A zombie of ours that waitpid just missed is reaped on the next round.
    return "running"


def _signal(proc: psutil.Process, sig: int) -> bool:
    """Send `sig`; False when the process is gone (or its pid already reused)."""
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        pass
    return True


def _settle(
    pending: list[psutil.Process],
    until: float,
    zombies: list[int],
    clock: Clock,
    sleep: Sleep,
    poll: float,
) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """Poll until every process exited or `until`; returns (exited, still running)."""
    exited: list[psutil.Process] = []
    while True:
        running = []
        for proc in pending:
            state = _state(proc)
            if state == "running":
                running.append(proc)
                continue
            exited.append(proc)
            if state == "zombie":
                zombies.append(proc.pid)
        pending = running
        now = clock()
        if not pending or now >= until:
            return exited, pending
        sleep(min(poll, until - now))


def terminate(
    procs: Sequence[psutil.Process],
    grace: float,
    *,
    clock: Clock = SYSTEM.monotonic,
    sleep: Sleep = SYSTEM.sleep_blocking,
    poll: float = 0.02,
) -> TerminateReport:
    """SIGTERM all `procs` at once, SIGKILL those alive `grace` seconds later, reap ours.

    Our direct children are reaped (no zombie is left); other processes only have to be
    gone, or be zombies of another parent (reported in `zombies`). Processes may vanish at
    any moment. Returns after at most `grace` + `REAP_BUDGET` seconds plus one poll.
    """
    start = clock()
    order = {proc.pid: i for i, proc in enumerate(procs)}
    gone: list[psutil.Process] = []
    pending: list[psutil.Process] = []
    for proc in procs:
        alive = _signal(proc, signal.SIGTERM)
        # A stopped process acts on SIGTERM only once continued (systemd does the same).
        alive = alive and _signal(proc, signal.SIGCONT)
        (pending if alive else gone).append(proc)
    zombies: list[int] = []
    exited, pending = _settle(pending, start + grace, zombies, clock, sleep, poll)
    for proc in pending:
        _signal(proc, signal.SIGKILL)
    killed, survivors = _settle(pending, clock() + REAP_BUDGET, zombies, clock, sleep, poll)

    def pids(group: Iterable[psutil.Process]) -> list[int]:
        return sorted((p.pid for p in group), key=order.__getitem__)

    return TerminateReport(
        terminated=pids([*gone, *exited]),
        killed=pids(killed),
        survivors=pids(survivors),
        seconds=clock() - start,
        zombies=sorted(zombies, key=order.__getitem__),
    )


def terminate_tree(
    root_pid: int,
    grace: float,
    extra_pgids: Iterable[int] = (),
    *,
    clock: Clock = SYSTEM.monotonic,
    sleep: Sleep = SYSTEM.sleep_blocking,
) -> TerminateReport:
    """`terminate` every process `descendants(root_pid, extra_pgids)` finds (not root)."""
    return terminate(descendants(root_pid, extra_pgids), grace, clock=clock, sleep=sleep)


def classify(expected_create_time: float, actual: float | None) -> Verdict:
    """Decide about a recorded pid: "kill" it (same process), it is "gone", or "reused"."""
    if actual is None:
        return "gone"
    return "kill" if _same_time(actual, expected_create_time) else "reused"


def kill_leftover(pid: int) -> None:
    """SIGKILL `pid`, and its process group too when it leads one; a vanished pid is fine."""
    leader = False
    with contextlib.suppress(OSError):
        leader = os.getpgid(pid) == pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if leader:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


@dataclass(frozen=True)
class SweepReport:
    """What `sweep` found for each recorded pid."""

    killed: list[int]
    gone: list[int]
    reused: list[int]
    """Pids now naming another process; left alone."""


def sweep(
    rows: Iterable[tuple[int, float]], *, kill: Callable[[int], None] = kill_leftover
) -> SweepReport:
    """Kill the leftovers an earlier boot recorded as (pid, create_time), if still the same.

    The check and the kill are two steps: a pid that exits and is reused in between would
    be hit, a window of microseconds that only pidfds could close.
    """
    found: dict[Verdict, list[int]] = {"kill": [], "gone": [], "reused": []}
    for pid, create_time in rows:
        verdict = classify(create_time, _create_time(pid))
        if verdict == "kill":
            kill(pid)
        found[verdict].append(pid)
    return SweepReport(killed=found["kill"], gone=found["gone"], reused=found["reused"])
