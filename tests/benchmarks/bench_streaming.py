"""Live output: what turnkeeper adds to a model's time to first token, and what a delta
costs the supervisor.

The model is an OpenAI-compatible server of this benchmark's own on 127.0.0.1 that
streams (`stream: true`): it waits `--ttft` seconds, sends the first chunk of text and
notes the wall-clock time just before it wrote it, then `--chunks` more chunks `--gap` seconds
apart, then the usage and `[DONE]`. Each request's last user message names its session,
so the server's times are matched to the session's stream. The daemon is `turnkeeper
run` as a real process (`tests.daemon.Daemon`) with the shipped agent and
`--workers` workers, on a free loopback TCP port; the client is one aiohttp session in
this process with one attach stream (SSE) per session, open until the end.

In each of `--rounds` rounds a message is injected into each of `--sessions` sessions at
once, and the round ends when every stream has seen its turn's `turn_ended`. For each
turn, the figure is the wall-clock time the stream read its first `event: delta` minus
the time the model server wrote its first chunk: the model's own time to first token
taken out, what is left is turnkeeper's (worker, control plane, supervisor, attach
stream). Target: p99 at most `TARGET_P99_MS` with 50 sessions streaming. The first round
(each session's first turn: assignment, agent construction) is reported apart.

Then `--interrupts` sessions, one after another, each get a long answer (20 s) and are
interrupted (`POST /interrupt`) once its first delta came: the time to the interrupt's
answer (the turn ended, the text so far committed) and to the model server seeing its
request closed (target: within 200 ms).

The supervisor's CPU per delta: its CPU time (psutil) over the rounds after the first,
divided by the deltas the streams received, next to the same CPU divided by the events
they received (a committed event's cost, measured in the same run).

    python -m tests.benchmarks streaming [--sessions N] [--rounds N] [--workers N]
                                         [--ttft S] [--chunks N] [--gap S]
                                         [--interrupts N] [--quick]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp

from tests.benchmarks.figures import cpu_s, free_port, stats_ms, stop
from tests.daemon import Daemon

TARGET_P99_MS = 20.0
SLOW, SLOW_CHUNKS = "slow", 1000  # a round named slow...: an answer of 20 s, to interrupt
MARK = "bench-session-"  # the user message names its session: "bench-session-<id> round <n>"


@dataclass
class ModelServer:
    """The streaming OpenAI-compatible server: `first_chunk[(session, round)]` is the
    wall-clock time just before it wrote its first chunk of text."""

    ttft: float
    chunks: int
    gap: float
    first_chunk: dict[tuple[str, str], float] = field(default_factory=dict)
    closed: dict[tuple[str, str], float] = field(default_factory=dict)  # when it saw a hang-up

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = server.key(body)
                if not body.get("stream"):
                    self._whole(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                time.sleep(server.ttft)
                slow = key is not None and key[1].startswith(SLOW)
                for index, piece in enumerate(server.pieces(SLOW_CHUNKS if slow else None)):
                    if index == 0 and key is not None:  # just before: an upper bound
                        server.first_chunk[key] = time.time()
                    try:
                        self._chunk({"choices": [{"index": 0, "delta": {"content": piece}}]})
                    except OSError:  # the client closed the request: an interrupt
                        if key is not None:
                            server.closed[key] = time.time()
                        return
                    time.sleep(server.gap)
                self._chunk(
                    {
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": server.chunks + 1},
                    }
                )
                self._write(b"data: [DONE]\n\n")
                self._write(b"")

            def _whole(self, body: dict[str, Any]) -> None:
                answer = json.dumps(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "message": {
                                    "role": "assistant",
                                    "content": "".join(server.pieces()),
                                },
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": server.chunks + 1},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def _chunk(self, data: dict[str, Any]) -> None:
                self._write(f"data: {json.dumps(data)}\n\n".encode())

            def _write(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # every session's request at once: none refused

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def pieces(self, chunks: int | None = None) -> Iterator[str]:
        for index in range((self.chunks if chunks is None else chunks) + 1):
            yield f"word{index} "

    def whole(self) -> str:
        return "".join(self.pieces())

    @staticmethod
    def key(body: dict[str, Any]) -> tuple[str, str] | None:
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        text = str(users[-1].get("content", "")) if users else ""
        if MARK not in text:
            return None
        session, _, rest = text.split(MARK, 1)[1].partition(" round ")
        return session, rest.split()[0] if rest else ""

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Stream:
    """One session's attach stream: the wall-clock time of each turn's first delta, the
    turns ended, and what it received."""

    session: str
    first_delta: dict[str, float] = field(default_factory=dict)  # turn id -> time
    turn_round: dict[str, str] = field(default_factory=dict)  # turn id -> round
    ended: set[str] = field(default_factory=set)  # turn ids
    deltas: int = 0
    events: int = 0
    round: str = ""


async def follow(http: aiohttp.ClientSession, base: str, stream: Stream) -> None:
    """Read `stream`'s SSE until cancelled."""
    url = f"{base}/v1/sessions/{stream.session}/attach"
    async with http.get(url, headers={"Accept": "text/event-stream"}) as response:
        response.raise_for_status()  # a stream refused ends the benchmark (see `bench`)
        event, data = "", ""
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                data = line.split(":", 1)[1].strip()
            elif not line and data:
                now = time.time()
                payload = json.loads(data)
                if event == "delta":
                    stream.deltas += 1
                    stream.first_delta.setdefault(payload["turn"], now)
                else:
                    stream.events += 1
                    if event == "turn_started":
                        stream.turn_round[payload["turn_id"]] = stream.round
                    if event == "turn_ended":
                        stream.ended.add(payload["turn_id"])
                event, data = "", ""


async def bench(
    args: argparse.Namespace, daemon: Daemon, base: str, model: ModelServer
) -> dict[str, Any]:
    token = (daemon.state / "admin.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        streams = []
        for _ in range(args.sessions):
            async with http.post(f"{base}/v1/sessions", json={"title": "bench"}) as answer:
                streams.append(Stream((await answer.json())["id"]))
        readers = [asyncio.create_task(follow(http, base, s)) for s in streams]
        await asyncio.sleep(0.5)  # the streams are open
        rounds: list[dict[str, Any]] = []
        cpu_before = deltas_before = events_before = 0.0
        for number in range(args.rounds):
            if number == 1:
                cpu_before = cpu_s(daemon.pid) or 0.0
                deltas_before = sum(s.deltas for s in streams)
                events_before = sum(s.events for s in streams)
            label = str(number)
            ended_before = [len(s.ended) for s in streams]
            for s in streams:
                s.round = label

            async def inject(s: Stream, label: str) -> None:
                text = f"{MARK}{s.session} round {label}"
                url = f"{base}/v1/sessions/{s.session}/inject"
                async with http.post(url, json={"text": text}) as answer:
                    answer.raise_for_status()

            await asyncio.gather(*(inject(s, label) for s in streams))
            deadline = time.monotonic() + 120
            while any(len(s.ended) == n for s, n in zip(streams, ended_before, strict=True)):
                if time.monotonic() > deadline:
                    raise SystemExit(f"round {label}: not every turn ended within 120 s")
                if ended := next((r for r in readers if r.done()), None):
                    raise SystemExit(f"an attach stream ended: {ended.exception()!r}")
                await asyncio.sleep(0.05)
            overheads = []
            for s in streams:
                for turn, at in s.first_delta.items():
                    if s.turn_round.get(turn) == label and (s.session, label) in model.first_chunk:
                        overheads.append((at - model.first_chunk[(s.session, label)]) * 1000)
            rounds.append({"round": number, "turns": len(overheads), "overheads_ms": overheads})
        cpu = (cpu_s(daemon.pid) or 0.0) - cpu_before
        deltas = sum(s.deltas for s in streams) - deltas_before
        events = sum(s.events for s in streams) - events_before
        interrupts = await interrupt_mid_stream(http, base, streams[: args.interrupts], model)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    later = [ms for r in rounds[1:] for ms in r["overheads_ms"]]
    figures = stats_ms(later)
    return {
        "sessions": args.sessions,
        "rounds": args.rounds,
        "workers": args.workers,
        "model_ttft_s": args.ttft,
        "chunks_per_answer": args.chunks + 1,
        "chunk_gap_s": args.gap,
        "first_delta_overhead_ms_first_round": stats_ms(rounds[0]["overheads_ms"]),
        "first_delta_overhead_ms": figures,
        "target_p99_ms": TARGET_P99_MS,
        "meets_target": figures.get("p99") is not None
        and float(figures["p99"] or 0) <= TARGET_P99_MS,
        "turns_without_a_delta": sum(args.sessions - r["turns"] for r in rounds),
        "deltas_received": int(deltas),
        "events_received": int(events),
        "interrupt_answered_ms": stats_ms([ms for ms, _ in interrupts]),
        "interrupt_to_model_request_closed_ms": stats_ms([ms for _, ms in interrupts]),
        "supervisor_cpu_s": round(cpu, 3),
        "supervisor_cpu_us_per_delta": round(cpu / deltas * 1e6, 1) if deltas else None,
        "supervisor_cpu_us_per_event_and_delta": round(cpu / (deltas + events) * 1e6, 1)
        if deltas + events
        else None,
    }


async def interrupt_mid_stream(
    http: aiohttp.ClientSession, base: str, streams: list[Stream], model: ModelServer
) -> list[tuple[float, float]]:
    """Each of `streams` in turn: a long answer, interrupted once its first delta came.
    For each, the milliseconds from sending `POST /interrupt` to its answer (the turn is
    ended and the text so far committed by then) and to the model server seeing its
    request closed (within one chunk's gap of the close)."""
    found = []
    for s in streams:
        label = f"{SLOW}-{s.session[:8]}"
        s.round = label
        text = f"{MARK}{s.session} round {label}"
        async with http.post(f"{base}/v1/sessions/{s.session}/inject", json={"text": text}):
            pass
        deadline = time.monotonic() + 60
        while not any(s.turn_round.get(t) == label for t in s.first_delta):
            if time.monotonic() > deadline:
                raise SystemExit("a long answer streamed nothing within 60 s")
            await asyncio.sleep(0.01)
        sent = time.time()
        async with http.post(f"{base}/v1/sessions/{s.session}/interrupt") as answer:
            assert (await answer.json())["interrupted"], "no turn was running"
        answered = time.time()
        while (s.session, label) not in model.closed:
            if time.monotonic() > deadline:
                raise SystemExit("the model request was not closed within 60 s")
            await asyncio.sleep(0.005)
        closed = model.closed[(s.session, label)]
        found.append(((answered - sent) * 1000, (closed - sent) * 1000))
    return found


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks streaming")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ttft", type=float, default=0.3)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--interrupts", type=int, default=10, help="long answers interrupted")
    parser.add_argument("--quick", action="store_true", help="10 sessions, 2 rounds")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.sessions, args.rounds = 10, 2
    model = ModelServer(args.ttft, args.chunks, args.gap)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tk-bench-streaming-") as root:
        daemon = Daemon(
            Path(root),
            http={"listen": f"127.0.0.1:{port}", "max_streams_per_principal": args.sessions + 8},
            pool={"workers": args.workers, "spare": 0},
            agent={"class": "workers.agents.tool_loop:ToolLoopAgent"},
            model={"provider": "openai", "base_url": model.url, "model": "bench", "timeout": 60.0},
        )
        try:
            daemon.start()
            figures = asyncio.run(bench(args, daemon, f"http://127.0.0.1:{port}", model))
        except SystemExit:
            print(daemon.log()[-4000:], file=sys.stderr)  # why the round did not end
            raise
        finally:
            stop(daemon)
            model.close()
    print(json.dumps(figures, indent=2, sort_keys=True))
    return figures
