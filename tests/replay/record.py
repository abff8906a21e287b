"""Record session event logs from a real daemon, for the replay tests.

Run by hand from the repository's root, with the project's virtualenv:

    .venv/bin/python -m tests.replay.record

It starts one daemon (`tests.daemon.Daemon`: two workers, the `ChaosAgent` of
`tests.agents`, the echo model, the attempt schedule shortened to 0, 0.5 and 1 s) in a
temporary directory, plays the scenarios below against it with real signals, as
`tests/pool/test_chaos.py` does, stops it cleanly, and writes every session's event log
(seq, type, turn id, payload, created_at, writer, lease token) and its final session row
to `tests/replay/logs/<scenario>.json`, each file headed by what produced it. Machine
values are stripped: the temporary directory becomes `<tmp>` wherever a payload holds it,
and lease owners (host id, boot, worker) are not written. It takes under a minute.
Arguments: scenario names to record only those (all by default), and `--out DIR`.

Scenarios (one file each):

- multi_turn: a session of four turns, no fault: a plain answer, a tool call and its
  result, an answer cut at the token limit that its own worker continues until the
  attempts are spent (`max_tokens` notes), and a last plain answer.
- worker_sigkill: turns whose worker is SIGKILLed mid-turn: one held at a gate and
  continued by another worker (`worker_crash`); one with a user message queued behind
  it, which drives the next turn instead; one that kills its worker again at every start,
  which gets a resend notice (unsafe tail), then the user's resend.
- tool_in_flight: a worker SIGKILLed while a tool call runs (`tool_call` committed, no
  `tool_result`): the next owner repairs the call's result and continues the turn.
- daemon_sigkill: the daemon SIGKILLed with two turns in flight (one held at a gate, one
  inside a tool call); the next boot continues both (`daemon_restart`), then one more turn.

After recording, run `tests/replay/test_replay_logs.py` with TURNKEEPER_REPLAY_UPDATE=1
once to write the judgements of the new logs (`*.expected.json`), and read their diff.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import __version__
from supervisor.store import EventRecord, Store
from tests.daemon import Daemon, inject, wait_until

LOGS = Path(__file__).resolve().parent / "logs"
FORMAT = 1
TURN_TIMEOUT = 60.0
DAEMON_CONFIG: dict[str, dict[str, Any]] = {
    "pool": {"workers": 2, "spare": 0},
    "recovery": {"attempt_delays": [0.0, 0.5, 1.0], "freshness": 3600.0},
    "model": {"max_tokens": 1024},
}


@dataclass
class Recorded:
    """The sessions of one scenario, by the name the log gives each."""

    scenario: str
    description: str
    sessions: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (id, what)


def turn_ended_after(store: Store, session_id: str, after: int) -> EventRecord | None:
    """The first `turn_ended` after seq `after`."""
    found = store.events.read(session_id, after=after, limit=100_000)
    return next((e for e in found if e.type == "turn_ended"), None)


def has(store: Store, session_id: str, type: str, after: int = 0) -> bool:
    return any(e.type == type for e in store.events.read(session_id, after=after, limit=100_000))


def answered(store: Store, session_id: str, after: int) -> EventRecord:
    """Wait for the first `turn_ended` after seq `after`: the turn that read it ended."""
    return wait_until(
        lambda: turn_ended_after(store, session_id, after), TURN_TIMEOUT, "a turn to end"
    )


def completed_after(store: Store, session_id: str, after: int) -> bool:
    """Whether a turn that ended `completed` ended after seq `after`."""
    return any(
        e.type == "turn_ended" and e.payload.get("outcome") == "completed"
        for e in store.events.read(session_id, after=after, limit=100_000)
    )


def at_rest(store: Store, session_id: str) -> bool:
    info = store.sessions.get(session_id)
    return info.status != "open" or (info.active_turn_id is None and not info.pending)


def kill_owner(daemon: Daemon, store: Store, session_id: str) -> None:
    """SIGKILL the worker that owns the session now."""
    pid = wait_until(lambda: daemon.owner_pid(store, session_id), 20, "the session's owner")
    os.kill(pid, signal.SIGKILL)


def multi_turn(daemon: Daemon, store: Store, root: Path) -> Recorded:
    sid = store.sessions.create("admin").id
    for text in (
        "hello there",
        '/tool echo {"text": "a tool call and its result"}',
        "/long a reply that the token limit cuts in two, continued by its own worker",
        "goodbye",
    ):
        seq = inject(store, sid, text)
        answered(store, sid, seq)
    return Recorded(
        "multi_turn",
        "four turns with no fault: an answer, a tool call, a cut answer its worker continues "
        "(max_tokens) until the attempts are spent, an answer",
        {"conversation": (sid, "four turns, one after the other")},
    )


def worker_sigkill(daemon: Daemon, store: Store, root: Path) -> Recorded:
    # A turn held at a gate, its worker killed, the gate opened: continued elsewhere.
    held = store.sessions.create("admin").id
    gate = root / "gate-held"
    seq = inject(store, held, f"/gate {gate} held when its worker was killed")
    wait_until(lambda: has(store, held, "turn_started", seq), 20, "the held turn to start")
    kill_owner(daemon, store, held)
    gate.touch()
    answered(store, held, seq)

    # A turn held for good, a message queued behind it, then its worker killed: the queued
    # message drives the next turn and the held one ends interrupted.
    queued = store.sessions.create("admin").id
    first = inject(store, queued, f"/gate {root / 'gate-never'} never opened")
    wait_until(lambda: has(store, queued, "turn_started", first), 20, "the first turn to start")
    second = inject(store, queued, "the message queued behind it")
    time.sleep(0.3)  # the owner is told of it (a wake), and keeps its turn held
    kill_owner(daemon, store, queued)
    wait_until(lambda: completed_after(store, queued, second), TURN_TIMEOUT, "the next turn")

    # A turn that kills its worker at every start: one continuation, then a resend notice
    # (a note would follow a note); the user sends again and is answered.
    unsafe = store.sessions.create("admin").id
    seq = inject(store, unsafe, "/crash-at-start")
    wait_until(lambda: has(store, unsafe, "notice", seq), TURN_TIMEOUT, "the resend notice")
    again = inject(store, unsafe, "sent again after the notice")
    answered(store, unsafe, again)
    return Recorded(
        "worker_sigkill",
        "workers SIGKILLed mid-turn: a turn continued by another worker (worker_crash); a "
        "turn whose queued user message drives the next one instead; a turn that kills its "
        "worker at each start, ended with a resend notice, then answered when sent again",
        {
            "continued": (held, "held at a gate, its worker killed, continued elsewhere"),
            "queued_message": (queued, "held for good, a message queued, its worker killed"),
            "unsafe_tail": (unsafe, "/crash-at-start: continued once, then a resend notice"),
        },
    )


def tool_in_flight(daemon: Daemon, store: Store, root: Path) -> Recorded:
    sid = store.sessions.create("admin").id
    seq = inject(store, sid, '/tool sleep {"seconds": 60}')
    wait_until(lambda: has(store, sid, "tool_call", seq), 20, "the tool call to start")
    kill_owner(daemon, store, sid)
    answered(store, sid, seq)
    after = inject(store, sid, "and one more turn")
    answered(store, sid, after)
    return Recorded(
        "tool_in_flight",
        "a worker SIGKILLed while a tool call runs: the next owner repairs the call's result "
        "(interrupted) and continues the turn (worker_crash); then one more turn",
        {"tool_call": (sid, "a 60 s sleep tool call, its worker killed during it")},
    )


def daemon_sigkill(daemon: Daemon, store: Store, root: Path) -> Recorded:
    held = store.sessions.create("admin").id
    gate = root / "gate-daemon"
    held_seq = inject(store, held, f"/gate {gate} held when the daemon was killed")
    tool = store.sessions.create("admin").id
    tool_seq = inject(store, tool, '/tool sleep {"seconds": 60}')
    wait_until(lambda: has(store, held, "turn_started", held_seq), 20, "the held turn")
    wait_until(lambda: has(store, tool, "tool_call", tool_seq), 20, "the tool call")
    daemon.signal(signal.SIGKILL)  # its workers die with it (parent-death signal)
    daemon.wait(10)
    gate.touch()
    daemon.start()
    answered(store, held, held_seq)
    answered(store, tool, tool_seq)
    after = inject(store, held, "a turn after the restart")
    answered(store, held, after)
    return Recorded(
        "daemon_sigkill",
        "the daemon SIGKILLed with two turns in flight, one held at a gate and one inside a "
        "tool call; the next boot continues both (daemon_restart); then one more turn",
        {
            "held": (held, "held at a gate when the daemon was killed, then one more turn"),
            "tool_call": (tool, "inside a 60 s sleep tool call when the daemon was killed"),
        },
    )


SCENARIOS: dict[str, Callable[[Daemon, Store, Path], Recorded]] = {
    "multi_turn": multi_turn,
    "worker_sigkill": worker_sigkill,
    "tool_in_flight": tool_in_flight,
    "daemon_sigkill": daemon_sigkill,
}


def scrub(value: Any, replacements: list[tuple[str, str]]) -> Any:
    """`value` with every machine-specific string in its strings replaced."""
    if isinstance(value, str):
        for old, new in replacements:
            value = value.replace(old, new)
        return value
    if isinstance(value, dict):
        return {k: scrub(v, replacements) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, replacements) for v in value]
    return value


def session_log(store: Store, session_id: str, name: str, what: str) -> dict[str, Any]:
    """One session's events and final row, as the log file holds them."""
    found = store.events.read(session_id, limit=1_000_000)
    assert [e.seq for e in found] == list(range(1, len(found) + 1)), "seqs not contiguous"
    info = store.sessions.get(session_id)
    return {
        "name": name,
        "description": what,
        "id": session_id,
        "kind": info.kind,
        "row": {
            "status": info.status,
            "last_seq": info.last_seq,
            "pending": bool(info.pending),
            "active_turn_id": info.active_turn_id,
            "attempt_turn_id": info.attempt_turn_id,
            "attempt_count": info.attempt_count,
            "quarantine_reason": info.quarantine_reason,
            "resend_requested": info.resend_requested_at is not None,
        },
        "events": [
            {
                "seq": e.seq,
                "type": e.type,
                "turn_id": e.turn_id,
                "payload": e.payload,
                "created_at": e.created_at,
                "writer": e.writer,
                "lease_token": e.lease_token,
            }
            for e in found
        ],
    }


def record(names: list[str], out: Path) -> list[Path]:
    with tempfile.TemporaryDirectory(prefix="turnkeeper-replay-") as tmp:
        root = Path(tmp).resolve()
        daemon = Daemon(root / "daemon", **DAEMON_CONFIG)
        recorded: list[Recorded] = []
        try:
            daemon.start()
            with Store(daemon.url, migrate=False) as store:
                for name in names:
                    print(f"recording {name} ...", flush=True)
                    started = time.monotonic()
                    recorded.append(SCENARIOS[name](daemon, store, root))
                    ids = [sid for sid, _ in recorded[-1].sessions.values()]
                    wait_until(lambda: all(at_rest(store, s) for s in ids), 30, "rest")  # noqa: B023
                    print(f"  {time.monotonic() - started:.1f} s", flush=True)
            daemon.signal(signal.SIGTERM)
            if daemon.wait(30) != 0:
                raise SystemExit(f"the daemon did not stop cleanly:\n{daemon.log()[-3000:]}")
        except BaseException:
            print(daemon.log()[-5000:], file=sys.stderr)
            raise
        finally:
            daemon.kill_everything()
        replacements = [(str(root), "<tmp>"), (tmp, "<tmp>")]
        if len(socket.gethostname()) >= 4:  # a shorter name would match ordinary words
            replacements.append((socket.gethostname(), "<host>"))
        written = []
        with Store(daemon.url, migrate=False) as store:
            for r in recorded:
                log = {
                    "format": FORMAT,
                    "scenario": r.scenario,
                    "description": r.description,
                    "recorded_by": "tests/replay/record.py",
                    "turnkeeper": __version__,
                    "config": DAEMON_CONFIG,
                    "agent": "tests.agents:ChaosAgent",
                    "model": "echo",
                    "sessions": [
                        session_log(store, sid, name, what)
                        for name, (sid, what) in r.sessions.items()
                    ],
                }
                path = out / f"{r.scenario}.json"
                path.write_text(json.dumps(scrub(log, replacements), indent=1) + "\n")
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help=f"of {', '.join(SCENARIOS)} (all)")
    parser.add_argument("--out", type=Path, default=LOGS, help="where the logs go")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenarios) - SCENARIOS.keys())
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in record(args.scenarios or list(SCENARIOS), args.out):
        print(f"wrote {path.name} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
