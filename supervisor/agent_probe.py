"""Agent classes loaded by the worker's own loader in a child process, so that whatever an
agent module's import does (exit, crash, hang, print) happens there, not in `run` or
`doctor`.

The child (`main`) gets the parent's sys.path and the classes on its command line and
writes one JSON line {"spec", "error"} per class as soon as it is loaded: if an import
ends the child, the parent knows which one did. The module's own output goes to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

from supervisor.contract.clock import SYSTEM

AGENT_LOAD_TIMEOUT = 60.0  # seconds the imports may take in one child


class Probe:
    """One child loading `specs` in turn, started at once (it runs while the caller works)."""

    def __init__(
        self, specs: list[str], environ: Mapping[str, str], timeout: float = AGENT_LOAD_TIMEOUT
    ) -> None:
        self.specs = specs
        self.timeout = timeout
        self.deadline = SYSTEM.monotonic() + timeout
        request = json.dumps({"path": sys.path, "specs": specs})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, request],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={name: value for name, value in environ.items() if name != "NOTIFY_SOCKET"},
        )

    def answers(self) -> dict[str, str]:
        """spec -> why it cannot be loaded ("" when it can), for at least the first spec:
        the one an import that ended the child is blamed on."""
        try:
            output, stderr = self.proc.communicate(
                timeout=max(0.0, self.deadline - SYSTEM.monotonic())
            )
            ended = _ended(self.proc.returncode, stderr)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
            ended = f"did not finish within {self.timeout:g} s"
        errors: dict[str, str] = {}
        for line in output.decode(errors="replace").splitlines():
            answer = json.loads(line)
            errors[answer["spec"]] = answer["error"]
        left = [spec for spec in self.specs if spec not in errors]
        if left:
            errors[left[0]] = f"importing it {ended}"
        return errors

    def stop(self) -> None:
        """Kill the child if it still runs (its answers are no longer wanted) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def load_agents(first: Probe, environ: Mapping[str, str]) -> dict[str, str]:
    """spec -> why the worker's loader cannot load it ("" when it can), for each of the
    specs of `first`, a probe already started.

    A module whose import ends its child is blamed, and the specs after it are tried in a
    fresh one (with `environ`, as `first` was).
    """
    specs = first.specs
    errors = first.answers()
    while len(errors) < len(specs):
        left = [spec for spec in specs if spec not in errors]
        errors |= Probe(left, environ).answers()
    return errors


def _ended(code: int, stderr: bytes) -> str:
    """How a child ended before answering for every class, for the message."""
    if code < 0:
        how = f"killed the process ({signal.Signals(-code).name})"
    else:
        how = f"ended the process (exit status {code})"
    last = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return f"{how}: {last[-1].strip()}" if last else how


def main() -> None:
    """The child: load each class named on the command line; answer on the original stdout."""
    from supervisor.contract.reaper import set_pdeathsig

    set_pdeathsig(signal.SIGKILL)  # never outlive the check that started it
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what an agent module prints cannot be taken for an answer
    request = json.loads(sys.argv[1])
    sys.path[:] = request["path"]  # as a spawned worker has it
    from workers.agent import AgentLoadError, load_agent_class

    for spec in request["specs"]:
        try:
            load_agent_class(spec)
            error = ""
        except AgentLoadError as exc:
            error = str(exc).removeprefix(f"agent.class {spec!r}: ")
        answers.write(json.dumps({"spec": spec, "error": error}) + "\n")
        answers.flush()
    os._exit(0)  # a thread or an atexit hook an agent module left must not hold the check


if __name__ == "__main__":
    main()
