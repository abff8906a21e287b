"""Deliveries against the real daemon: how late a final answer reaches its target.

A daemon (echo model, 2 workers + 1 spare, SQLite) whose sessions are all bound to one
target, a healthy receiver on loopback (`tests.deliveries_receiver`, answering 200).
`--turns` messages are sent across `--sessions` sessions, one round at a time (a message
into every session, then wait for every turn of the round to end), so each answer is a
turn of its own.

- `lag_s`: for each delivered answer, its receipt at the receiver (first, by
  Idempotency-Key) minus its event's `created_at` (both this host's clock): the commit,
  the courier's wake-up and claim, the signing and the POST.
- `baseline_post_s`: the same receiver sent a body of the same shape by this process, one
  plain signed httpx POST after another: from before the signing to its receipt.
- `ratio_p50`: the median lag over the median baseline.

    python -m tests.benchmarks deliveries [--turns N] [--sessions S] [--posts P]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from supervisor.deliveries import rules
from supervisor.store import Store
from tests.benchmarks.figures import percentile
from tests.daemon import Daemon, wait_until
from tests.deliveries_receiver import Receiver

SECRET = "bench-deliveries-secret"
SECRET_ENV = "TK_BENCH_DELIVERY_SECRET"


def _summary(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "p50": round(percentile(ordered, 50), 5),
        "p95": round(percentile(ordered, 95), 5),
        "max": round(ordered[-1], 5),
    }


def _turns(daemon: Daemon, store: Store, receiver: Receiver, turns: int, sessions: int) -> float:
    """Send `turns` messages round by round; the seconds until every answer was received."""
    with daemon.client() as client:
        ids = [
            client.post("/v1/sessions", json={"deliver_to": "bench"}).json()["id"]
            for _ in range(sessions)
        ]
    started = time.monotonic()
    sent = 0
    while sent < turns:
        round_ = ids[: min(sessions, turns - sent)]
        seqs = {
            sid: store.events.append(sid, "user_message", {"text": f"m{sent + n}"}, writer="cli")
            for n, sid in enumerate(round_)
        }
        sent += len(round_)

        def ended(seqs: dict[str, int] = seqs) -> bool:
            return all(
                any(e.type == "turn_ended" for e in store.events.read(sid, after=seq))
                for sid, seq in seqs.items()
            )

        wait_until(ended, 120, "a round of turns")
    wait_until(lambda: len(receiver.keys()) >= turns, 120, "every answer at the receiver")
    return time.monotonic() - started


def _baseline(receiver: Receiver, posts: int) -> list[float]:
    """Plain signed POSTs to the receiver: from before the signing to the receipt."""
    found = []
    with httpx.Client(trust_env=False, timeout=10) as client:
        for n in range(posts):
            key = "b" + uuid.uuid4().hex
            begun = time.time()
            content = rules.body(key, "baseline", n + 1, "answer", f"echo: m{n}", begun)
            stamp = int(begun)
            headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                rules.TIMESTAMP_HEADER: str(stamp),
                rules.SIGNATURE_HEADER: rules.signature(SECRET.encode(), stamp, content),
            }
            client.post(receiver.url, content=content, headers=headers).raise_for_status()
            received = next(r for r in reversed(receiver.records) if r.key == key)
            found.append(received.at - begun)
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks deliveries")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--posts", type=int, default=200)
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="tk-bench-deliveries-") as root,
        Receiver(SECRET) as receiver,
    ):
        target = {"name": "bench", "url": receiver.url, "secret_env": SECRET_ENV}
        daemon = Daemon(Path(root) / "d", pool={"spare": 1}, delivery={"targets": [target]})
        daemon.env[SECRET_ENV] = SECRET
        try:
            daemon.start()
            with Store(daemon.url, migrate=False) as store:
                seconds = _turns(daemon, store, receiver, args.turns, args.sessions)
                wait_until(
                    lambda: store.deliveries.counts()["pending"] == 0, 60, "the last verdicts"
                )
                rows = store.deliveries.list(limit=args.turns + 100)
        finally:
            daemon.kill_everything()
        first = receiver.first_seen()
        lags = [r.at - float(r.document["created_at"]) for r in first]
        duplicates = sum(receiver.duplicates.values())
        unverified = sum(1 for r in receiver.records if not r.verified)
        baseline = _baseline(receiver, args.posts)
    lag, base = _summary(lags), _summary(baseline)
    figures: dict[str, Any] = {
        "benchmark": "deliveries",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "turns": args.turns,
        "sessions": args.sessions,
        "delivered": sum(1 for d in rows if d.status == "delivered"),
        "received": len(first),
        "duplicates": duplicates,
        "unverified": unverified,
        "seconds": round(seconds, 2),
        "lag_s": lag,
        "baseline_post_s": base,
        "ratio_p50": round(float(lag["p50"]) / float(base["p50"]), 2) if lags else None,
    }
    print(json.dumps(figures, indent=2))
    return figures
