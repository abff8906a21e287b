"""The console's cost to the supervisor: CPU with the overview open in a browser.

The overview polls `/v1/status`, `/readyz` and `/metrics` every 5 s while it is shown. The
daemon is `turnkeeper run` as a real process with the shipped pool (2 workers + 1 spare),
SQLite, listening on a loopback port. After it is ready and has settled, the supervisor's
CPU time (user + system) is read over `--seconds` of wall time twice: first with no page
open (the baseline), then with the overview open in Debian's headless Chromium (signed in
as the admin, so every panel is drawn). The target is that the page adds under 1 % of one
core; the supervisor's whole share with the page open is reported too, and what the page
asked for in that time.

    python -m tests.benchmarks console [--seconds S] [--quick]

Needs Debian's `chromium` and `chromium-driver`. Prints one JSON object; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks.figures import cpu_s, free_port, shipped_pool, stop
from tests.console.conftest import Browser, browser_paths, chromium
from tests.daemon import Daemon

TARGET_PERCENT = 1.0  # of one core: what the open page may add to the supervisor
SECONDS = 60.0
QUICK_SECONDS = 15.0
SETTLE_S = 5.0


def supervisor_percent(pid: int, seconds: float) -> float:
    """The supervisor's CPU over `seconds` of wall time, as % of one core."""
    proc = psutil.Process(pid)
    before, started = cpu_s(proc) or 0.0, time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    return round(100 * ((cpu_s(proc) or 0.0) - before) / wall, 2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_console")
    parser.add_argument("--seconds", type=float, default=None, help=f"default {SECONDS:g}")
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s each")
    args = parser.parse_args(argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else SECONDS)
    chromium_path, driver_path = browser_paths()
    if chromium_path is None or driver_path is None:
        raise SystemExit("the console benchmark needs Debian's chromium and chromium-driver")
    with tempfile.TemporaryDirectory(prefix="tk-bench-console-") as tmp:
        root = Path(tmp)
        port = free_port()
        daemon = Daemon(root / "daemon", pool=shipped_pool(), http={"listen": f"127.0.0.1:{port}"})
        driver = None
        try:
            daemon.start()
            token = (daemon.state / "admin.token").read_text().strip()
            time.sleep(args.settle)
            baseline = supervisor_percent(daemon.pid, seconds)
            driver = chromium(chromium_path, driver_path, root)
            browser = Browser(driver, root)
            browser.open(f"http://127.0.0.1:{port}", "/ui/", token)
            browser.find("#slots table")
            asked_before = browser.js("return performance.getEntriesByType('resource').length")
            with_page = supervisor_percent(daemon.pid, seconds)
            asked = browser.js("return performance.getEntriesByType('resource').length")
        finally:
            if driver is not None:
                driver.quit()
            stop(daemon)
    added = round(with_page - baseline, 2)
    result = {
        "benchmark": "console",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": seconds,
        "baseline_supervisor_percent": baseline,
        "overview_open_supervisor_percent": with_page,
        "added_percent": added,
        "requests_while_open": asked - asked_before,
        "target_percent": TARGET_PERCENT,
        "met": added <= TARGET_PERCENT,
        "total_under_target": with_page <= TARGET_PERCENT,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
