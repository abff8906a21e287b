"""A child process that appends to the store and reports each append that returned.

python -m tests.procs.appender contend URL SECONDS SID...
    Steal a random session's lease, append a few events with that token, repeat.
    Prints `ok SID SEQ MARKER` for every committed append and `lost SID` for every
    LeaseLost. Any other error is a failure: traceback and exit 1.

python -m tests.procs.appender loop URL THREADS SID...
    Append forever from THREADS threads (group commit), one session per thread,
    printing `ok SID SEQ MARKER` after each append returned. Meant to be SIGKILLed.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
import uuid

from supervisor.store import LeaseLost, Store

_print_lock = threading.Lock()


def report(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def contend(store: Store, seconds: float, sessions: list[str]) -> None:
    owner = f"p{os.getpid()}"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sid = random.choice(sessions)
        lease = store.leases.acquire(sid, owner, ttl=60, force=True)
        assert lease is not None
        for _ in range(random.randint(1, 5)):
            marker = uuid.uuid4().hex
            try:
                seq = store.events.append(sid, "notice", {"marker": marker}, token=lease.token)
            except LeaseLost:
                report(f"lost {sid}")
                break
            report(f"ok {sid} {seq} {marker}")


def loop(store: Store, threads: int, sessions: list[str]) -> None:
    owner = f"p{os.getpid()}"

    def run(sid: str) -> None:
        lease = store.leases.acquire(sid, owner, ttl=60, force=True)
        assert lease is not None
        while True:
            marker = uuid.uuid4().hex
            seq = store.events.append(sid, "notice", {"marker": marker}, token=lease.token)
            report(f"ok {sid} {seq} {marker}")

    workers = [
        threading.Thread(target=run, args=(sessions[i % len(sessions)],), daemon=True)
        for i in range(threads)
    ]
    report("started")
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main(argv: list[str]) -> int:
    mode, url, number, *sessions = argv
    store = Store(url, migrate=False)
    try:
        if mode == "contend":
            contend(store, float(number), sessions)
        else:
            loop(store, int(number), sessions)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
