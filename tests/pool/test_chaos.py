"""Chaos: SIGKILL the supervisor and its workers while a client keeps injecting.

A real daemon (slow echo model, a real MCP server, 2 workers + 1 spare) serves 20
sessions. One thread injects messages into random sessions through the HTTP API, each
with its own Idempotency-Key, and retries the very same request until it gets a 202.
Some messages start one or two subagents (`/subagent TASK` lines), whose results come
back to their parents as input that a parent answers in a turn of its own.
Meanwhile the test SIGKILLs the supervisor (then starts it again on the same state dir)
or a ready worker, 30 times at random moments, and interrupts a turn in flight now and
then through `POST /interrupt` (a parent's turn, which cancels its children, or a
child's). At the end the daemon is brought to rest, stopped cleanly, and its database
must show that nothing acknowledged was lost or duplicated, that no reply was given
twice, that every message and every subagent result that wakes its parent was answered
or the user was asked to resend, that no operator-interrupted turn was resumed, and that
every subagent was spawned once for its tool call, reported to its parent exactly once,
and, when it completed, answered its own task.

The seed is printed; TURNKEEPER_CHAOS_SEED=N reruns the same plan (which session, which
message, which kill when). The daemon's own timing is not seeded, so a rerun hits
similar, not identical, interleavings.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.store import EventRecord, Store
from tests.daemon import Daemon, daemons, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]

SEED = int(os.environ.get("TURNKEEPER_CHAOS_SEED", "20261129"))
SESSIONS = 20
KILLS = 30
SUPERVISOR_KILLS = 6  # of the 30; each costs a boot (~5 s with the MCP SDK on 2 cores)
INTERRUPTS = 3
PAUSE = (0.3, 2.0)  # seconds between kills
MODEL_DELAY = 0.25  # seconds added to every echo model call
IDLE_TIMEOUT = 60.0  # at the end: every session at rest (even with a 30 s attempt due)
TOOL_OFFSET = 1_000_000  # `add(n, TOOL_OFFSET)`: a tool result that names its message
# A notice that asks the user to send the message again (quarantine, unsafe tail, stale).
RESEND = re.compile(r"\bresend\b|\bsend\b.{0,40}\bagain\b", re.IGNORECASE)
OPERATOR = "interrupted_by_operator"
WORK = frozenset({"model_response", "tool_call", "tool_result", "continuation", "subagent_spawned"})
SPAWN = "spawn_subagent"
CHILD_TASK = re.compile(r"/sleep 0\.3 child (\d+)\.\d+")  # a child's task names its message
RESULT_ANSWER = re.compile(r"echo: \[subagent (\w+)[ \]]")  # a parent answering a result


def mcp_server() -> dict[str, Any]:
    return {
        "name": "calc",
        "command": [sys.executable, "-m", "tests.mcp_servers.basic"],
        "start_timeout": 60.0,
        "call_timeout": 20.0,
    }


@dataclass
class Message:
    """One message the client sends, and what became of it."""

    n: int
    session: str
    kind: str  # plain, slow, tool, spawn
    key: str
    children: int = 0  # spawn: the subagents it asks for
    tries: int = 0
    status: int | None = None  # the final answer: 202, or 409 for a quarantined session
    seq: int | None = None  # from the 202

    @property
    def text(self) -> str:
        if self.kind == "plain":
            return f"hello {self.n}"
        if self.kind == "slow":
            return f"/sleep 0.5 text {self.n}"
        if self.kind == "spawn":
            lines = range(1, self.children + 1)
            return "\n".join(f"/subagent /sleep 0.3 child {self.n}.{i}" for i in lines)
        return f'/tool add {{"a": {self.n}, "b": {TOOL_OFFSET}}}'

    @property
    def reply(self) -> str | None:
        """What echo answers to this message alone (spawn: it names the children)."""
        if self.kind == "plain":
            return f"echo: hello {self.n}"
        if self.kind == "slow":
            return f"echo: text {self.n}"
        if self.kind == "spawn":
            return None
        return f"echo: {self.n + TOOL_OFFSET}"


@dataclass
class Injector:
    """Injects into random sessions until stopped; every request is retried until it gets
    a final answer (202, or 409 for a quarantined session), with the same key."""

    daemon: Daemon
    sessions: list[str]
    rng: random.Random
    sent: list[Message] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = self.daemon.client()
        open_sessions = list(self.sessions)
        try:
            while not self.stop.is_set() and open_sessions:
                n = len(self.sent) + 1
                kind = self.rng.choices(["plain", "slow", "tool", "spawn"], [4, 2, 3, 2])[0]
                message = Message(n, self.rng.choice(open_sessions), kind, f"chaos-{SEED}-{n}")
                message.children = self.rng.choice([1, 1, 2]) if kind == "spawn" else 0
                self.sent.append(message)
                self._deliver(client, message)
                if message.status == 409:
                    open_sessions.remove(message.session)
                time.sleep(self.rng.uniform(0.1, 0.3))
        finally:
            client.close()

    def _deliver(self, client: httpx.Client, message: Message) -> None:
        # Once stopped, the request in hand is still retried (the daemon is up by then).
        give_up = None
        while give_up is None or time.monotonic() < give_up:
            if give_up is None and self.stop.is_set():
                give_up = time.monotonic() + 30.0
            message.tries += 1
            try:
                answer = client.post(
                    f"/v1/sessions/{message.session}/inject",
                    json={"text": message.text},
                    headers={"Idempotency-Key": message.key},
                )
            except httpx.TransportError as exc:
                self.failures[type(exc).__name__] += 1
                time.sleep(0.05)
                continue
            if answer.status_code == 202:
                message.status, message.seq = 202, int(answer.json()["seq"])
                return
            if answer.status_code == 409:
                message.status = 409
                return
            if answer.status_code == 503:
                self.failures["503"] += 1
                time.sleep(0.05)
                continue
            self.unexpected.append(f"message {message.n}: {answer.status_code} {answer.text}")
            return


def ready_workers(daemon: Daemon) -> list[psutil.Process]:
    """Workers of the current run that are ready (as `/v1/status` says) and still alive."""
    try:
        ready = set(daemon.worker_pids(ready=True).values())
    except httpx.HTTPError:
        return []  # not serving (yet)
    alive = []
    for proc in daemon.live_workers():
        with contextlib.suppress(psutil.Error):
            if proc.pid in ready and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def interrupt_a_turn(client: httpx.Client, rng: random.Random) -> tuple[str, int] | None:
    """Interrupt a random turn in flight; (session, seq of its `turn_ended`) or None."""
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        with contextlib.suppress(httpx.TransportError):
            listed = client.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]
            running = [s["id"] for s in listed if s["active_turn_id"] and s["status"] == "open"]
            if running:
                sid = rng.choice(running)
                answer = client.post(f"/v1/sessions/{sid}/interrupt").json()
                if answer["interrupted"]:
                    return sid, int(answer["seq"])
        time.sleep(0.05)
    return None


def wait_ready(daemon: Daemon) -> None:
    """Wait until the daemon's latest run is serving (it may be booting after a kill)."""
    proc = daemon.proc
    assert proc is not None
    wait_until(
        lambda: daemon.ready() or proc.poll() is not None,
        60,
        "the daemon to be ready",
    )
    assert proc.poll() is None, daemon.log()[-5000:]


def busy(client: httpx.Client, sessions: list[str]) -> list[str]:
    """The sessions that are open and have work, and the subagents still open (a child
    is closed when its result is reported). Each GET is also a request that touches the
    session (the first touch continues an interrupted turn even while the breaker is
    tripped).

    Children are read before their parents: a child found closed was reported before its
    parent is read, so the parent then shows the result pending or its turn running. Read
    the other way, a child reported in between would leave its parent's turn unseen.
    """
    try:
        listed = client.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]
        children = [s["id"] for s in listed if s["parent"] and s["status"] == "open"]
        rows = [client.get(f"/v1/sessions/{sid}").json() for sid in [*children, *sessions]]
    except httpx.TransportError:
        return list(sessions)
    return [
        r["id"]
        for r in rows
        if r["status"] == "open" and (r["parent"] or r["active_turn_id"] or r["pending"])
    ]


@dataclass
class Verdict:
    """What the database says about the messages; `problems` must stay empty."""

    problems: list[str] = field(default_factory=list)
    outcome: Counter[str] = field(default_factory=Counter)  # per acknowledged message
    results: Counter[str] = field(default_factory=Counter)  # per subagent result
    subagents: Counter[str] = field(default_factory=Counter)  # registry statuses
    continuations: int = 0
    quarantined: int = 0


def answered_message(
    log: list[EventRecord], answer: EventRecord, by_reply: dict[str, int]
) -> int | None:
    """The message (its n) a final answer answers.

    Echo answers the most recent user message of what it was shown, and its answer names
    that message: `echo: hello N`, `echo: text N`, or `echo: <N + TOOL_OFFSET>` (the add
    tool's result). The answer to a spawn names its children, and a tool call whose
    result was lost to a crash gets the repaired error result, which names nothing; echo
    answers with those results, and the call asked for last before the answer (in this
    turn or, for a turn that found the result already there, an earlier one) names the
    message: `add`'s first argument, or a child's task.
    """
    n = by_reply.get(answer.payload.get("text", ""))
    if n is not None:
        return n
    for event in reversed([e for e in log if e.seq < answer.seq]):
        if event.type == "model_response":
            for call in event.payload.get("tool_calls") or []:
                if call["name"] == "add":
                    return int(call["arguments"]["a"])
                task = CHILD_TASK.fullmatch(str(call["arguments"].get("task")))
                if call["name"] == SPAWN and task is not None:
                    return int(task.group(1))
    return None


def resend_notices(url: str) -> int:
    """Notices recovery wrote to ask a user to send a message again."""
    with Store(url, migrate=False) as store:
        return sum(
            1
            for info in store.sessions.list(limit=1_000)
            for e in store.events.read(info.id, limit=1_000_000)
            if e.type == "notice" and e.payload.get("resend")
        )


def describe(turn: list[EventRecord]) -> str:
    """A turn for a problem report: its id, where it started, and its continuations."""
    causes = [str(e.payload.get("cause")) for e in turn if e.type == "continuation"]
    resumed = f", continued after {'+'.join(causes)}" if causes else ""
    return f"turn {turn[0].turn_id} (started at seq {turn[0].seq}{resumed})"


def turns_of(
    sid: str, found: list[EventRecord], last_seq: int, problems: list[str]
) -> tuple[dict[str, list[EventRecord]], dict[str, EventRecord]]:
    """A session's turns and their `turn_ended`s. Its log's shape goes to `problems`:
    seqs contiguous from 1, each turn one start and one end, no work after its end."""
    if [e.seq for e in found] != list(range(1, len(found) + 1)) or last_seq != len(found):
        problems.append(f"{sid}: seqs not contiguous from 1 (last_seq {last_seq})")
    turns: dict[str, list[EventRecord]] = defaultdict(list)
    for event in found:
        if event.turn_id:
            turns[event.turn_id].append(event)
    ended: dict[str, EventRecord] = {}
    for turn_id, turn in turns.items():
        kinds = [e.type for e in turn]
        if kinds.count("turn_started") != 1 or kinds[0] != "turn_started":
            problems.append(f"{sid} turn {turn_id}: does not begin with one turn_started")
        if kinds.count("turn_ended") != 1:
            problems.append(f"{sid} turn {turn_id}: {kinds.count('turn_ended')} turn_ended")
            continue
        end = next(e for e in turn if e.type == "turn_ended")
        ended[turn_id] = end
        late = [e for e in turn if e.seq > end.seq and e.type in WORK]
        if late:
            problems.append(
                f"{sid} turn {turn_id}: {[e.type for e in late]} after its turn_ended "
                f"({end.payload})"
            )
    return turns, ended


def settled(seq: int, answered: list[int], resend_at: list[int], operator_at: list[int]) -> str:
    """How an input at `seq` that got no answer of its own was settled: a later input was
    answered (the turn that read it read this one too), a notice after it asks the user
    to resend, or an operator interrupt after it ended the turn that had it; or dropped."""
    for how, seqs in (
        ("superseded", answered),
        ("notice", resend_at),
        ("operator_interrupt", operator_at),
    ):
        if any(s > seq for s in seqs):
            return how
    return "dropped"


def judge(
    store: Store,
    sessions: list[str],
    sent: list[Message],
    interrupted: list[tuple[str, int]],
) -> Verdict:
    verdict = Verdict()
    problems = verdict.problems
    by_n = {m.n: m for m in sent}
    by_reply = {m.reply: m.n for m in sent if m.reply is not None}
    by_key = {(m.session, m.text): m for m in sent}
    for sid in sessions:
        found = store.events.read(sid, limit=1_000_000)
        info = store.sessions.get(sid)
        verdict.quarantined += info.status == "quarantined"
        # Each user message is in the log once, and at the seq its 202 named.
        stored: dict[int, int] = {}
        for event in found:
            if event.type != "user_message":
                continue
            message = by_key.get((sid, str(event.payload.get("text"))))
            if message is None:
                problems.append(f"{sid} seq {event.seq}: a message nobody sent: {event.payload}")
            elif message.n in stored:
                problems.append(
                    f"{sid}: message {message.n} stored twice (seqs {stored[message.n]}, "
                    f"{event.seq})"
                )
            else:
                stored[message.n] = event.seq
        for message in sent:
            if message.session != sid or message.status != 202:
                continue
            if stored.get(message.n) != message.seq:
                problems.append(
                    f"{sid}: acknowledged message {message.n} (seq {message.seq}) is stored "
                    f"at {stored.get(message.n)}"
                )
        turns, ended = turns_of(sid, found, info.last_seq, problems)
        verdict.continuations += sum(e.type == "continuation" for e in found)
        # Replies. A turn reads every input (user message, subagent result) committed
        # before it reads the log and echo answers the most recent one, so a turn that
        # read several answers only the last; the earlier ones were shown to the model,
        # not dropped. Each final answer is attributed to the input it answers (a
        # subagent's result by the child it names, a message by answered_message), and:
        # - no input is answered twice (the check for duplicated replies; an interrupt's
        #   cut answer, the text streamed so far, is no answer);
        # - an acknowledged message M, or a result that wakes its parent, is settled when
        #   it got its own answer, or as `settled` says (a turn that saw a later input saw
        #   M: a session's inputs are committed in seq order), or its parent is
        #   quarantined (a result: it arrives whatever the parent's state).
        results = {str(e.payload["subagent"]): e for e in found if e.type == "subagent_result"}
        answers: dict[int, list[EventRecord]] = defaultdict(list)
        result_answers: dict[str, list[EventRecord]] = defaultdict(list)
        for turn in turns.values():
            for event in turn:
                if event.type != "model_response" or event.payload.get("tool_calls"):
                    continue
                if event.payload.get("finish_reason") == "interrupted":
                    continue  # an interrupt's cut: what streamed so far, not an answer
                woke = RESULT_ANSWER.match(str(event.payload.get("text", "")))
                if woke is not None:
                    result = results.get(woke.group(1))
                    if result is None or result.seq > event.seq:
                        problems.append(f"{sid} seq {event.seq}: an answer to no result: {event}")
                    else:
                        result_answers[woke.group(1)].append(event)
                    continue
                n = answered_message(found, event, by_reply)
                if n is None or by_n[n].session != sid:
                    problems.append(f"{sid} seq {event.seq}: an answer to no message: {event}")
                    continue
                answers[n].append(event)
                if n not in stored or stored[n] > event.seq:
                    problems.append(f"{sid}: message {n} answered at seq {event.seq}, before it")
        twice = [
            (f"message {n} ({by_n[n].text!r}, seq {stored.get(n)})", g) for n, g in answers.items()
        ]
        twice += [
            (f"the result of {c} (seq {results[c].seq})", g) for c, g in result_answers.items()
        ]
        for what, given in twice:
            if len(given) > 1:
                where = ", ".join(
                    f"seq {e.seq} in {describe(turns[e.turn_id or ''])}" for e in given
                )
                problems.append(f"{sid}: {what} answered {len(given)} times: {where}")
        answered_seqs = sorted(stored[n] for n in answers if n in stored)
        answered_seqs += [results[c].seq for c in result_answers]
        resend_at = [
            e.seq
            for e in found
            if e.type == "notice" and RESEND.search(str(e.payload.get("text", "")))
        ]
        operator_at = [
            e.seq for e in found if e.type == "turn_ended" and e.payload["outcome"] == OPERATOR
        ]
        for message in sent:
            if message.session != sid or message.status != 202 or message.seq is None:
                continue
            if message.n in answers:
                its_end = ended.get(answers[message.n][0].turn_id or "")
                completed = its_end is not None and its_end.payload.get("outcome") == "completed"
                verdict.outcome["replied" if completed else "replied_turn_not_completed"] += 1
                continue
            how = settled(message.seq, answered_seqs, resend_at, operator_at)
            verdict.outcome[how] += 1
            if how == "dropped":
                problems.append(
                    f"{sid}: message {message.n} ({message.text!r}, seq {message.seq}) got "
                    f"neither a reply nor a notice"
                )
        for child, result in results.items():
            if result.payload.get("status") == "cancelled":
                how = "cancelled"  # reported without a turn of the parent's: none is owed
            elif child in result_answers:
                how = "answered"
            else:
                how = settled(result.seq, answered_seqs, resend_at, operator_at)
                if how == "dropped" and info.status == "quarantined":
                    how = "parent_quarantined"
            verdict.results[how] += 1
            if how == "dropped":
                problems.append(
                    f"{sid}: the result of subagent {child} (seq {result.seq}, "
                    f"{result.payload.get('status')}) was never answered"
                )
    judge_subagents(store, verdict)
    # Operator interrupts: never resumed.
    for sid, seq in interrupted:
        found = store.events.read(sid, limit=1_000_000)
        stop = next((e for e in found if e.seq == seq), None)
        if stop is None or stop.type != "turn_ended" or stop.payload.get("outcome") != OPERATOR:
            problems.append(f"{sid}: the interrupt's seq {seq} is not its turn_ended: {stop}")
            continue
        after = [e for e in found if e.seq > seq and e.turn_id == stop.turn_id]
        if after:
            problems.append(
                f"{sid}: operator-interrupted turn {stop.turn_id} went on: "
                f"{[(e.seq, e.type) for e in after]}"
            )
    return verdict


def judge_subagents(store: Store, verdict: Verdict) -> None:
    """Every session's subagents, by its log and the registry: one child at most for a
    tool call, and one that call asked for; for each `subagent_spawned` one registry row
    and exactly one `subagent_result`, none left running; a spawn's tool result names a
    child spawned; each child's log well formed, its task its one message, its session
    closed, and, when it completed, its last answer (and its result) echo its task."""
    problems = verdict.problems
    for info in store.sessions.list(limit=1_000):
        found = store.events.read(info.id, limit=1_000_000)
        rows = {row.id: row for row in store.subagents.children(info.id)}
        spawns = [e for e in found if e.type == "subagent_spawned"]
        spawned = Counter(str(e.payload["subagent"]) for e in spawns)
        reported = Counter(str(e.payload["subagent"]) for e in found if e.type == "subagent_result")
        results = {str(e.payload["subagent"]): e for e in found if e.type == "subagent_result"}
        asked = {
            call["id"]
            for e in found
            if e.type == "model_response"
            for call in e.payload.get("tool_calls") or []
            if call["name"] == SPAWN
        }
        for call_id, n in Counter(e.payload.get("call_id") for e in spawns).items():
            if n > 1 or call_id not in asked:
                problems.append(
                    f"{info.id}: tool call {call_id} (asked for: {call_id in asked}) spawned "
                    f"{n} subagents"
                )
        said = [
            str(e.payload.get("content")).split()[2].rstrip(";")
            for e in found
            if e.type == "tool_result"
            and e.payload.get("name") == SPAWN
            and str(e.payload.get("content")).startswith("started subagent ")
        ]
        for child in set(said) - spawned.keys():
            problems.append(f"{info.id}: a spawn's result names {child}, which it did not spawn")
        for child in sorted(spawned.keys() | rows.keys() | reported.keys()):
            row = rows.get(child)
            if spawned[child] != 1 or reported[child] != 1 or row is None:
                problems.append(
                    f"{info.id}: subagent {child}: {spawned[child]} subagent_spawned, "
                    f"{reported[child]} subagent_result, registry row: {row}"
                )
                continue
            verdict.subagents[row.status] += 1
            result = results[child]
            if row.status != result.payload.get("status") or row.result_seq != result.seq:
                problems.append(
                    f"{info.id}: subagent {child} is {row.status} in the registry (result "
                    f"seq {row.result_seq}); its result at seq {result.seq}: {result.payload}"
                )
            problems.extend(child_problems(store, row.id, row.task, result))


def child_problems(store: Store, child: str, task: str, result: EventRecord) -> list[str]:
    """A reported child's own log: see judge_subagents."""
    problems: list[str] = []
    found = store.events.read(child, limit=1_000_000)
    info = store.sessions.get(child)
    turns_of(child, found, info.last_seq, problems)
    inputs = [str(e.payload.get("text")) for e in found if e.type == "user_message"]
    if inputs != [task] or info.status != "closed":
        problems.append(f"{child}: a reported subagent ({info.status}) read {inputs}, not {task!r}")
    if result.payload.get("status") == "completed":
        expected = "echo: " + task.split(None, 2)[2]  # `/sleep S T` -> `echo: T`
        said = [str(e.payload.get("text")) for e in found if e.type == "model_response"]
        if said[-1:] != [expected] or result.payload.get("text") != expected:
            problems.append(
                f"{child}: completed, answering {said[-1:]} and reporting "
                f"{result.payload.get('text')!r}, not {expected!r}"
            )
    return problems


@pytest.mark.slow
# Alone it takes 2-4 min here; with the rest of the suite on two cores its 6 boots (the
# MCP SDK's import, the workers' start) take several times as long.
@pytest.mark.timeout(600)
def test_chaos_loses_duplicates_and_resumes_nothing_it_must_not(
    daemons: Daemons, tmp_path: Path
) -> None:
    started = time.monotonic()
    print(f"chaos seed {SEED} (rerun with TURNKEEPER_CHAOS_SEED={SEED})")
    rng = random.Random(SEED)
    daemon = daemons(
        http={"listen": f"unix:{tmp_path / 'api.sock'}"},
        pool={"workers": 2, "spare": 1},
        model={"delay": MODEL_DELAY},
        mcp={"servers": [mcp_server()]},
    ).start()
    control = daemon.client()
    sessions = [control.post("/v1/sessions", json={}).json()["id"] for _ in range(SESSIONS)]
    injector = Injector(daemon, sessions, random.Random(rng.random()))
    sender = threading.Thread(target=injector.run, name="chaos-injector")
    supervisor_kills = set(rng.sample(range(KILLS), SUPERVISOR_KILLS))
    interrupt_at = set(rng.sample(range(KILLS), INTERRUPTS))
    kills: Counter[str] = Counter()
    interrupted: list[tuple[str, int]] = []
    not_at_rest: list[str] = []
    waited = 0.0  # for boots that outlasted the pause
    sender.start()
    try:
        for step in range(KILLS):
            time.sleep(rng.uniform(*PAUSE))
            # Every kill hits a daemon that is serving; a restart boots during the pause.
            waiting = time.monotonic()
            wait_ready(daemon)
            waited += time.monotonic() - waiting
            if step in interrupt_at and (hit := interrupt_a_turn(control, rng)) is not None:
                interrupted.append(hit)
            if step in supervisor_kills:
                daemon.signal(signal.SIGKILL)
                daemon.wait(10)
                kills["supervisor"] += 1
                daemon.start(wait=False)
                continue
            workers = wait_until(lambda: ready_workers(daemon), 30, "a ready worker to kill")
            victim = rng.choice(sorted(workers, key=lambda p: p.pid))
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
                kills["worker"] += 1
        chaos_done = time.monotonic()
        wait_ready(daemon)
        injector.stop.set()
        sender.join(60)
        assert not sender.is_alive(), "the injector did not stop"
        until = time.monotonic() + IDLE_TIMEOUT
        while (not_at_rest := busy(control, sessions)) and time.monotonic() < until:
            time.sleep(0.5)
        rest_done = time.monotonic()
    finally:
        injector.stop.set()
        sender.join(60)
        control.close()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, "the daemon did not stop cleanly"

    # What the client saw, next to the daemon's log and database, for a failure's autopsy.
    record = {"seed": SEED, "interrupted": interrupted, "sent": [vars(m) for m in injector.sent]}
    (tmp_path / "chaos.json").write_text(json.dumps(record))
    with Store(daemon.url, migrate=False) as store:
        verdict = judge(store, sessions, injector.sent, interrupted)
    problems = [f"{sid}: not at rest after {IDLE_TIMEOUT:g} s" for sid in not_at_rest]
    problems += verdict.problems
    acked = [m for m in injector.sent if m.status == 202]
    summary = {
        "seed": SEED,
        "seconds": round(time.monotonic() - started, 1),
        "chaos_seconds": round(chaos_done - started, 1),
        "settle_seconds": round(rest_done - chaos_done, 1),
        "waited_for_boots_seconds": round(waited, 1),
        "kills": dict(kills),
        "operator_interrupts": len(interrupted),
        "sent": len(injector.sent),
        "acknowledged": len(acked),
        "refused_quarantined": sum(1 for m in injector.sent if m.status == 409),
        "retried_requests": sum(1 for m in injector.sent if m.tries > 1),
        "request_failures": dict(injector.failures),
        # How each acknowledged message was settled; "notice": the user was asked to
        # resend it and nothing later was answered.
        "messages": {
            k: verdict.outcome.get(k, 0)
            for k in ("replied", "superseded", "notice", "operator_interrupt", "dropped")
        }
        | dict(verdict.outcome),
        "resend_notices": resend_notices(daemon.url),
        "spawn_messages": sum(1 for m in acked if m.kind == "spawn"),
        # Registry rows by status, and how each subagent result was settled.
        "subagents": dict(verdict.subagents),
        "subagent_results": dict(verdict.results),
        "continuations": verdict.continuations,
        "quarantined_sessions": verdict.quarantined,
        "problems": len(problems),
    }
    print(json.dumps({"chaos": summary}))
    for problem in problems:
        print("PROBLEM", problem)
    assert not injector.unexpected, injector.unexpected[:10]
    assert acked, "no message was acknowledged"
    assert verdict.subagents, "no subagent was spawned"
    assert kills["supervisor"] == SUPERVISOR_KILLS and kills["worker"] > 0
    assert not problems, f"{len(problems)} problems (seed {SEED}); first: " + "\n".join(
        problems[:15]
    )
