"""Live output through the supervisor: a delta from a worker's socket to an attach client.

The supervisor's side as the daemon builds it, in this process: the control plane (a
ZeroMQ ROUTER bound on ipc, `ControlPlane`), the pool's handling of what workers say
(`Pool._said`), the bus, the hub and the aiohttp application on a unix socket, over a
SQLite store holding the sessions. A child process (`--child`) plays the other ends: the
workers (ZeroMQ DEALERs with the routing identities the plane admitted) and one attach
client per session (aiohttp, each stream opened before the first delta). Every session
streams: a delta every `DELTA_INTERVAL` (50 ms, the most the control plane allows a turn),
a few words each, for `--seconds`. A delta's text carries the time it was sent
(CLOCK_MONOTONIC, the same clock in both processes); its client takes the difference.

Figures:
- `added_latency_ms`: from the worker's send to the client's read of the delta, over every
  delta (n, min, p50, p99, max, mean): what turnkeeper adds to a model's time to first
  token, and to every token after it, between the worker and the client. The worker's own
  part (the model's stream to its coalescer) is not in it; target p99 <= 20 ms with 50
  sessions streaming.
- `supervisor_cpu_us_per_delta`: this process's CPU time (user + system) while the
  sessions stream (from the child's "streaming" to its "streamed"), divided by the deltas
  delivered: the control plane, the pool, the bus, the hub and the SSE writes. Nothing of
  the child's is in it. The same process's CPU while the clients are attached and nothing
  streams, for as long, is `idle_supervisor_cpu_percent` (the streams' idle checks, the
  hub's reads of the heads of attached sessions); `..._less_idle` takes it out.
- `delivered`, `dropped`: deltas the clients read, and the hub's count of those it
  dropped for a client too slow (none expected).

    python -m tests.benchmarks deltas [--sessions N] [--seconds S] [--quick]

Prints one JSON object. It measures; it asserts nothing. With the worker side in place,
the end-to-end figure (a model server's time to first token against the first delta a
client reads) belongs beside this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from supervisor.contract import control
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.slots import Slot
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.pool import pool as pools
from supervisor.pool.deltas import DeltaIndexes
from supervisor.pool.handle import WorkerHandle
from supervisor.pool.plane import ControlPlane, Said
from supervisor.runtime.bus import Bus, Committed
from supervisor.store import Store
from tests.benchmarks.figures import stats_ms
from tests.conftest import PYTHON, REPO, python_env

TOKEN = "bench-token"
TURN = "b" * 32
WORKERS = 2  # the shipped pool's
DEFAULTS = {"sessions": 50, "seconds": 10.0}
QUICK = {"sessions": 10, "seconds": 3.0}


class _Ownership:
    def want(self) -> None:
        pass


class _Pool(pools.Pool):
    """The real pool's handling of what workers say, without processes to run."""

    def __init__(self, bus: Bus, metrics: Metrics) -> None:  # no super(): no processes
        self.bus, self.metrics, self.log = bus, metrics, log("pool")
        self.clock = time.monotonic
        self.ownership: Any = _Ownership()
        self.stopping = False
        self.delta_indexes = DeltaIndexes()
        bus.subscribe(Said, self._said)
        bus.subscribe(Committed, self._committed)


class _Process:
    pid = 1
    exitcode = None


async def supervisor(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Serve the deltas of the child's workers to its clients; the figures."""
    with Store(f"sqlite:///{tmp / 'turnkeeper.db'}") as store:
        sessions = [store.sessions.create("admin").id for _ in range(args.sessions)]
        bus, metrics = Bus(), Metrics()
        tokens = Tokens({"admin": digest(TOKEN)})
        config = Config.model_validate({"http": {"max_streams_per_principal": 10_000}})
        api = Api(config, store, Hub(), tokens, metrics, boot_id="c" * 32, bus=bus)
        _Pool(bus, metrics)
        plane = ControlPlane(f"ipc://{tmp / 'control'}", bus)
        plane.bind()
        routes = []
        for index in range(WORKERS):
            worker = WorkerHandle(Slot(index), f"w{index}.1", _Process(), False, 0.0)
            worker.route, worker.hello = f"bench-{index}".encode(), True
            worker.sessions = set(sessions[index::WORKERS])
            plane.admit(worker)
            routes.append(worker.route.decode())
        receiving = asyncio.ensure_future(plane.receive())
        runner = web.AppRunner(api.app(), shutdown_timeout=1.0)
        await runner.setup()
        await web.UnixSite(runner, str(tmp / "api.sock")).start()
        command = [PYTHON, "-m", "tests.benchmarks.bench_deltas", "--child", str(tmp)]
        command += ["--seconds", str(args.seconds), "--routes", ",".join(routes)]
        command += ["--sessions-list", ",".join(sessions)]
        child = await asyncio.create_subprocess_exec(
            *command, cwd=REPO, env=python_env(), stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        await child.stdout.readline()  # "idle": the clients are attached, nothing streams
        idle_before = time.process_time()
        await child.stdout.readline()  # "streaming"
        cpu_before = time.process_time()
        idle = (cpu_before - idle_before) / args.seconds  # CPU seconds a second, idle
        await child.stdout.readline()  # "streamed"
        cpu = time.process_time() - cpu_before
        out, _ = await child.communicate()
        receiving.cancel()
        api.hub.close_all()
        await runner.cleanup()
        plane.close()
    found = json.loads(out)
    delivered = len(found["latencies_ms"])
    dropped = metrics.registry.get_sample_value(
        "turnkeeper_deltas_dropped_total", {"where": "stream"}
    )
    return {
        "added_latency_ms": stats_ms(found["latencies_ms"]),
        "target_p99_ms": 20.0,
        "supervisor_cpu_us_per_delta": round(cpu / max(delivered, 1) * 1e6, 1),
        "idle_supervisor_cpu_percent": round(idle * 100, 2),
        "supervisor_cpu_us_per_delta_less_idle": round(
            max(cpu - idle * found["streamed_s"], 0.0) / max(delivered, 1) * 1e6, 1
        ),
        "delivered": delivered,
        "sent": found["sent"],
        "dropped": dropped,
    }


async def child(args: argparse.Namespace) -> None:
    """The workers and the clients: stream, read, print the latencies as JSON."""
    tmp = Path(args.child)
    sessions = args.sessions_list.split(",")
    routes = args.routes.split(",")
    context = zmq.asyncio.Context()
    dealers = []
    for route in routes:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, route.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{tmp / 'control'}")
        dealers.append(dealer)
    latencies: list[float] = []
    connector = aiohttp.UnixConnector(path=str(tmp / "api.sock"), limit=0)
    headers = {"Authorization": f"Bearer {TOKEN}", "Last-Event-ID": "0"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        streams = [
            await http.get(f"http://turnkeeper/v1/sessions/{sid}/attach", timeout=None)
            for sid in sessions
        ]
        readers = [asyncio.ensure_future(read(s, latencies)) for s in streams]
        await asyncio.sleep(0.5)  # every stream subscribed (each did before its answer)
        print("idle", flush=True)
        await asyncio.sleep(args.seconds)
        print("streaming", flush=True)
        began = time.monotonic()
        sent = await stream(args, sessions, dealers)
        await asyncio.sleep(0.2)  # the last deltas read
        print("streamed", flush=True)
        streamed_s = time.monotonic() - began
        for reader in readers:
            reader.cancel()
        for response in streams:
            response.close()
    for dealer in dealers:
        dealer.close()
    context.term()
    print(json.dumps({"latencies_ms": latencies, "sent": sent, "streamed_s": streamed_s}))


async def stream(args: argparse.Namespace, sessions: list[str], dealers: list[Any]) -> int:
    """Every session a delta each DELTA_INTERVAL, spread over the interval; how many sent."""
    workers = len(dealers)
    index, sent = 0, 0
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        tick = time.monotonic()
        for n, session in enumerate(sessions):
            frame = control.encode(
                "delta",
                worker=f"w{n % workers}.1",
                session=session,
                turn=TURN,
                index=index,
                text=f"{time.monotonic():.6f} some words of the answer ",
                elapsed=0.1,
            )
            await dealers[n % workers].send(frame)
            sent += 1
            await asyncio.sleep(control.DELTA_INTERVAL / len(sessions) * 0.5)
        index += 1
        await asyncio.sleep(max(0.0, control.DELTA_INTERVAL - (time.monotonic() - tick)))
    return sent


async def read(response: aiohttp.ClientResponse, latencies: list[float]) -> None:
    async for raw in response.content:
        line = raw.decode()
        if line.startswith("data: ") and '"turn"' in line:
            data = json.loads(line[6:])
            sent_at = float(data["text"].split(" ", 1)[0])
            latencies.append((time.monotonic() - sent_at) * 1000)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_deltas")
    parser.add_argument("--sessions", type=int, default=None, help="sessions streaming (50)")
    parser.add_argument("--seconds", type=float, default=None, help="how long they stream (10)")
    parser.add_argument("--quick", action="store_true", help="10 sessions for 3 s")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--routes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--sessions-list", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.child is not None:
        asyncio.run(child(args))
        return {}
    with tempfile.TemporaryDirectory(prefix="turnkeeper-bench-") as tmp:
        figures = asyncio.run(supervisor(args, Path(tmp)))
    result = {
        "benchmark": "deltas",
        "settings": {"sessions": args.sessions, "seconds": args.seconds, "workers": WORKERS},
        **figures,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
