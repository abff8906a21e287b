"""A task's run as both sides see it: the spec the supervisor hands a task's runner, how
it starts one (`launch`), and what the output file holds (`Output`).

The runner (`python -m supervisor.tasks.runner`) runs one background task's command and
commits its outcome itself, so it lives in a session of its own and does not die with the
daemon: a task that ends while no daemon runs still has its outcome recorded. The next
boot's sweep kills a runner an earlier boot left (the supervisor records it in the child
registry; the runner records its command there too).

The spec travels as JSON on the runner's stdin, never in its arguments or environment:
the store URL may hold a password. The runner's own environment is `child_environment`'s
(and PYTHONPATH, to import this package): no secret of the daemon reaches it or the
command. Its stderr, its log, goes to `<output>.runner`, a file, so that nobody has to
read a pipe of it.

The output file holds the command's output (stdout and stderr as they came) up to
`max_output` bytes; of a longer output, its first bytes, a line `[turnkeeper: N bytes of
output dropped here]`, then its last bytes (at most 64 KiB, a quarter of `max_output`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from supervisor.contract.mcp_env import child_environment
from supervisor.contract.paths import make_private_dir
from supervisor.tasks import rules

RUNNER_MODULE = "supervisor.tasks.runner"
RUNNER_LOG_SUFFIX = ".runner"  # the runner's stderr: `<output>.runner`
RUNNER_ENV = ("PYTHONPATH",)  # what the runner needs beyond child_environment, to import us
HELD_BYTES = 64 * 1024  # at most, of the output's end held in memory past max_output
RECENT_BYTES = 4 * rules.TAIL_CHARS  # the newest output, for the outcome's tail


@dataclass(frozen=True)
class RunnerSpec:
    """One run (attempt) of one task, as its runner needs it (plain data)."""

    task: str  # the task's id
    attempt: int  # the row's attempt this run is; the runner writes only while it still is
    argv: Sequence[str]  # the command, placeholders filled in; run with no shell
    env: Mapping[str, str]  # on top of child_environment's (`child_environment(kind.env)`)
    cwd: str  # the command's working directory
    timeout: float  # seconds the command may run before it is stopped (`timed_out`)
    kill_grace: float  # seconds from SIGTERM to SIGKILL when its group is stopped
    max_output: int  # bytes of output kept in the output file (its head and its tail)
    output: str  # the output file (0600; its directory is made 0700)
    store_url: str = field(repr=False)  # may hold a password: never in argv or a log
    heartbeat: float  # seconds between two renewals of the row's heartbeat
    boot: str  # the daemon's boot id and host id, the command is recorded under them
    host: str
    create_cwd: bool = False  # `cwd` is the task's own directory: made (0700) if missing
    lost_grace: float = 0.0  # tasks.lost_grace: the runner fences itself before (0: never)
    # The soft RLIMIT_NOFILE the daemon started with: the runner takes it back before it
    # starts the command (0: keep the inherited one; `supervisor.contract.fdlimit`).
    nofile_soft: int = 0

    def to_json(self) -> str:
        """The spec as the runner reads it on its stdin."""
        data = {item.name: getattr(self, item.name) for item in fields(self)}
        data["argv"], data["env"] = list(self.argv), dict(self.env)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunnerSpec:
        """The spec `to_json` wrote; ValueError saying what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"the task spec is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("the task spec must be a JSON object")
        missing = sorted(set(_TYPES) - set(data) - {"create_cwd", "lost_grace", "nofile_soft"})
        unknown = sorted(set(data) - set(_TYPES))
        if missing or unknown:
            raise ValueError(f"the task spec lacks {missing} or has unknown fields {unknown}")
        for name, kind in _TYPES.items():
            value = data.get(name)
            if name in data and not _is(value, kind):
                raise ValueError(f"the task spec's {name!r} must be {kind.__name__}")
        argv, env = data["argv"], data["env"]
        if not argv or not all(isinstance(part, str) for part in argv):
            raise ValueError("the task spec's 'argv' must be a non-empty list of strings")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("the task spec's 'env' must map strings to strings")
        if data["timeout"] <= 0 or data["heartbeat"] <= 0 or data["kill_grace"] < 0:
            raise ValueError("the task spec's timeout and heartbeat must be positive")
        if data["max_output"] < 0 or not data["output"]:
            raise ValueError("the task spec needs an output file and max_output >= 0")
        return cls(**{**data, "argv": tuple(argv), "env": dict(env)})

    @property
    def runner_log(self) -> Path:
        """Where the runner's stderr goes."""
        return Path(self.output + RUNNER_LOG_SUFFIX)


_TYPES: dict[str, type] = {
    "task": str,
    "attempt": int,
    "argv": list,
    "env": dict,
    "cwd": str,
    "timeout": float,
    "kill_grace": float,
    "max_output": int,
    "output": str,
    "store_url": str,
    "heartbeat": float,
    "boot": str,
    "host": str,
    "create_cwd": bool,
    "lost_grace": float,
    "nofile_soft": int,
}


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def heartbeat_of(lost_grace: float) -> float:
    """Seconds between two heartbeats of a runner: a sixth of `tasks.lost_grace`, at most
    5 s, so that a runner is missed only after several tries."""
    return min(5.0, lost_grace / 6)


def fence_of(lost_grace: float, heartbeat: float) -> float:
    """Seconds since the start of the last heartbeat that went through after which a
    runner SIGKILLs its command by itself (and records nothing): a heartbeat and a second
    before `lost_grace` runs out and the task may be judged lost, and started again, by any
    daemon."""
    return max(heartbeat, lost_grace - heartbeat - 1.0)


def output_path(state_dir: Path, task_id: str) -> Path:
    """Where a task's runner writes its output, under the state directory of the host that
    ran it (the daemon that starts the runner and the API that reads it agree on it here)."""
    return state_dir / "tasks" / f"{task_id}.log"


def launch(spec: RunnerSpec) -> subprocess.Popen[bytes]:
    """Start the runner of `spec` and hand it the spec; returns its process.

    Blocking (call it off the event loop): it writes the spec to the runner's stdin, which
    may wait for the runner to read it. The runner leads a session of its own and has no
    parent-death signal; its parent has to reap it (`wait`/`poll` the returned process).
    Raises OSError if the runner cannot be started or exits before it read its spec.
    """
    log_path = spec.runner_log
    make_private_dir(log_path.parent)
    env = child_environment({name: os.environ[name] for name in RUNNER_ENV if name in os.environ})
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    # SIGUSR1 blocked in the runner until it has its handler (the thread's mask is what the
    # child starts with, across exec): a cancel sent at once waits for it, pending.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", RUNNER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(log)
    assert proc.stdin is not None
    try:
        with proc.stdin:
            proc.stdin.write(spec.to_json().encode())
    except BrokenPipeError:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise OSError(
            f"the task runner exited (status {proc.returncode}) before it read its spec; "
            f"see {log_path}"
        ) from None
    return proc


class Output:
    """The output file being written: its first bytes, `limit` in all at most; past that
    only the end is held in memory, written at `close` after a line saying what was
    dropped. A write error is told to `say` once; the rest is then not kept."""

    def __init__(self, path: Path, limit: int, say: Callable[[str], None]) -> None:
        make_private_dir(path.parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self._fd: int | None = os.open(path, flags, 0o600)
        os.fchmod(self._fd, 0o600)  # a file an earlier attempt left keeps its mode otherwise
        self._held_max = min(HELD_BYTES, limit // 4)
        self._head_room = limit - self._held_max
        self._written = 0
        self._held = bytearray()
        self._recent = bytearray()
        self.dropped = 0
        self._say = say

    def write(self, data: bytes) -> None:
        self._recent += data
        del self._recent[:-RECENT_BYTES]
        room = self._head_room - self._written
        if room > 0:
            self._put(data[:room])
            data = data[room:]
        if data:
            self._held += data
            excess = len(self._held) - self._held_max
            if excess > 0:
                self.dropped += excess
                del self._held[:excess]

    def close(self) -> None:
        if self.dropped:
            self._put(f"\n[turnkeeper: {self.dropped} bytes of output dropped here]\n".encode())
        self._put(bytes(self._held))
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def tail(self) -> str:
        """The end of the output as text, for the outcome."""
        return rules.tail(self._recent.decode("utf-8", "replace"))

    def _put(self, data: bytes) -> None:
        self._written += len(data)
        view = memoryview(data)
        while view and self._fd is not None:
            try:
                view = view[os.write(self._fd, view) :]
            except OSError as exc:
                self._say(f"the output file cannot be written ({exc}): the rest is not kept")
                os.close(self._fd)
                self._fd = None
